"""What people see of a run in the Prefect UI: counts, bucket histogram, quarantine, progress, log lines,
training metrics.

A prep runs as the ``prep-stages`` subflow of the flow the user started (``prep``, ``prep-then-train``,
``refresh``), and the UI shows a flow run's own artifacts and logs only. So the counts, histogram and
quarantine reasons go on both runs, the per-stage log lines on both (the started run's copy skips the
console, which has the line already), and the progress artifacts on the started run only. Training runs as a
task of the started run: its progress and metrics land there directly.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence
from uuid import UUID

from prefect.artifacts import (
    LinkArtifact,
    MarkdownArtifact,
    ProgressArtifact,
    TableArtifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext
from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogHandler
from prefect.logging.loggers import PrefectLogAdapter

_PROGRESS_STEP = 5.0  # percent between two progress updates


def current_run_id() -> str | None:
    """The id of the flow run this code runs in (None outside a flow run)."""
    context = FlowRunContext.get()
    return str(context.flow_run.id) if context is not None and context.flow_run is not None else None


class StageProgress:
    """A progress artifact for one stage, updated as its units finish (at most every 5%).

    ``flow_run_id`` puts it on another run than the current one (the run the user started).
    """

    def __init__(self, stage: str, total: int, flow_run_id: str | None = None):
        self.total, self.done, self.shown = max(total, 1), 0, 0.0
        description = f"{stage}: samples done"
        if flow_run_id is None:
            self.id = create_progress_artifact(0.0, description=description)
        else:
            self.id = ProgressArtifact(progress=0.0, description=description, flow_run_id=UUID(flow_run_id)).create().id

    def update(self, samples: int) -> None:
        self.done += samples
        progress = 100.0 * self.done / self.total
        if progress - self.shown >= _PROGRESS_STEP or self.done >= self.total:
            update_progress_artifact(self.id, min(progress, 100.0))
            self.shown = progress


class RunLog:
    """Log lines for the current flow run and, API only, for the run the user started (``also``)."""

    def __init__(self, also: str | None = None):
        self.logger = get_run_logger()
        self.also = None
        if also is not None and also != current_run_id():
            api_only = logging.getLogger("prefect.flow_runs.latentmill")
            if not api_only.handlers:  # the same API handler as run loggers, without the console
                api_only.handlers = [h for h in logging.getLogger("prefect.flow_runs").handlers
                                     if isinstance(h, APILogHandler)]
                api_only.propagate = False
            self.also = PrefectLogAdapter(api_only, extra={"flow_run_id": also, "flow_run_name": also,
                                                           "flow_name": "<started run>"})

    def log(self, level: int, message: str) -> None:
        self.logger.log(level, message)
        if self.also is not None:
            self.also.log(level, message)

    def info(self, message: str) -> None:
        self.log(logging.INFO, message)

    def warning(self, message: str) -> None:
        self.log(logging.WARNING, message)


def stage_line(stage: str, s: dict[str, Any]) -> str:
    """One line of a stage's counts for the run log."""
    line = (f"{stage}: {s['in']} in → {s['out']} out, {s['quarantined']} quarantined; "
            f"{s['processed']} processed, {s['reused']} reused; {s['units']} units in {s['seconds']:.2f} s")
    if "components" in s:
        line += "; " + ", ".join(f"{name} {c['processed']} encoded / {c['reused']} reused"
                                 for name, c in s["components"].items())
    return line


def bucket_chart(buckets: dict[str, int], width: int = 40) -> str:
    """A Markdown bar chart of samples per bucket."""
    if not buckets:
        return "_no buckets_"
    peak = max(buckets.values())
    lines = ["| bucket (W×H×F) | samples | |", "|---|---:|---|"]
    for name, count in buckets.items():
        lines.append(f"| {name} | {count} | {'█' * max(1, round(width * count / peak))} |")
    return "\n".join(lines)


def quarantine_table(prep_dir: Path) -> list[dict[str, Any]]:
    """Quarantined samples per (stage, reason), from every stage's quarantine list."""
    tally: Counter = Counter()
    for path in sorted(prep_dir.glob("*/quarantine.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            tally[(entry["stage"], entry["reason"])] += 1
    return [{"stage": s, "reason": r, "samples": n} for (s, r), n in sorted(tally.items())]


def publish_prep_artifacts(stages: dict[str, dict[str, Any]], prep_dir: Path,
                           also: Sequence[str] = ()) -> None:
    """Per-stage counts table, bucket histogram and quarantine reasons for the Artifacts tab of the current
    flow run and of each run in ``also`` (flow run ids)."""
    rows = [{"stage": name, **{k: s[k] for k in ("in", "out", "quarantined", "processed", "reused", "seconds")}}
            for name, s in stages.items()]
    buckets = (stages.get("bucket") or {}).get("buckets", {})
    quarantined = quarantine_table(prep_dir)
    for run in (None, *(UUID(r) for r in also if r != current_run_id())):
        TableArtifact(table=rows, key="prep-counts", description="Samples per stage: in = out + quarantined",
                      flow_run_id=run).create()
        MarkdownArtifact(markdown=bucket_chart(buckets), key="prep-buckets", description="Bucket histogram",
                         flow_run_id=run).create()
        if quarantined:
            TableArtifact(table=quarantined, key="prep-quarantine", description="Quarantined samples by reason",
                          flow_run_id=run).create()


PLOTS_DIR = "plots"  # under the prep folder


def write_prep_plots(prep_dir: Path, warn: Callable[[str], None]) -> str | None:
    """Draw a prep's pictures into ``prep/plots`` (``latentmill.plots``; only when the prep changed what they
    show) and return the Markdown that shows them; None when matplotlib is not installed. Never raises: a
    prep does not fail because of a picture (the error is passed to ``warn``)."""
    from latentmill.plots import MissingExtra, artifact_markdown, require_matplotlib, update_plots

    try:
        require_matplotlib()
        plots, _ = update_plots(prep_dir, Path(prep_dir) / PLOTS_DIR)  # redrawn only when the prep changed
        return artifact_markdown(plots)
    except MissingExtra:
        return None
    except Exception as err:  # a plot is never worth a failed prep
        warn(f"prep plots not drawn: {type(err).__name__}: {err}")
        return None


def publish_prep_plots(prep_dir: Path, warn: Callable[[str], None], also: Sequence[str] = ()) -> str | None:
    """The ``prep-plots`` Markdown artifact (score histograms, buckets, quarantine contact sheets) on the
    current flow run and each run in ``also``; its Markdown, or None when nothing was drawn."""
    markdown = write_prep_plots(prep_dir, warn)
    if markdown is None:
        return None
    try:
        for run in (None, *(UUID(r) for r in also if r != current_run_id())):
            MarkdownArtifact(markdown=markdown, key="prep-plots", description="Scores, buckets, quarantine",
                             flow_run_id=run).create()
    except Exception as err:
        warn(f"prep plots artifact not created: {type(err).__name__}: {err}")
    return markdown


def publish_tracker_links(urls: dict[str, str | None], what: str, also: Sequence[str] = ()) -> None:
    """A link artifact (``<what>-<tracker>``: ``train-wandb``, ``prep-mlflow``) to each tracker run that has a web
    page, on the current flow run and each run in ``also``; a local folder (TensorBoard, W&B offline) has none."""
    for name, url in urls.items():
        if not (url or "").startswith(("http://", "https://")):
            continue
        for run in (None, *(UUID(r) for r in also if r != current_run_id())):
            LinkArtifact(link=url, link_text=f"{name}: {what} run", key=f"{what}-{name}",
                         description=f"The {what} run in {name}", flow_run_id=run).create()


TRAIN_METRICS = ("steps", "final_loss", "samples_per_s", "data_wait_fraction", "peak_rss_mb", "export_dir")


class TrainProgress:
    """Training progress on the current run: a log line and a progress artifact, each at most every 5% and
    every ``interval_s`` (no API call per step: each costs the server CPU), then the final metrics.

    The progress artifact is created only once a run has lasted ``interval_s``: a short run shows its
    metrics table alone. Call it with each step's metrics record (``step``, ``loss``, ``samples_per_s``).
    """

    def __init__(self, max_steps: int, interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.max_steps, self.interval_s, self.clock = max(max_steps, 1), interval_s, clock
        self.logger = get_run_logger()
        self.id: UUID | None = None
        self.shown, self.last = 0.0, clock()

    def __call__(self, record: dict[str, Any]) -> None:
        percent = min(100.0, 100.0 * record["step"] / self.max_steps)
        now = self.clock()
        if percent - self.shown < _PROGRESS_STEP or now - self.last < self.interval_s or percent >= 100.0:
            return  # the last step is reported by finish()
        self.shown, self.last = percent, now
        self.logger.info("train: step %d/%d, loss %.4f, %.1f samples/s", record["step"], self.max_steps,
                         record["loss"], record.get("samples_per_s", 0.0))
        if self.id is None:
            self.id = create_progress_artifact(percent, description="training: steps done")
        else:
            update_progress_artifact(self.id, percent)

    def finish(self, summary: dict[str, Any]) -> None:
        """Close the progress artifact at 100% and publish the final metrics (table ``train-metrics``)."""
        if self.id is not None:
            update_progress_artifact(self.id, 100.0)
        if summary.get("steps") is None:  # a torchrun node without global rank 0: no summary here
            return
        row = {k: summary.get(k) for k in TRAIN_METRICS}
        self.logger.info("train: %s steps, final loss %.4f, %.1f samples/s, data wait %.1f%%, peak RSS %.0f MB; "
                         "export %s", row["steps"], row["final_loss"], row["samples_per_s"],
                         100 * row["data_wait_fraction"], row["peak_rss_mb"], row["export_dir"])
        create_table_artifact([row], key="train-metrics",
                              description="Training: steps, final loss, samples/s, data wait, peak RSS, export")
        publish_tracker_links(summary.get("trackers") or {}, "train")
