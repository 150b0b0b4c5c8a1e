"""Compaction of small cache shards, and a year of nightly refreshes with compaction and gc.

Figure 14a (issue 17): a cache of 200 small units, one small shard each (Flux-512 samples, ~764 KB:
16x64x64 latents, 77x4096 T5 and 768 CLIP embeddings, bf16, written by the cache stage's own commit path
with random tensors), compacted by ``latentmill compact OUTPUT`` in a child process. Ours: the member bytes
copied; baseline: the member bytes in the merged shards (goal: = 1, every byte copied once, nothing
re-encoded). The child counts calls of the cache stage's encoder loader (``cache._load_encoders`` /
``cache.get_encoders``, wrapped to count, not replaced): goal 0.

Figure 14b (informational; docs/snapshots.md, "Compaction", has the demo-size year): a year of nightly refreshes. A first prep's cache of
10,000 samples, then 365 refreshes of 1% (100 samples) each; after each, the cache's end-of-prep step as a
prep runs it (``stages.compact.compact_stage`` with ``compaction.auto_after`` 8, size tiers), a publish and
``gc --keep 7``. The refreshes' cache units are written directly by the commit path (no encoder: 365 real
preps do not fit this machine's time); compaction, publish and gc are the real code. Sizes are scaled by
1/32 (a sample of ~24 KB, a shard target of 32 MiB for the real 1 GiB) so the run writes ~1/32 of the
bytes; file counts are those of the full size, bytes are reported at full size (x32). Compared with the
same year without compaction and without gc.

Run alone: ``python -m bench.compaction [--quick]`` (quick: 60 small units, 120 refreshes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import FLUX_512, figure, log, run_benchmark, setup_env, temp_dir

setup_env()

REPO = Path(__file__).resolve().parents[1]
SCALE = 32
GiB = 1 << 30

CHILD = r"""
import json, sys
from latentmill.stages import cache
calls = {"n": 0}
for name in ("get_encoders", "_load_encoders"):
    real = getattr(cache, name, None)
    if real is not None:
        def counted(*a, _real=real, **k):
            calls["n"] += 1
            return _real(*a, **k)
        setattr(cache, name, counted)
from latentmill.pipelines.compaction import compact
report = compact(sys.argv[1])
report["encoder_loads"] = calls["n"]
report["modules"] = {m: m in sys.modules for m in ("diffusers", "transformers")}
print(json.dumps(report))
"""


def _write_units(root: Path, sizes: list[int], spec: dict[str, Any], scale: int, shard_bytes: int,
                 start_key: int = 0, tag: str = "u") -> list:
    """Commit one cache unit per entry of ``sizes`` (samples), each naming a made-up upstream shard."""
    import torch
    from latentmill.stages.shardio import StageDir, UnitOutput, WorkUnit, grouped_unit_id
    from safetensors.torch import save as st_save

    from bench.common import sample_tensors
    from latentmill.core.hashing import json_bytes, sha256_bytes, stable_hash

    stage = StageDir(root, "cache").ensure()
    gen = torch.Generator().manual_seed(start_key)
    records, key = [], start_key
    fingerprint = {"stage": "cache", "bench": "compaction", "scale": scale}
    for n in sizes:
        upstream = f"bucket-{tag}{key:08d}-image.tar"
        inputs = [sha256_bytes(upstream.encode())]
        unit = WorkUnit(grouped_unit_id(fingerprint, inputs), inputs, {"upstream": [upstream]}, n)
        out = UnitOutput(stage, unit)
        components = {}
        for _ in range(n):
            vae, text = sample_tensors(gen, spec, torch.bfloat16)
            name = f"s{key:08d}"
            meta = {"source": f"generated/{name}.jpg", "sha256": sha256_bytes(name.encode()),
                    "bucket": spec["bucket"], "caption": f"generated sample {key}"}
            out.add({"__key__": name, "vae.safetensors": st_save(vae), "text.safetensors": st_save(text),
                     "json": json_bytes(meta)}, bucket=spec["bucket"])
            components[name] = {"vae": stable_hash(["v", key]), "text": [stable_hash(["t", key])]}
            key += 1
        out.extra.update(components=components, counts={"vae": {"encoded": n, "reused": 0},
                                                        "text": {"encoded": n, "reused": 0}})
        records.append(out.commit(0.0))
    return records


def _manifest(root: Path, records: list, shard_bytes: int, scale: int) -> dict[str, Any]:
    from latentmill.stages.shardio import StageDir

    from latentmill.core.hashing import sha256_bytes, stable_hash

    empty = root / "empty_prompt.safetensors"
    if not empty.is_file():
        empty.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    fingerprint = {"stage": "cache", "bench": "compaction", "scale": scale}
    header = {"format_version": 3, "family": "flux", "fingerprint": stable_hash(fingerprint),
              "stage_fingerprint": fingerprint, "shard_bytes": shard_bytes, "dtype": "bfloat16",
              "latents": "mean", "text": {"trimmed": False, "pad_to": 77},
              "empty_prompt": {"path": empty.name, "sha256": sha256_bytes(empty.read_bytes())}}
    return StageDir(root, "cache").write_manifest(records, header)


def _disk(out: Path) -> tuple[int, int]:
    files = [p for p in out.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def small_shards(work: Path, units: int) -> list:
    """Figure 14a: ``units`` small units of 3 Flux-512 samples, compacted by the CLI's code in a child."""
    from latentmill.pipelines.snapshot import publish

    out = work / "small"
    cache = out / "prep" / "cache"
    records = _write_units(cache, [3] * units, FLUX_512, 1, GiB)
    _manifest(cache, records, GiB, 1)
    publish(out, cache)
    files_before, bytes_before = _disk(cache)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True, env=env,
                          check=False)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"compaction child failed: {done.stderr[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    files_after, bytes_after = _disk(cache)
    log(f"compaction: {units} units -> {report['shards_after']} shards, copied {report['member_bytes_copied']} of "
        f"{report['member_bytes_in_merged_shards']} member bytes in {report['seconds']} s "
        f"(child {seconds:.1f} s), encoder loads {report['encoder_loads']}")
    inputs = {"small_units": units, "samples_per_unit": 3, "sample": FLUX_512 | {"dtype": "bfloat16"},
              "shard_bytes": GiB, "command": "latentmill compact OUTPUT (its function, in a child process)"}
    details = {k: report[k] for k in ("merged_units", "groups", "shards_before", "shards_after", "samples",
                                      "tar_bytes_before", "tar_bytes_after", "member_bytes_copied",
                                      "member_bytes_in_merged_shards", "seconds", "encoder_loads", "modules")}
    details.update(child_seconds=round(seconds, 2), files_before=files_before, files_after=files_after,
                   disk_bytes_before=bytes_before, disk_bytes_after=bytes_after,
                   copy_mb_per_s=round(report["member_bytes_copied"] / 1e6 / max(report["seconds"], 1e-9), 1))
    return [
        figure(f"14. compaction of {units} small shards: member bytes copied vs member bytes of the merged shards",
               [report["member_bytes_copied"]], [report["member_bytes_in_merged_shards"]], "bytes", "<= 1.0",
               inputs, "every member copied once, byte for byte (>= 1 by construction: a ratio of 1 means no "
               "byte was read twice or re-encoded); details.encoder_loads: calls of the cache stage's encoder "
               "loader in the compacting process", details=details),
        figure(f"14. compaction of {units} small shards: encoder loads", [report["encoder_loads"]], [1], "calls",
               "<= 0", inputs, "ratio: encoder loads in the compacting process (goal: none)", details=details),
    ]


def year(work: Path, days: int, base: int = 10_000, per_day: int = 100, keep: int = 7) -> list:
    """Figure 14b: a year of nightly 1% refreshes, with compaction + gc and without."""
    from latentmill.pipelines.retention import gc
    from latentmill.pipelines.snapshot import publish
    from latentmill.stages.compact import compact_stage
    from latentmill.stages.shardio import StageDir

    spec = dict(FLUX_512, latent=[16, 16, 16], text_len=15, text_dim=512, pooled_dim=24)  # ~1/32 of the bytes
    target = GiB // SCALE
    rows = {}
    for mode in ("compact+gc", "neither"):
        out = work / f"year-{mode}"
        cache = out / "prep" / "cache"
        stage = StageDir(cache, "cache")
        # the first prep: 10,000 samples in units of ~the target (the planner's groups of bucket shards)
        per_unit = max(1, target // (25 * 1024))
        records = _write_units(cache, [per_unit] * (base // per_unit) + ([base % per_unit] if base % per_unit else []),
                               spec, SCALE, target, 0, "a")
        _manifest(cache, records, target, SCALE)
        publish(out, cache)
        copied = 0
        key = base
        t0 = time.perf_counter()
        for _day in range(days):
            manifest = stage.read_manifest()
            old = [r for r in (stage.load_record(u) for u in manifest["units"]) if r is not None]
            new = _write_units(cache, [per_day], spec, SCALE, target, key, "d")
            key += per_day
            _manifest(cache, old + new, target, SCALE)
            if mode == "compact+gc":
                report = compact_stage(stage, 0.5, 8)
                copied += report.get("member_bytes_copied", 0)
            publish(out, cache)
            if mode == "compact+gc":
                gc(out, keep)
        seconds = time.perf_counter() - t0
        manifest = stage.read_manifest()
        files, nbytes = _disk(out)
        data_bytes = sum((cache / s["path"]).stat().st_size for s in manifest["shards"])
        rows[mode] = {"days": days, "samples": base + days * per_day, "cache_shards": len(manifest["shards"]),
                      "files": files, "disk_bytes_full_size": nbytes * SCALE,
                      "current_snapshot_bytes_full_size": data_bytes * SCALE,
                      "bytes_copied_by_compaction_full_size": copied * SCALE,
                      "snapshots": len([p for p in (out / "snapshots").iterdir() if p.is_dir()]),
                      "seconds": round(seconds, 1)}
        log(f"year ({mode}): {rows[mode]}")
    ours, base_row = rows["compact+gc"], rows["neither"]
    inputs = {"first_prep_samples": base, "refreshes": days, "samples_per_refresh": per_day, "keep": keep,
              "auto_after": 8, "small_below": 0.5, "scale": f"1/{SCALE} (bytes reported x{SCALE})",
              "commands": "latentmill prep (nightly; it compacts at its end), latentmill gc OUTPUT --keep 7"}
    return [figure(f"14. a year of nightly 1% refreshes ({days}): files with compaction and gc vs neither",
                   [ours["files"]], [base_row["files"]], "files", None, inputs,
                   "informational (docs/snapshots.md, Compaction): files under output_dir at the end; details: shards, "
                   "disk, bytes copied by compaction", details=rows)]


def run(args) -> list:
    work = temp_dir("compaction-")
    try:
        figures = small_shards(work, 60 if args.quick else 200)
        figures += year(work, 120 if args.quick else 365)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return figures


def main(argv=None) -> None:
    run_benchmark("compaction", __doc__, run, argv)


if __name__ == "__main__":
    main()
