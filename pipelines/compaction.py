"""``latentmill compact OUTPUT``: merge the cache's small shards (``latentmill.stages.compact``) under the
output_dir's writer lock, then publish the compacted cache as a new snapshot.

The snapshots published before stay readable (their shards are not touched) until ``latentmill gc`` prunes
them; a training run that reads one pins it. A prep compacts on its own at its end once
``compaction.auto_after`` small units are in the cache (``latentmill.pipelines.prep``), inside its own lock,
before it publishes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from latentmill.pipelines.retention import writer_lock
from latentmill.pipelines.snapshot import publish
from latentmill.stages.compact import compact_stage
from latentmill.stages.shardio import StageDir


def cache_stage(output_dir: str | Path) -> StageDir:
    stage = StageDir(Path(output_dir) / "prep" / "cache", "cache")
    if not stage.manifest_path.is_file():
        raise FileNotFoundError(f"{stage.manifest_path} does not exist: nothing to compact (run `latentmill prep` "
                                "first)")
    return stage


def compact(output_dir: str | Path, small_below: float = 0.5, dry_run: bool = False,
            on_busy: Literal["wait", "fail"] = "wait", tar_sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Compact the cache of ``output_dir`` now (every small unit that fits a group of two or more) and publish
    the result; ``dry_run`` reports what would be merged, reads only and takes no lock. ``tar_sizes``: the
    cache's tars' bytes by path in its folder, for a folder that holds only the tars it merges (a work
    folder of an output on a store)."""
    stage = cache_stage(output_dir)
    if dry_run:
        return compact_stage(stage, small_below, dry_run=True, tar_sizes=tar_sizes)
    with writer_lock(output_dir, "compact", on_busy=on_busy):
        report = compact_stage(stage, small_below, tar_sizes=tar_sizes)
        # publish also when nothing was merged now: a compaction killed after its manifest still publishes
        report["snapshot"] = publish(output_dir, stage.root, tar_sizes=tar_sizes)
    return report


def format_report(report: dict[str, Any]) -> str:
    """What ``latentmill compact`` prints."""
    verb = "would merge" if report["dry_run"] else "merged"
    lines = [f"cache: {report['units']} units, {report['small_units']} small (each under {report['small_below']:g} x "
             f"the {report['shard_bytes'] / 2**20:.1f} MiB shard target)"]
    if report["groups"]:
        lines.append(f"{verb} {report['merged_units']} units ({report['shards_before']} shards, "
                     f"{report['samples']} samples, {report['tar_bytes_before'] / 1e6:.3f} MB) into "
                     f"{report['groups']} units")
    else:
        lines.append("nothing to merge: no two small units fit one shard together")
    for damaged in report.get("damaged", []):
        lines.append(f"left as is: unit {damaged['unit'][:16]}, its shard {damaged['shard']} {damaged['reason']}; "
                     "run `latentmill verify` on the output_dir (a refresh re-encodes a unit whose shard is gone)")
    if report.get("compacted"):
        lines.append(f"wrote {report['shards_after']} shards, {report['tar_bytes_after'] / 1e6:.3f} MB; member bytes "
                     f"copied {report['member_bytes_copied']} of {report['member_bytes_in_merged_shards']} "
                     f"(nothing re-encoded) in {report['seconds']:.2f} s")
    if report.get("snapshot"):
        snap = report["snapshot"]
        lines.append(f"snapshot: {snap['name']}" + (" (new)" if snap["new"] else " (unchanged)")
                     + ("; older snapshots stay readable until `latentmill gc`" if snap["new"] else ""))
    return "\n".join(lines)
