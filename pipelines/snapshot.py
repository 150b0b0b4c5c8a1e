"""Dataset snapshots: an immutable, versioned manifest of the latent shards a model trains on.

Each prep run publishes ``<output_dir>/snapshots/<NNNN>-<hash>/manifest.json``: a complete cache manifest
(the trainer reads it like ``prep/cache/manifest.json``) whose shard paths point into ``prep/cache``, plus
the parent snapshot, the bucket histogram, bytes and the quarantine tally. Shards are content-addressed and
never rewritten, so a snapshot stays valid while newer ones are published. ``snapshots/LATEST`` names the
newest. A prep run whose cache is unchanged publishes nothing new: its snapshot is the current one. A prep
run whose inputs all ended in quarantine publishes nothing and fails (:class:`EmptySnapshotError`): an empty
snapshot is never the one training reads.

The held-out set (``prep.eval_fraction``, ``prep.eval_min_count``): the samples whose media key hashes lowest
(``held_out``), recorded per shard entry as ``held_out`` (the samples' places in the shard) and as
``snapshot.eval``; the training loader skips them, the evaluation reads only them. The rule is part of the
content id (a new fraction is a new snapshot) but not of any cache unit (no latent is encoded again).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

from latentmill.stages.shardindex import load_shard_index
from latentmill.stages.shardio import StageDir, shard_buckets, shard_bytes

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


def media_key(key: str) -> str:
    """The part of a sample key that names its media: a video's clips (``<key>-c<j>``) share their video's."""
    return key.split("-", 1)[0]


def holdout_rank(key: str) -> float:
    """Where sample ``key`` falls in [0, 1) for the held-out rule: a hash of its media key, so it never moves."""
    digest = hashlib.sha256(f"latentmill:eval:{media_key(key)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def held_out(keys: list[str], fraction: float, min_count: int) -> set[str]:
    """The held-out keys of ``keys``: those whose ``holdout_rank`` is below ``fraction``, raised to at least
    ``min_count`` samples and cut to at most a quarter of ``keys`` (training keeps three quarters), taking
    whole media (a video's clips stay together) lowest rank first. ``fraction`` 0: none.

    While ``min_count`` or the cap decides the count (a small dataset), a refresh can move a sample between
    the sets; above it, the set of a key depends on the key alone."""
    if fraction <= 0 or not keys:
        return set()
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(media_key(key), []).append(key)
    ranks = {media: holdout_rank(media) for media in groups}
    below = [media for media, rank in ranks.items() if rank < fraction]
    wanted, cap = max(sum(len(groups[m]) for m in below), min_count), len(keys) // 4
    if wanted == sum(len(groups[m]) for m in below) <= cap:  # the fraction alone decides: no sort
        return {key for media in below for key in groups[media]}
    chosen: set[str] = set()
    for media in sorted(groups, key=lambda m: (ranks[m], m)):
        if len(chosen) >= wanted or len(chosen) + len(groups[media]) > cap:
            break
        chosen.update(groups[media])
    return chosen


def _eval_rule(output_dir: str | Path, eval_fraction: float | None, eval_min_count: int) -> dict[str, Any] | None:
    """The held-out rule of a new snapshot: the given one, or (``eval_fraction`` None: a compaction, which has
    no recipe) the latest snapshot's; None when off."""
    if eval_fraction is None:
        latest = latest_name(output_dir)
        if latest is None:
            return None
        rule = json.loads((snapshots_dir(output_dir) / latest / "manifest.json").read_text())["snapshot"].get("eval")
        return {"fraction": rule["fraction"], "min_count": rule["min_count"]} if rule else None
    return {"fraction": eval_fraction, "min_count": eval_min_count} if eval_fraction > 0 else None


def _mark_held_out(cache_root: Path, shards: list[dict[str, Any]], rule: dict[str, Any]) -> int:
    """Add ``held_out`` (sample places in the shard) to the entries of ``shards`` that hold held-out samples,
    from their indexes (no tar is read); returns how many samples are held out."""
    keys = [[index.key(i) for i in range(index.num_samples)]
            for index in (load_shard_index(cache_root / s["path"], s["index"]) for s in shards)]
    chosen = held_out([k for shard_keys in keys for k in shard_keys], rule["fraction"], rule["min_count"])
    for shard, shard_keys in zip(shards, keys):
        places = [i for i, key in enumerate(shard_keys) if key in chosen]
        if places:
            shard["held_out"] = places
    return len(chosen)


def publish(output_dir: str | Path, cache_dir: str | Path, eval_fraction: float | None = None,
            eval_min_count: int = 8, tar_sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Publish the cache's current manifest as a snapshot (or return the current one if identical).

    ``eval_fraction``/``eval_min_count``: the held-out rule (``held_out``); None keeps the latest snapshot's.
    ``tar_sizes``: the cache's tars' bytes by path in its folder, where the folder lacks some (a compaction
    of an output on a store)."""
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
    rule = _eval_rule(output_dir, eval_fraction, eval_min_count)
    identity = {k: v for k, v in manifest.items() if k not in ("units",)}
    content_id = stable_hash({**identity, "eval": rule} if rule else identity)  # without one: ids as before
    parent = latest_name(output_dir)
    if parent is not None:
        current = json.loads((root / parent / "manifest.json").read_text())
        if current["snapshot"]["content_id"] == content_id:
            return {"name": parent, "new": False, "path": str(root / parent)}
    number = 1 + max((int(p.name.split("-")[0]) for p in root.iterdir() if p.is_dir() and p.name[:4].isdigit()),
                     default=0)
    name = f"{number:04d}-{content_id[:12]}"
    rel = os.path.relpath(cache.root, root / name)
    entries = [dict(s) for s in manifest["shards"]]
    evaluated = _mark_held_out(cache.root, entries, rule) if rule else 0
    shards = [{**s, "path": f"{rel}/{s['path']}"} for s in entries]
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
            "bytes": sum(shard_bytes(cache.root, s["path"], tar_sizes) for s in manifest["shards"]),
            "buckets": dict(sorted(buckets.items())),
            "quarantine": _quarantine_tally(cache.root.parent),
            "prep": prep_summary(cache.root.parent),
            **({"eval": {**rule, "samples": evaluated}} if rule else {}),
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
