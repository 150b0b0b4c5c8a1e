"""The flows users deploy: ``prep``, ``train`` and ``prep-then-train`` (see prefect.yaml).

Each flow takes a recipe path plus dotted overrides, validates the whole recipe before any work starts,
and returns the run summary (``{"stages": {...}, "train": {...}}``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from latentmill.pipelines.launch import train_recipe
from latentmill.pipelines.objectstore import gc_store
from latentmill.pipelines.prep import prep, release_prep_models, run_prep
from latentmill.pipelines.report import TrainProgress
from latentmill.pipelines.runs import RunPlan, finish_run, local_recipe, training_run
from prefect import flow, task
from prefect.cache_policies import NONE

from latentmill import interrupt
from latentmill.core.config import ConfigError
from latentmill.core.store import is_url
from latentmill.recipe import Recipe, load_recipe, recipe_from_dict


def _train_run_name(parameters: dict[str, Any]) -> str:
    """A training task run's name in the UI: ``train · 200 steps · lora`` (``torchrun 2×1 · ...``)."""
    trainer = parameters["recipe_data"]["trainer"]
    launch = parameters.get("launch")
    how = f"torchrun {launch.nproc}×{launch.nnodes}" if launch is not None else "train"
    return f"{how} · {trainer['max_steps']} steps · {trainer['mode']}"


@task(name="train-model", task_run_name=_train_run_name, cache_policy=NONE)
def train_task(recipe_data: dict, run_dir: str, run_key: str) -> dict[str, Any]:
    """Train on the recipe's latent cache in this process, in the run folder ``run_dir``, and export.

    Progress (a log line and a progress artifact every 5% and 5 s at most) and the final metrics (table
    ``train-metrics``) go on the flow run this task belongs to: the run the user started.
    """
    recipe = recipe_from_dict(recipe_data)
    progress = TrainProgress(recipe.trainer.max_steps)
    summary = finish_run(local_recipe(recipe), RunPlan(Path(run_dir), run_key),
                         train_recipe(recipe, run_dir, on_step=progress))
    progress.finish(summary)
    return summary


@dataclasses.dataclass(frozen=True)
class Launch:
    """How many training processes, and on how many nodes (torchrun's c10d rendezvous when > 1)."""

    nproc: int = 1  # processes on this node
    nnodes: int = 1
    rdzv_endpoint: str | None = None  # host:port of the rendezvous (the first node), needed when nnodes > 1
    rdzv_id: str = "latentmill"

    @property
    def rendezvous(self) -> str | None:
        """What names one training on several nodes (each runs the same command): its rendezvous."""
        return f"{self.rdzv_endpoint}/{self.rdzv_id}" if self.nnodes > 1 else None

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone", f"--nproc-per-node={self.nproc}"]
        return [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}"]


class MetricsFollower:
    """The last record rank 0 has appended to ``metrics.jsonl``, read from the file's tail: nothing until the
    file has changed since the follower started (what was there is the previous run's)."""

    def __init__(self, path: Path):
        self.path = path
        self.before = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_size, stat.st_mtime_ns

    def last_record(self) -> dict[str, Any] | None:
        stat = self._stat()
        if stat is None or stat == self.before:
            return None
        self.before = None  # changed: from now on every look counts
        with open(self.path, "rb") as fh:
            fh.seek(max(0, stat[1] - 4096))  # a record is a few hundred bytes
            tail = fh.read()
        for line in reversed(tail[: tail.rfind(b"\n") + 1].splitlines()):  # whole lines only
            try:
                return json.loads(line)
            except ValueError:
                continue
        return None


@task(name="train-torchrun", task_run_name=_train_run_name, cache_policy=NONE)
def torchrun_task(recipe_data: dict, launch: Launch, run_dir: str, poll_s: float = 5.0) -> dict[str, Any]:
    """Train with the processes torchrun starts on this node, in the run folder ``run_dir``; return the
    summary (rank 0's node only).

    While they train, this task follows rank 0's ``metrics.jsonl`` every ``poll_s`` seconds and reports
    progress on the run as ``train_task`` does; the final metrics follow.
    """
    recipe = recipe_from_dict(recipe_data)
    folder = Path(run_dir)
    recipe_json, summary_json = folder / "launch-recipe.json", folder / "launch-summary.json"
    recipe_json.write_text(json.dumps(recipe_data))
    summary_json.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch.torchrun_args(),
           "-m", "latentmill.pipelines.launch", str(recipe_json), str(summary_json), str(folder)]
    progress = TrainProgress(recipe.trainer.max_steps, interval_s=poll_s)
    follower = MetricsFollower(folder / "metrics.jsonl")
    last: dict[str, Any] | None = None

    def follow() -> None:  # rank 0's progress, while the ranks train
        nonlocal last
        if (record := follower.last_record()) is not None:
            progress(record)
            last = record

    returncode, _ = interrupt.run_ranks(cmd, follow, poll_s)
    if interrupt.requested() is not None and not summary_json.is_file():  # stopped before the last step
        from latentmill.trainer.train import stopped_detail

        last = follower.last_record() or last
        raise interrupt.Interrupted(interrupt.requested(), stopped_detail(
            last["step"] if last else None, folder / "checkpoints", recipe.trainer.resume))
    if returncode != 0:
        raise RuntimeError(f"torchrun exited with status {returncode}; see the rank logs above")
    summary = (json.loads(summary_json.read_text()) if summary_json.is_file()  # else another node has rank 0
               else {"steps": None, "note": "the summary is written on the node that holds global rank 0"})
    progress.finish(summary)  # rank 0 finished the run (pipelines.launch): run.json, the export link
    return summary


def check_launch(recipe: Recipe, launch: Launch) -> None:
    """Fail before any work when the process layout does not fit the recipe's parallel strategy."""
    if launch.nproc < 1 or launch.nnodes < 1:
        raise ConfigError(f"--nproc and --nnodes: must be >= 1, got {launch.nproc} and {launch.nnodes}")
    world = launch.nproc * launch.nnodes
    if world > 1 and recipe.parallel.strategy == "none":
        raise ConfigError(f"{world} processes need parallel.strategy 'ddp' or 'fsdp2' (allowed with more than "
                          "one process: 'ddp', 'fsdp2'); add parallel.strategy=ddp or parallel.strategy=fsdp2")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the first node's address)")
    check_gpus_per_node(launch.nproc, _visible_gpus())


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus_per_node(nproc: int, gpus: int) -> None:
    """On a node with GPUs each process trains on one of its own (NCCL refuses two ranks on one GPU)."""
    if gpus and nproc > gpus:
        raise ConfigError(f"--nproc {nproc}: this node has {gpus} GPU{'s' if gpus > 1 else ''}, one process "
                          f"trains per GPU; use --nproc {gpus} or fewer")


def run_train(recipe: Recipe, launch: Launch = Launch()) -> dict[str, Any]:
    """Train on the recipe's snapshot, in this process or under torchrun, in the run folder
    ``latentmill.pipelines.runs.training_run`` plans; a finished run of the same recipe and snapshot is not redone."""
    check_launch(recipe, launch)
    world = launch.nproc * launch.nnodes
    with training_run(recipe, world, launch.rendezvous) as plan:
        if plan.done is not None:
            return plan.done
        if world == 1:
            return train_task(recipe.to_dict(), str(plan.folder), plan.key)
        return torchrun_task(recipe.to_dict(), launch, str(plan.folder))


def run_prep_then_train(recipe: Recipe, launch: Launch = Launch()) -> dict[str, Any]:
    """Prepare the latent cache, then train on its snapshot: ``{"stages", "snapshot", "train"}``.

    On several nodes (each runs this), the nodes take turns at prep (``latentmill.pipelines.prep.run_prep`` holds the
    output_dir's writer lock): the first does the work, the others find it committed.
    """
    check_launch(recipe, launch)
    prepared = run_prep(recipe)
    release_prep_models()  # the encoders are done: training gets the GPUs whole
    return {**prepared, "train": run_train(recipe, launch)}


@flow(name="train")
def train(config: str = "configs/demo.yaml", overrides: list[str] | None = None, nproc: int = 1,
          nnodes: int = 1, rdzv_endpoint: str | None = None) -> dict[str, Any]:
    """Train on a prepared dataset snapshot: ``{"train": {...}}``."""
    recipe = load_recipe(config, overrides)
    return {"train": run_train(recipe, Launch(nproc, nnodes, rdzv_endpoint))}


@flow(name="prep-then-train")
def prep_then_train(config: str = "configs/demo.yaml", overrides: list[str] | None = None,
                    nproc: int = 1, nnodes: int = 1, rdzv_endpoint: str | None = None) -> dict[str, Any]:
    """Prepare the latent cache, then train on its snapshot: ``{"stages", "snapshot", "train"}``."""
    return run_prep_then_train(load_recipe(config, overrides), Launch(nproc, nnodes, rdzv_endpoint))


# The same flows for a Recipe built in Python (``latentmill.api``): the flow run records the whole recipe.
@flow(name="prep-then-train")
def prep_then_train_recipe(recipe: dict, nproc: int = 1, nnodes: int = 1,
                           rdzv_endpoint: str | None = None) -> dict[str, Any]:
    """``prep-then-train`` of a recipe given as a dict (``Recipe.to_dict()``)."""
    return run_prep_then_train(recipe_from_dict(recipe), Launch(nproc, nnodes, rdzv_endpoint))


@flow(name="train")
def train_recipe_flow(recipe: dict, nproc: int = 1, nnodes: int = 1,
                      rdzv_endpoint: str | None = None) -> dict[str, Any]:
    """``train`` of a recipe given as a dict (``Recipe.to_dict()``)."""
    return {"train": run_train(recipe_from_dict(recipe), Launch(nproc, nnodes, rdzv_endpoint))}


def apply_retention(recipe: Recipe) -> dict[str, Any]:
    """The refresh flow's retention step: ``latentmill gc`` of the recipe's output with
    ``retention.keep_snapshots``, on an object store the store's way (``objectstore.gc_store``)."""
    from latentmill.pipelines.retention import format_report, gc

    collect = gc_store if is_url(recipe.output_dir) else gc
    report = collect(recipe.output_dir, recipe.retention.keep_snapshots, on_busy=recipe.prep.on_busy)
    print(format_report(report), flush=True)
    return report


@flow(name="refresh")
def refresh(config: str = "configs/demo.yaml", overrides: list[str] | None = None, train: bool = False,
            nproc: int = 1) -> dict[str, Any]:
    """Prep incrementally (only new or changed inputs cost work); with ``retention.keep_snapshots`` set,
    remove what no kept or pinned snapshot references (``latentmill gc``; the report is ``result["gc"]``);
    train on the snapshot if it is new."""
    recipe = load_recipe(config, overrides)
    check_launch(recipe, Launch(nproc))
    prepared = run_prep(recipe)
    result = dict(prepared)
    if recipe.retention.keep_snapshots is not None:
        result["gc"] = apply_retention(recipe)
    if train and prepared["snapshot"]["new"]:
        snapshot = dataclasses.replace(recipe, snapshot=prepared["snapshot"]["name"])
        release_prep_models()  # the encoders are done: training gets the GPUs whole
        result["train"] = run_train(snapshot, Launch(nproc))
    return result


__all__ = ["prep", "train", "prep_then_train", "refresh"]
