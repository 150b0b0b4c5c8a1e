"""Files per 1,000 samples in each prep stage at 100,000 Flux-512 samples, with shards sized by bytes.

What is counted: every file a stage keeps per unit (shard tars, their ``.idx`` indexes, unit records) per
1,000 samples, and cache shards per 1,000 samples. Goal (issue 17): at most 2 cache shards and at most 5
files per 1,000 samples in each stage. Baseline: 1 (the figure is the count itself).

How, and what is real: the stages' own planner (``stages.shardio.units_by_bytes``, which ``caption.plan``,
``bucket.plan`` and ``cache.plan`` call, with their own estimates: ``copy_estimate`` and
``cache.sample_bytes_estimate`` for Flux with ``max_sequence_length`` 77) groups the previous stage's real
committed shards, and the real commit path (``StageDir.run_unit``, ``UnitOutput`` with its roll-over,
``write_manifest``, the shard index writer) writes every unit. What is synthetic is the samples: no image
is decoded and no model runs. A sample is one ``json`` member and one payload member whose size makes the
sample's tar bytes its real size divided by ``SCALE`` (32), and every byte target is divided by ``SCALE``
too, so each shard holds as many samples as at full size (to within 512 bytes a sample: ~2%), while the run
writes 1/32 of the 76 GB a full-size cache of 100,000 samples takes (this disk has less free). Real sizes: a
raw image of 100 KB (a 512-px JPEG) with a 1 KB ``json`` in ingest, caption (+ a ``txt`` member) and
bucket; a cached sample of 16x64x64 bf16 latents + 77x4096 T5 + 768 CLIP bf16 embeddings + 1 KB ``json``
(~762 KB, FLUX_512 in ``bench/common.py``). Ingest groups by bytes with its own planner's grouping
(``stages.ingest.hash_byte_groups`` with ``stages.ingest.entry_bytes``'s estimate of a 100 KB local image,
``ingest.shard_bytes`` 256 MiB and ``ingest.shard_size`` 10,000, the defaults).

Run alone: ``python -m bench.files --quick`` (20,000 samples; the full run 100,000).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bench.common import figure, log, run_benchmark, setup_env, temp_dir

setup_env()

SCALE = 32
BLOCK = 512
IMAGE_BYTES = 100_000
JSON_BYTES = 1_000
INGEST_SHARD_SIZE = 10_000  # the default upper bound on entries per ingest unit


def tar_bytes(sizes: list[int]) -> int:
    """The bytes a tar entry takes whose members have these data sizes: a header block each, data padded."""
    return sum(BLOCK + -(-n // BLOCK) * BLOCK for n in sizes)


def _sample(key: str, real_sizes: list[int], bucket: list[int] | None) -> dict[str, Any]:
    """A sample whose tar bytes are its real tar bytes / SCALE: a small json and one payload member."""
    meta = json.dumps({"key": key, "bucket": bucket} if bucket else {"key": key}).encode()
    want = tar_bytes(real_sizes) // SCALE
    payload = max(0, want - tar_bytes([len(meta)]) - BLOCK)
    return {"__key__": key, "json": meta, "bin": b"\0" * payload}


def _commit_stage(root: Path, stage: str, units, make) -> dict[str, Any]:
    from latentmill.stages.shardio import StageDir

    sd = StageDir(root / stage, stage).ensure()

    def process(unit, out):
        for sample in make(unit):
            out.add(sample, part="image" if stage != "cache" else "0", bucket=json.loads(sample["json"]).get("bucket"))

    records = [sd.run_unit(u, process) for u in units]
    return sd.write_manifest(records, {"fingerprint": stage})


def _count(root: Path, stage: str, num: int) -> dict[str, Any]:
    sd = root / stage
    tars = len(list((sd / "shards").glob("*.tar")))
    idx = len(list((sd / "shards").glob("*.idx")))
    records = len(list((sd / "units").glob("*.json")))
    sizes = sorted(p.stat().st_size * SCALE for p in (sd / "shards").glob("*.tar"))
    return {"samples": num, "shards": tars, "indexes": idx, "unit_records": records,
            "files_per_1000": round((tars + idx + records) * 1000 / num, 3),
            "shards_per_1000": round(tars * 1000 / num, 3),
            "shard_bytes_full_size": {"min": sizes[0], "median": sizes[len(sizes) // 2], "max": sizes[-1]}}


def run(args) -> list:
    from latentmill.stages.cache import CacheConfig, sample_bytes_estimate
    from latentmill.stages.ingest import DEFAULT_SHARD_BYTES as INGEST_SHARD_BYTES
    from latentmill.stages.ingest import JSON_TAR_BYTES, hash_byte_groups
    from latentmill.stages.shardio import (
        DEFAULT_SHARD_BYTES,
        StageDir,
        WorkUnit,
        copy_estimate,
        units_by_bytes,
    )
    from latentmill.stages.tarshard import TAR_BLOCK, read_shard

    from latentmill.core.hashing import stable_hash
    from latentmill.models import ModelConfig

    num = 20_000 if args.quick else 100_000
    work = temp_dir("files-")
    caption_bytes = bucket_bytes = (256 << 20) // SCALE  # the stage defaults, scaled
    cache_bytes = DEFAULT_SHARD_BYTES // SCALE
    image = [IMAGE_BYTES, JSON_BYTES]
    try:
        # ingest: units grouped as ingest.plan groups a first run, by the entries' estimated bytes (entry_bytes
        # of a 100 KB local image), up to ingest.shard_bytes and ingest.shard_size, at real sizes (as planned)
        ids = [f"img/{i:07d}.jpg" for i in range(num)]
        entry = JSON_TAR_BYTES + TAR_BLOCK + -(-IMAGE_BYTES // TAR_BLOCK) * TAR_BLOCK
        groups = hash_byte_groups(ids, [entry] * num, INGEST_SHARD_SIZE, INGEST_SHARD_BYTES)
        ingest_units = [WorkUnit(stable_hash(["ingest", g]), [str(g[0])], {"members": sorted(g)}, len(g))
                        for g in groups]
        _commit_stage(work, "ingest", ingest_units, lambda u: (
            _sample(f"k{i:07d}", image, None) for i in u.payload["members"]))
        log("ingest written")

        def copy(extra_sizes: list[int], bucket: list[int] | None):
            def make(unit):
                for path in unit.payload["shards"]:
                    for s in read_shard(path):
                        yield _sample(s["__key__"], image + extra_sizes, bucket)
            return make

        def scaled(per_sample: int):
            real = copy_estimate(per_sample)
            return lambda up, entry: real(up, entry) - per_sample * entry["samples"] + per_sample * entry[
                "samples"] // SCALE

        up = StageDir(work / "ingest", "ingest")
        units = units_by_bytes(up, {"stage": "caption"}, caption_bytes, StageDir(work / "caption", "caption"),
                               scaled(2 * BLOCK))
        _commit_stage(work, "caption", units, copy([100], None))
        log("caption written")
        up = StageDir(work / "caption", "caption")
        units = units_by_bytes(up, {"stage": "bucket"}, bucket_bytes, StageDir(work / "bucket", "bucket"),
                               scaled(BLOCK))
        _commit_stage(work, "bucket", units, copy([100, 100], [512, 512, 1]))
        log("bucket written")
        per_sample = sample_bytes_estimate(CacheConfig(dtype="bfloat16", max_sequence_length=77),
                                           ModelConfig(pretrained=str(work / "no-model")), "flux")

        def cache_estimate(upstream, entry):
            return int(entry["samples"]) * per_sample([512, 512, 1]) // SCALE

        up = StageDir(work / "bucket", "bucket")
        units = units_by_bytes(up, {"stage": "cache"}, cache_bytes, StageDir(work / "cache", "cache"), cache_estimate)
        real_cache = [16 * 64 * 64 * 2 + 128, 77 * 4096 * 2 + 768 * 2 + 160, JSON_BYTES]

        def make_cache(unit):
            for path in unit.payload["shards"]:
                for s in read_shard(path):
                    yield _sample(s["__key__"], real_cache, [512, 512, 1])

        _commit_stage(work, "cache", units, make_cache)
        log("cache written")
        counts = {stage: _count(work, stage, num) for stage in ("ingest", "caption", "bucket", "cache")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    inputs = {"samples": num, "scale": SCALE, "cache_shard_bytes": DEFAULT_SHARD_BYTES,
              "caption_bucket_shard_bytes": 256 << 20, "ingest_shard_size": INGEST_SHARD_SIZE,
              "ingest_shard_bytes": INGEST_SHARD_BYTES, "ingest_units": len(ingest_units),
              "cache_sample_bytes": tar_bytes(real_cache), "image_sample_bytes": tar_bytes(image)}
    figures = []
    for stage, c in counts.items():
        log(f"{stage}: {c}")
        figures.append(figure(f"files per 1,000 samples: {stage}", [c["files_per_1000"]], [1.0], "files",
                              "<= 5", inputs, notes="shard tars + indexes + unit records per 1,000 samples",
                              details=c))
    figures.append(figure("cache shards per 1,000 samples", [counts["cache"]["shards_per_1000"]], [1.0], "shards",
                          "<= 2", inputs, details=counts["cache"]))
    return figures


def main(argv=None) -> None:
    run_benchmark("files", __doc__, run, argv)


if __name__ == "__main__":
    main()
