"""``latentmill inspect`` and ``latentmill verify``: read manifests, re-hash shards."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from stages.shardio import sha256_file


def _stage_dirs(path: Path) -> list[Path]:
    """``path`` itself if it holds a manifest, else every stage folder below it that does."""
    if (path / "manifest.json").is_file():
        return [path]
    found = sorted(p.parent for p in path.rglob("manifest.json") if (p.parent / "shards").is_dir())
    if not found:
        raise FileNotFoundError(f"no stage manifest under {path}; run `latentmill prep` first")
    return found


def inspect_path(path: Path) -> int:
    """Print each stage's counts, buckets, models and quarantine reasons."""
    for stage_dir in _stage_dirs(path):
        manifest = json.loads((stage_dir / "manifest.json").read_text())
        counts = manifest["counts"]
        print(f"{manifest['stage']} ({stage_dir}): {len(manifest['shards'])} shards, in {counts['in']}, "
              f"out {counts['out']}, quarantined {counts['quarantined']}")
        buckets = Counter()
        for shard in manifest["shards"]:
            if shard.get("bucket"):
                buckets["x".join(map(str, shard["bucket"]))] += shard["samples"]
        if buckets:
            print("  buckets: " + ", ".join(f"{k}: {v}" for k, v in sorted(buckets.items())))
        for name, model in (manifest.get("models") or {}).items():
            print(f"  {name}: {model.get('class')} fingerprint {model.get('fingerprint', '')[:16]}")
        quarantine = stage_dir / "quarantine.jsonl"
        if quarantine.is_file():
            for line in quarantine.read_text().splitlines():
                entry = json.loads(line)
                print(f"  quarantined {entry['source']}: {entry['reason']}")
    return 0


def verify_path(path: Path) -> int:
    """Re-hash every shard listed in the manifests; print each mismatch and return 1 if any."""
    bad = checked = 0
    for stage_dir in _stage_dirs(path):
        manifest = json.loads((stage_dir / "manifest.json").read_text())
        for shard in manifest["shards"]:
            checked += 1
            shard_path = stage_dir / shard["path"]
            if not shard_path.is_file():
                print(f"MISSING  {shard_path}")
                bad += 1
            elif sha256_file(shard_path) != shard["sha256"]:
                print(f"MISMATCH {shard_path}: sha256 differs from the manifest")
                bad += 1
    print(f"verified {checked} shards: {checked - bad} ok, {bad} bad")
    return 1 if bad else 0
