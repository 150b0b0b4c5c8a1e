"""Experiment trackers: where a run's metrics, validation images, recipe and data provenance also go.

``trainer.trackers`` names them (``tensorboard``, ``wandb``, ``mlflow``). Each is one small class with the
same five methods (``Tracker``: metrics, an image, a video, the recipe and provenance, close); ``start_trackers``
starts the named ones (rank 0 only: the caller decides) and returns a ``Trackers`` that passes every call
to each. A tracker that cannot start, or fails later,
costs one warning line and the run goes on without it, unless ``required`` (``trainer.trackers_required``).

Where they connect comes from each library's own environment, never from a recipe (credentials are never
written down): W&B reads ``WANDB_API_KEY``, ``WANDB_MODE`` (``offline`` writes under the run folder),
``WANDB_ENTITY``; MLflow reads ``MLFLOW_TRACKING_URI`` (and its ``MLFLOW_TRACKING_TOKEN`` or user/password).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

KNOWN_TRACKERS = ("tensorboard", "wandb", "mlflow")
_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackerError(RuntimeError):
    """A tracker could not start or log, and ``trainer.trackers_required`` is true."""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: nested settings as the flat parameters MLflow keeps."""
    if not isinstance(data, dict):
        return {prefix: data}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def scalars(record: dict[str, Any], prefix: str = "train") -> dict[str, float]:
    """The numbers of a metrics record (``metrics.jsonl`` line) that trackers plot, as ``<prefix>/<name>``."""
    return {f"{prefix}/{k}": float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker(ABC):
    """One backend. ``url``: where a person follows the run (a web page, or a local folder)."""

    name = "tracker"
    url: str | None = None

    @abstractmethod
    def log_metrics(self, values: dict[str, float], step: int) -> None:
        """The scalars of one step (``scalars`` of a ``metrics.jsonl`` record)."""

    @abstractmethod
    def log_image(self, key: str, path: Path, step: int) -> None:
        """A validation grid (PNG) under ``key``."""

    @abstractmethod
    def log_video(self, key: str, path: Path, step: int) -> None:
        """A video family's validation videos (an animated GIF, ``latentmill.trainer.validation.save_video``)."""

    @abstractmethod
    def log_info(self, recipe: dict[str, Any], info: dict[str, Any]) -> None:
        """The resolved recipe and the run's provenance (snapshot id, prep summary), once at the start."""

    @abstractmethod
    def close(self, status: str = "finished") -> None:
        """End the run as ``finished``, ``failed`` or ``killed`` (stopped by a signal: it can resume)."""


class TensorBoardTracker(Tracker):
    """Event files under ``<log_dir>/tb`` (``tensorboard --logdir``)."""

    name = "tensorboard"

    def __init__(self, project: str, run_name: str, log_dir: Path, job_type: str = "train") -> None:
        # torch raises ImportError here when the tensorboard package is missing
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir / "tb"))
        self.url = str(log_dir / "tb")

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            self.writer.add_image(key, np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def log_video(self, key: str, path: Path, step: int) -> None:
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        # what add_video writes (an image summary holding a GIF), without the moviepy it needs to encode one
        with Image.open(path) as video:
            width, height = video.size
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=path.read_bytes())
        self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=key, image=image)]), step)

    def log_info(self, recipe: dict[str, Any], info: dict[str, Any]) -> None:
        for tag, data in (("recipe", recipe), ("provenance", info)):
            self.writer.add_text(tag, "```json\n" + json.dumps(data, indent=1, default=str) + "\n```", 0)

    def close(self, status: str = "finished") -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run in project ``project``; its local files under ``<log_dir>/wandb``."""

    name = "wandb"

    def __init__(self, project: str, run_name: str, log_dir: Path, job_type: str = "train") -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=run_name, dir=str(log_dir), job_type=job_type,
                              reinit="create_new", settings=wandb.Settings(silent=True))
        self.url = self.run.url or self.run.dir  # offline: the local run folder (`wandb sync` uploads it)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.wandb.Image(str(path))}, step=step)

    def log_video(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.wandb.Video(str(path), format="gif")}, step=step)

    def log_info(self, recipe: dict[str, Any], info: dict[str, Any]) -> None:
        self.run.config.update({"recipe": recipe, **info}, allow_val_change=True)
        self.run.summary.update({k: v for k, v in info.items() if isinstance(v, (str, int, float))})

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code={"finished": 0, "failed": 1}.get(status, 130))


class MlflowTracker(Tracker):
    """An MLflow run in the experiment ``project`` of the tracking server ``$MLFLOW_TRACKING_URI``."""

    name = "mlflow"

    def __init__(self, project: str, run_name: str, log_dir: Path, job_type: str = "train") -> None:
        import mlflow
        from mlflow import MlflowClient

        uri = mlflow.get_tracking_uri()
        if uri.startswith(("http://", "https://")):
            _check_reachable(uri)  # MLflow's own client retries an absent server for minutes
        self.client = MlflowClient(uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags={"job_type": job_type}).info.run_id
        self.url = (f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}"
                    if uri.startswith(("http://", "https://")) else uri)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # queued to MLflow's logging thread: a request per step would hold up the step (``close`` flushes)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()],
                              synchronous=False)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), key)

    def log_video(self, key: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), key)

    def log_info(self, recipe: dict[str, Any], info: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, json.dumps(v, default=str) if not isinstance(v, str) else v)
                  for k, v in flatten(recipe).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        for key, value in info.items():
            if isinstance(value, (str, int, float)):
                self.client.set_tag(self.run_id, key, str(value))
        self.client.log_dict(self.run_id, recipe, "recipe.json")
        self.client.log_dict(self.run_id, info, "provenance.json")

    def close(self, status: str = "finished") -> None:
        import mlflow

        mlflow.flush_async_logging()
        self.client.set_terminated(self.run_id, status.upper())  # FINISHED, FAILED, KILLED: MLflow's run statuses


def _check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Raise ``ConnectionError`` in seconds when the tracking server does not answer its health check."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # it answered: an older server without /health, or one behind a proxy that wants a login
    except (OSError, ValueError) as err:
        raise ConnectionError(f"the MLflow server {uri} does not answer ({err})") from None


BACKENDS: dict[str, Callable[..., Tracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
}


class Trackers:
    """The started trackers; each call goes to every one. A failing tracker is dropped with one warning
    (or raises ``TrackerError`` when ``required``)."""

    def __init__(self, trackers: list[Tracker], required: bool = False) -> None:
        self.active, self.required = list(trackers), required

    @property
    def urls(self) -> dict[str, str | None]:
        """Where each started tracker shows the run, by tracker name."""
        return {t.name: t.url for t in self.active}

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as err:
                if self.required:
                    raise TrackerError(f"tracker {tracker.name}: {what} failed: {type(err).__name__}: {err}") from err
                log.warning("tracker %s: %s failed (%s: %s); the run goes on without it", tracker.name, what,
                            type(err).__name__, err)
                self.active.remove(tracker)

    def log_metrics(self, record: dict[str, Any], prefix: str = "train") -> None:
        """The numbers of one ``metrics.jsonl`` record, at its step, as ``<prefix>/<name>``."""
        values = scalars(record, prefix)
        self._each("logging metrics", lambda t: t.log_metrics(values, int(record["step"])))

    def log_image(self, key: str, path: Path, step: int) -> None:
        self._each("logging an image", lambda t: t.log_image(key, Path(path), step))

    def log_video(self, key: str, path: Path, step: int) -> None:
        self._each("logging a video", lambda t: t.log_video(key, Path(path), step))

    def log_info(self, recipe: dict[str, Any], info: dict[str, Any]) -> None:
        self._each("logging the recipe", lambda t: t.log_info(recipe, info))

    def close(self, status: str = "finished") -> None:
        """End every run: ``finished``, ``failed``, or ``killed`` (a stop by SIGINT or SIGTERM)."""
        self._each("closing", lambda t: t.close(status))
        self.active = []


def start_trackers(names: list[str], *, project: str, run_name: str, log_dir: Path, required: bool = False,
                   job_type: str = "train") -> Trackers:
    """Start the trackers ``names`` (of ``KNOWN_TRACKERS``: ``TrainerConfig.validate`` checks them) for one run; ``log_dir`` holds their local files (``tb/``, ``wandb/``).

    ``job_type``: ``train``, or ``prep`` for a prep's summary. One that cannot start (a missing
    package, no credentials, a server that does not answer) is left out with one warning line, or raises
    ``TrackerError`` when ``required``.
    """
    started = []
    for name in names:
        try:
            started.append(BACKENDS[name](project, run_name, log_dir, job_type=job_type))
        except Exception as err:
            reason = (f"the {_EXTRA[name]} package is not installed (pip install 'latentmill[{_EXTRA[name]}]')"
                      if isinstance(err, ImportError) else f"{type(err).__name__}: {err}")
            reason = " ".join(reason.split())  # one line, whatever the library's message looks like
            if required:
                raise TrackerError(f"trainer.trackers: {name} could not start: {reason} "
                                   "(trainer.trackers_required is true)") from None
            log.warning("tracker %s not started: %s; the run goes on without it", name, reason)
    return Trackers(started, required)
