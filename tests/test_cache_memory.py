"""The cache stage holds one batch of raw images at a time, not its whole unit's.

A cache unit reads bucket shards worth up to ``cache.shard_bytes`` of output: hundreds of MB of raw images
at full size. It used to read every sample of the unit into memory (to sort them by bucket and key) before
encoding the first batch, so a prep's peak memory grew with the unit. Here 24 noise PNGs of ~1 MB each
(28 MiB of raw bytes in one unit) are cached with ``cache.batch_size`` 4: the Python heap's peak during the
unit (``tracemalloc``: bytes objects, not torch tensors) must stay far below the unit's raw bytes.
"""

from __future__ import annotations

import shutil
import tracemalloc

import numpy as np
import pytest
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from PIL import Image

from tests.conftest import DEMO_CONFIG

pytestmark = pytest.mark.slow

COUNT, SIDE = 24, 640  # 640x640 RGB noise: ~1.2 MB a PNG


@pytest.mark.heavy  # a memory measurement; make test: the records read one at a time, below
def test_a_cache_unit_holds_one_batch_of_images_not_the_unit(tmp_path, tiny_flux):
    from latentmill.pipelines.prep import plan_stage, run_stages_in_process, stage_dir_for, stage_processor

    from latentmill.recipe import load_recipe

    source = tmp_path / "images"
    source.mkdir()
    rng = np.random.default_rng(0)
    for i in range(COUNT):
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(source / f"n{i:02d}.png")
        (source / f"n{i:02d}.txt").write_text(f"noise {i}")
    raw = sum(p.stat().st_size for p in source.glob("*.png"))
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path / 'out'}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={source}", "ingest.shard_bytes=1000000000",
                                       "caption.shard_bytes=1000000000", "bucket.shard_bytes=1000000000",
                                       "cache.shard_bytes=1000000000", "cache.batch_size=4",
                                       "cache.prefetch=false", "compaction.auto_after=0"])
    run_stages_in_process(recipe)  # every stage once (models loaded, bucket shards written)
    cache_root = recipe.stage_dir("cache")
    expected = {s["__key__"]: s for s in read_shard(next((cache_root / "shards").glob("*.tar")))}
    shutil.rmtree(cache_root)
    (unit,) = plan_stage("cache", recipe)
    stage = stage_dir_for(recipe, "cache").ensure()
    tracemalloc.start()
    try:
        record = stage.run_unit(unit, stage_processor("cache", recipe))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert record.samples_out == COUNT and raw > 24 * 2**20
    assert peak < raw / 4, f"peak Python heap {peak / 2**20:.1f} MiB for {raw / 2**20:.1f} MiB of images"
    # the same bytes as the first run of the unit (reading members by offset changes nothing)
    (shard,) = record.shards
    got = {s["__key__"]: s for s in read_shard(StageDir(cache_root, "cache").root / shard.path)}
    assert got == expected


def test_the_flow_reads_cache_records_one_at_a_time_and_reports_the_same(tmp_path, tiny_flux, demo_images):
    """The prep flow holds a stage's unit ids, not its records (``StageRecords``): a cache record's per-sample
    ``components`` are read from its file for each pass and dropped after it. What the flow computes from
    them (manifest header with ``encoded_on``, stage report, component report) is what the same records give
    held in memory."""
    from latentmill.pipelines.prep import manifest_header, run_stages_in_process
    from latentmill.stages import cache
    from latentmill.stages.shardio import StageRecords, stage_report

    from latentmill.recipe import load_recipe

    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path / 'out'}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={demo_images}", "compaction.auto_after=0"])
    stage_dir, _, records = run_stages_in_process(recipe)["cache"]
    assert isinstance(records, StageRecords) and set(vars(records)) == {"stage_dir", "unit_ids", "reused"}
    full = list(records)
    samples = sum(len(stage_dir.unit_detail(r)["components"]) for r in full)
    assert samples == sum(r.samples_out for r in full) > 0
    assert manifest_header("cache", recipe, records) == manifest_header("cache", recipe, full)
    assert stage_report("cache", records, 1.0) == stage_report("cache", full, 1.0)
    assert cache.component_report(records) == cache.component_report(full)
    assert [r.unit_id for r in records] == sorted(r.unit_id for r in full)
