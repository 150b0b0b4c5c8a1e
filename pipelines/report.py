"""What people see of a prep run in the Prefect UI: counts, bucket histogram, quarantine, progress."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)


class StageProgress:
    """A progress artifact for one stage, updated as its units finish (at most every 5%)."""

    def __init__(self, stage: str, total: int):
        self.total, self.done, self.shown = max(total, 1), 0, 0.0
        self.id = create_progress_artifact(0.0, description=f"{stage}: samples done")

    def update(self, samples: int) -> None:
        self.done += samples
        progress = 100.0 * self.done / self.total
        if progress - self.shown >= 5.0 or self.done >= self.total:
            update_progress_artifact(self.id, min(progress, 100.0))
            self.shown = progress


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


def publish_prep_artifacts(stages: dict[str, dict[str, Any]], prep_dir: Path) -> None:
    """Per-stage counts table, bucket histogram and quarantine reasons for the flow run's Artifacts tab."""
    rows = [{"stage": name, **{k: s[k] for k in ("in", "out", "quarantined", "processed", "reused", "seconds")}}
            for name, s in stages.items()]
    create_table_artifact(rows, key="prep-counts", description="Samples per stage: in = out + quarantined")
    buckets = (stages.get("bucket") or {}).get("buckets", {})
    create_markdown_artifact(bucket_chart(buckets), key="prep-buckets", description="Bucket histogram")
    quarantined = quarantine_table(prep_dir)
    if quarantined:
        create_table_artifact(quarantined, key="prep-quarantine", description="Quarantined samples by reason")
