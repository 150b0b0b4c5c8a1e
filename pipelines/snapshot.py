"""Dataset snapshots: an immutable, versioned manifest of the latent shards a model trains on.

Each prep run publishes ``<output_dir>/snapshots/<NNNN>-<hash>/manifest.json``: a complete cache manifest
(the trainer reads it like ``prep/cache/manifest.json``) whose shard paths point into ``prep/cache``, plus
the parent snapshot, the bucket histogram, bytes and the quarantine tally. Shards are content-addressed and
never rewritten, so a snapshot stays valid while newer ones are published. ``snapshots/LATEST`` names the
newest. A prep run whose cache is unchanged publishes nothing new: its snapshot is the current one. A prep
run whose inputs all ended in quarantine publishes nothing and fails (:class:`EmptySnapshotError`): an empty
snapshot is never the one training reads.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from latentmill.stages.shardio import StageDir, shard_buckets

from latentmill.core import durable
from latentmill.core.hashing import stable_hash

LATEST = "LATEST"
STAGES = ("ingest", "caption", "curate", "bucket", "cache")  # the prep's stages, in pipeline order


class EmptySnapshotError(RuntimeError):
    """A prep whose inputs all ended in quarantine: nothing to publish, nothing to train on."""


def snapshots_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "snapshots"


def latest_name(output_dir: str | Path) -> str | None:
    """The newest snapshot's name, or None before the first publish."""
    pointer = snapshots_dir(output_dir) / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def resolve_snapshot(output_dir: str | Path, name: str) -> Path:
    """The folder of snapshot ``name`` (``latest`` or a published name), with a clear error otherwise."""
    root = snapshots_dir(output_dir)
    if name == "latest":
        latest = latest_name(output_dir)
        if latest is None:
            raise FileNotFoundError(f"no snapshot published under {root}: run `latentmill prep` first")
        name = latest
    folder = root / name
    if not (folder / "manifest.json").is_file():
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise FileNotFoundError(f"snapshot {name!r} not found under {root}; published: {', '.join(known) or 'none'}")
    return folder


def _quarantine_tally(prep_dir: Path) -> dict[str, dict[str, int]]:
    tally: dict[str, Counter] = {}
    for path in sorted(prep_dir.glob("*/quarantine.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            reason = entry["reason"].split(":")[0]
            tally.setdefault(entry["stage"], Counter())[reason] += 1
    return {stage: dict(sorted(c.items())) for stage, c in sorted(tally.items())}


def prep_summary(prep_dir: str | Path) -> dict[str, Any]:
    """What the prep that made a cache did, from its stage manifests, with no local path in it: the counts
    per stage, the captioner, the curation scorers and thresholds (a snapshot keeps it as ``snapshot.prep``;
    trackers and model cards show it)."""
    summary: dict[str, Any] = {"stages": {}}
    for stage in STAGES:
        path = Path(prep_dir) / stage / "manifest.json"
        if not path.is_file():
            continue
        manifest = json.loads(path.read_text())
        summary["stages"][stage] = manifest["counts"]
        if stage == "caption":
            summary["captioner"] = (manifest.get("captioner") or {}).get("captioner")
        if stage == "curate":
            summary["curation"] = {"scorers": manifest.get("scorers", []), "thresholds": manifest.get("thresholds", {})}
    return summary


def publish(output_dir: str | Path, cache_dir: str | Path) -> dict[str, Any]:
    """Publish the cache's current manifest as a snapshot (or return the current one if identical)."""
    cache = StageDir(cache_dir, "cache")
    manifest = cache.read_manifest()
    if not manifest["counts"]["out"]:
        tally = _quarantine_tally(cache.root.parent)
        reasons = "; ".join(f"{stage}: " + ", ".join(f"{n}× {why}" for why, n in sorted(c.items(), key=lambda x: -x[1]))
                            for stage, c in tally.items()) or "no input found"
        latest = latest_name(output_dir)
        raise EmptySnapshotError(
            f"every input ended in quarantine ({reasons}); no snapshot was published"
            + (f" (LATEST still names {latest})" if latest else "")
            + f". `latentmill inspect {output_dir}` lists each file with its reason")
    root = snapshots_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    # The data identity: everything but bookkeeping that changes between identical runs.
    content_id = stable_hash({k: v for k, v in manifest.items() if k not in ("units",)})
    parent = latest_name(output_dir)
    if parent is not None:
        current = json.loads((root / parent / "manifest.json").read_text())
        if current["snapshot"]["content_id"] == content_id:
            return {"name": parent, "new": False, "path": str(root / parent)}
    number = 1 + max((int(p.name.split("-")[0]) for p in root.iterdir() if p.is_dir() and p.name[:4].isdigit()),
                     default=0)
    name = f"{number:04d}-{content_id[:12]}"
    rel = os.path.relpath(cache.root, root / name)
    shards = [{**s, "path": f"{rel}/{s['path']}"} for s in manifest["shards"]]
    buckets = Counter()
    for shard in manifest["shards"]:
        buckets.update(shard_buckets(shard))  # one bucket, or several (layout 2)
    snapshot = {
        **manifest,
        "shards": shards,
        "snapshot": {
            "name": name,
            "content_id": content_id,
            "parent": parent,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "samples": sum(s["samples"] for s in shards),
            "bytes": sum((cache.root / s["path"]).stat().st_size for s in manifest["shards"]),
            "buckets": dict(sorted(buckets.items())),
            "quarantine": _quarantine_tally(cache.root.parent),
            "prep": prep_summary(cache.root.parent),
        },
    }
    for field in ("empty_prompt", "validation_prompts"):  # files beside the cache's shards
        if field in manifest:
            snapshot[field] = {**manifest[field], "path": f"{rel}/{manifest[field]['path']}"}
    tmp = root / f".{name}.tmp"
    tmp.mkdir(exist_ok=True)
    durable.write_json(tmp / "manifest.json", snapshot)
    durable.replace(tmp, root / name)
    durable.write_text(root / LATEST, name + "\n")  # the pointer last: training reads what it names
    return {"name": name, "new": True, "path": str(root / name)}
