"""``latentmill inspect`` and ``latentmill verify``: read manifests, re-hash shards, draw a prep's pictures."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from latentmill.core.hashing import sha256_file
from latentmill.pipelines.snapshot import LATEST, resolve_snapshot
from latentmill.stages.shardindex import verify_index
from latentmill.stages.shardio import shard_buckets

# Pipeline order, as ``latentmill.pipelines.prep.STAGES`` (not imported: it would start Prefect for a read-only command).
STAGE_ORDER = ("ingest", "caption", "curate", "bucket", "cache")


def _existing(path: Path) -> Path:
    """``path`` as a folder to read, or an error that says what is wrong with it.

    ``snapshots/LATEST`` is a file naming the newest snapshot: it is followed to that snapshot's folder.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file():
        if path.name == LATEST and path.parent.name == "snapshots":
            folder = resolve_snapshot(path.parent.parent, "latest")
            print(f"{path} names the latest snapshot: reading {folder}")
            return folder
        raise FileNotFoundError(
            f"{path} is a file; pass a recipe (.yaml), an output_dir, a snapshot folder or a stage folder"
        )
    return path


def _stage_dirs(path: Path) -> list[Path]:
    """``path`` itself if it holds a manifest, else every stage folder below it that does, in pipeline order."""
    if (path / "manifest.json").is_file():
        return [path]
    found = [p.parent for p in path.rglob("manifest.json") if (p.parent / "shards").is_dir()]
    if not found:
        raise FileNotFoundError(f"no stage manifest under {path}; run `latentmill prep` first")

    def order(folder: Path) -> tuple[int, str]:
        stage = folder.name
        return (STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER), str(folder))

    return sorted(found, key=order)


def _print_encoded_on(manifest: dict) -> None:
    """Where a cache's components were encoded (device class, versions), and a warning when they mix."""
    encoded_on = manifest.get("encoded_on")
    if not encoded_on:
        return
    from latentmill.stages.cache import mixed_devices_warning

    for where, counts in encoded_on.items():
        print(f"  encoded on {where}: vae {counts.get('vae', 0)}, text {counts.get('text', 0)}")
    warning = mixed_devices_warning(encoded_on)
    if warning:
        print(f"  WARNING {warning}")


def _print_snapshot(folder: Path, manifest: dict) -> None:
    snap = manifest["snapshot"]
    print(f"snapshot {snap['name']} ({folder}): {snap['samples']} samples in {len(manifest['shards'])} shards, "
          f"{snap['bytes'] / 1e6:.2f} MB, family {manifest.get('family')}, dtype {manifest.get('dtype')}, "
          f"parent {snap['parent'] or '-'}, created {snap['created']}")
    print("  buckets: " + ", ".join(f"{k}: {v}" for k, v in snap["buckets"].items()))
    if snap.get("eval"):  # prep.eval_fraction: samples training never reads
        print(f"  held out for evaluation: {snap['eval']['samples']} samples (eval_fraction {snap['eval']['fraction']:g}, "
              f"eval_min_count {snap['eval']['min_count']})")
    for name, model in (manifest.get("models") or {}).items():
        print(f"  {name}: {model.get('class')} fingerprint {model.get('fingerprint', '')[:16]}")
    _print_encoded_on(manifest)
    for stage, reasons in snap["quarantine"].items():
        for reason, count in reasons.items():
            print(f"  quarantined at {stage}: {count} × {reason}")


def inspect_recipe(path: Path, overrides: list[str] | None = None) -> int:
    """Print a recipe (a file or a shipped name such as ``demo``) with its overrides and every default filled
    in, as the run would see it."""
    import yaml

    from latentmill.recipe import load_recipe

    recipe = load_recipe(path, overrides)
    print(yaml.safe_dump(recipe.to_dict(), sort_keys=False, default_flow_style=False), end="")
    return 0


def _details(entry: dict) -> str:
    """What a quarantine entry holds beyond its reason: the curate stage's scores or duplicate's owner."""
    if entry.get("duplicate_of"):
        return f" (duplicate of {entry['duplicate_of']})"
    if entry.get("scores"):
        return " (" + ", ".join(f"{k} {v:.4g}" for k, v in entry["scores"].items()) + ")"
    return ""


def _print_rewritten(stage_dir: Path, manifest: dict) -> None:
    """The caption stage's written captions that a post-processing rule changed, per rule (its unit records)."""
    by_rule: Counter = Counter()
    for unit_id in manifest.get("units") or []:
        try:
            extra = json.loads((stage_dir / "units" / f"{unit_id}.json").read_text()).get("extra") or {}
        except (OSError, ValueError):
            continue
        by_rule.update(extra.get("rewritten_by_rule") or {})
    if by_rule:
        print("  captions rewritten by rule: " + ", ".join(f"{k} {v}" for k, v in sorted(by_rule.items())))


def inspect_path(path: Path, overrides: list[str] | None = None) -> int:
    """Print a recipe, a snapshot's report, or each stage's counts, buckets, models and quarantine reasons.

    ``overrides`` (``key.path=value``) apply to a recipe, as ``prep``, ``train`` and ``run`` take them."""
    from latentmill.core.config import ConfigError
    from latentmill.resources import find_recipe

    if (path.suffix in (".yaml", ".yml") and not path.is_dir()) or (not path.is_dir() and find_recipe(path)[1]):
        return inspect_recipe(path, overrides)  # a missing recipe is named as such by load_yaml
    if overrides:
        raise ConfigError(f"{overrides[0]}: overrides apply to a recipe; {path} is not one")
    path = _existing(path)
    if (path / "manifest.json").is_file() and "snapshot" in json.loads((path / "manifest.json").read_text()):
        _print_snapshot(path, json.loads((path / "manifest.json").read_text()))
        return 0
    latest = path / "snapshots" / "LATEST"
    if latest.is_file():
        folder = path / "snapshots" / latest.read_text().strip()
        _print_snapshot(folder, json.loads((folder / "manifest.json").read_text()))
    for stage_dir in _stage_dirs(path):
        manifest = json.loads((stage_dir / "manifest.json").read_text())
        counts = manifest["counts"]
        print(f"{manifest['stage']} ({stage_dir}): {len(manifest['shards'])} shards, in {counts['in']}, "
              f"out {counts['out']}, quarantined {counts['quarantined']}")
        buckets = Counter()
        for shard in manifest["shards"]:
            buckets.update(shard_buckets(shard))  # one bucket, or several (layout 2)
        if buckets:
            print("  buckets: " + ", ".join(f"{k}: {v}" for k, v in sorted(buckets.items())))
        for name, model in (manifest.get("models") or {}).items():
            print(f"  {name}: {model.get('class')} fingerprint {model.get('fingerprint', '')[:16]}")
        _print_encoded_on(manifest)
        if manifest["stage"] == "caption":
            _print_rewritten(stage_dir, manifest)
        if "scorers" in manifest:  # the curate stage
            thresholds = ", ".join(f"{k} {v:g}" for k, v in (manifest.get("thresholds") or {}).items())
            print(f"  scorers: {', '.join(manifest['scorers']) or '-'}; thresholds: {thresholds or '-'}")
        quarantine = stage_dir / "quarantine.jsonl"
        if quarantine.is_file():
            for line in quarantine.read_text().splitlines():
                entry = json.loads(line)
                print(f"  quarantined {entry['source']}: {entry['reason']}{_details(entry)}")
    return 0


def plot_path(path: Path, out: Path) -> int:
    """Write the pictures of a prep into ``out`` (``latentmill.plots``) and print each file with its summary."""
    from latentmill.plots import prep_dir_of, require_matplotlib, write_plots

    require_matplotlib()  # before reading anything: a missing extra is named at once
    prep_dir = prep_dir_of(path)
    plots = write_plots(prep_dir, out)
    for plot in plots:
        print(f"wrote {plot.path}: {plot.summary}")
    print(f"wrote {Path(out) / 'index.md'}: {len(plots)} pictures of {prep_dir}")
    return 0


def verify_path(path: Path) -> int:
    """Re-hash every shard (and its index, format 3) listed in the manifests; print each mismatch, return 1 if any."""
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        raise FileNotFoundError(f"{path} is a recipe; verify reads an output_dir, a snapshot or a stage folder")
    bad = checked = 0
    for stage_dir in _stage_dirs(_existing(path)):
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
            elif (problem := verify_index(shard_path, shard)) is not None:  # format 3: the index beside it
                print(f"MISMATCH {problem}")
                bad += 1
    print(f"verified {checked} shards: {checked - bad} ok, {bad} bad")
    return 1 if bad else 0
