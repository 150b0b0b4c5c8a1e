"""Shards sized by bytes (issue 17, item 1): units grouped up to a byte target, one shard of every bucket per
unit, a unit larger than the target cut into shards of about equal size; refreshes keep old shards byte for
byte; a killed prep resumes to the same bytes; the trainer still gets one-bucket batches of every sample.

(Threads vs processes writing identical bytes is ``tests/test_pipelines.py::
test_other_runners_write_identical_bytes``, which runs the demo recipe: since this change its shards hold
several buckets and its cache units read several bucket shards, which ``test_demo_recipe_...`` below checks.)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import shutil
from pathlib import Path

import pytest
from latentmill.pipelines.prep import plan_stage, stage_processor
from latentmill.stages.shardio import StageDir, UnitOutput, WorkUnit, group_by_bytes, shard_buckets
from latentmill.stages.tarshard import read_shard
from latentmill.trainer.loader import LatentLoader
from PIL import Image

from latentmill.recipe import load_recipe
from tests.conftest import DEMO_CONFIG
from tests.helpers import prep_in_process

pytestmark = pytest.mark.slow

RECORD = 10240  # a tar's last record is padded to this many bytes
STAGES = ("caption", "curate", "bucket", "cache")


def _recipe(tiny_flux, images, out, *extra):
    return load_recipe(DEMO_CONFIG, [f"output_dir={out}", f"model.pretrained={tiny_flux}",
                                     f"ingest.source={images}", *extra])


def _shards(out: Path, stage: str) -> dict[str, tuple[str, int, int]]:
    """name -> (sha256 of the file, size, samples) of every shard in the stage's manifest."""
    root = out / "prep" / stage
    manifest = json.loads((root / "manifest.json").read_text())
    result = {}
    for s in manifest["shards"]:
        data = (root / s["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"]
        result[s["name"]] = (s["sha256"], len(data), s["samples"])
    return result


def _sample_buckets(path: Path) -> list[tuple[int, ...]]:
    return [tuple(json.loads(s["json"])["bucket"]) for s in read_shard(path)]


def test_group_by_bytes_packs_to_the_target_and_keeps_old_groups():
    items = [(f"s{i}", size) for i, size in enumerate([30, 50, 20, 40, 10, 70, 120, 5])]
    groups = group_by_bytes(items, [], 100)
    assert groups == [["s0", "s1", "s2"], ["s3", "s4"], ["s5"], ["s6"], ["s7"]]
    size = dict(items)
    for group, nxt in zip(groups, groups[1:]):  # next fit: a group closes when the next item would not fit
        assert sum(size[n] for n in group) + size[nxt[0]] > 100
        assert sum(size[n] for n in group) <= 100 or len(group) == 1  # s6 alone is larger than the target
    # A refresh: two new items and one gone. Old groups keep their members (minus the gone one); only the
    # new items form a new group, even though they would fit into the old, partly filled groups.
    refreshed = group_by_bytes(items[:4] + items[5:] + [("n1", 10), ("n2", 15)], groups, 100)
    assert refreshed == [["s0", "s1", "s2"], ["s3"], ["s5"], ["s6"], ["s7"], ["n1", "n2"]]


def test_a_unit_past_its_target_rolls_into_shards_of_at_most_the_target(tmp_path):
    """UnitOutput with ``roll_bytes``: the cut falls before the sample that would pass it, the same on every
    write; each shard's bucket is null once it holds two buckets, with counts per bucket."""
    rng = random.Random(0)
    samples = [{"__key__": f"k{i:03d}", "bin": rng.randbytes(rng.randrange(1000, 3000)),
                "json": json.dumps({"bucket": [16 * (1 + i % 3), 16, 1]}).encode()} for i in range(60)]
    digests = []
    for attempt in range(2):
        sd = StageDir(tmp_path / f"s{attempt}", "cache").ensure()
        out = UnitOutput(sd, WorkUnit("u" * 64, ["x"], {"roll_bytes": 40_000}, len(samples)))
        for s in samples:
            out.add(s, bucket=json.loads(s["json"])["bucket"])
        record = out.commit(0.0)
        digests.append([(s.name, s.sha256) for s in record.shards])
        sizes = [(sd.root / s.path).stat().st_size for s in record.shards]
        assert sum(s.samples for s in record.shards) == 60 and len(record.shards) >= 3
        assert all(size <= 40_000 + RECORD for size in sizes)
        assert all(size >= 40_000 - 2 * 3600 - RECORD for size in sizes[:-1])  # full but for one sample
        for s in record.shards:
            buckets = _sample_buckets(sd.root / s.path)
            assert s.bucket is None and s.buckets == {"x".join(map(str, b)): buckets.count(b) for b in set(buckets)}
    assert digests[0] == digests[1]
    assert [n for n, _ in digests[0]][:3] == ["cache-uuuuuuuuuuuuuuuu-0.tar", "cache-uuuuuuuuuuuuuuuu-0-1.tar",
                                              "cache-uuuuuuuuuuuuuuuu-0-2.tar"]


@pytest.fixture(scope="module")
def demo_prep(tiny_flux, tmp_path_factory):
    from tests.conftest import DEMO_IMAGES

    root = tmp_path_factory.mktemp("bytes")
    images = root / "images"
    shutil.copytree(DEMO_IMAGES, images)
    recipe = _recipe(tiny_flux, images, root / "out")
    return recipe, prep_in_process(recipe)


def test_demo_recipe_writes_the_shards_its_byte_targets_imply(demo_prep):
    recipe, result = demo_prep
    out = Path(recipe.output_dir)
    counts = {}
    for stage in STAGES:
        target = getattr(recipe, stage).shard_bytes
        shards = _shards(out, stage)
        sizes = sorted(size for _, size, _ in shards.values())
        counts[stage] = len(shards)
        total = sum(sizes)
        # as many shards as the bytes need: one more at most (the units are cut at whole upstream shards)
        assert math.ceil(total / target) <= len(shards) <= math.ceil(total / target) + 1, (stage, sizes)
        # each within 10% (and the tar's last record) of the target, every one but the smallest at least half
        # of it (the demo's upstream shards are each under half the target, so next fit fills a unit past it)
        assert all(size <= 1.1 * target + RECORD for size in sizes), (stage, sizes, target)
        assert all(size >= target / 2 for size in sizes[1:]), (stage, sizes, target)
        units = result[stage][2]
        assert len(units) >= 2  # the parallel runners and the resume tests still have several units
    assert counts == {"caption": 3, "curate": 3, "bucket": 3, "cache": 2}  # truncated.jpg: quarantined at curate
    # one shard per unit, holding several buckets; its manifest entry counts them, its index holds each
    cache_root = out / "prep" / "cache"
    manifest = json.loads((cache_root / "manifest.json").read_text())
    mixed = 0
    for entry in manifest["shards"]:
        buckets = _sample_buckets(cache_root / entry["path"])
        assert buckets == sorted(buckets)  # (bucket, key) order inside a unit
        counts_here = {"x".join(map(str, b)): buckets.count(b) for b in set(buckets)}
        assert shard_buckets(entry) == counts_here
        mixed += len(counts_here) > 1
    assert mixed == len(manifest["shards"]) == 2
    # several upstream shards per cache unit: the units group bucket shards
    assert max(len(u.inputs) for u in result["cache"][2]) >= 2


def test_the_loader_gives_one_bucket_batches_of_every_sample(demo_prep):
    recipe, _ = demo_prep
    cache_root = Path(recipe.output_dir) / "prep" / "cache"
    expected = sorted(s["__key__"] for shard in _shards(Path(recipe.output_dir), "cache")
                      for s in read_shard(cache_root / "shards" / shard))
    assert len(expected) == 24
    loader = LatentLoader(cache_root, batch_size=4, seed=3)
    for epoch in (0, 1):
        keys = []
        for batch in itertools.islice(loader, len(loader)):
            width, height, _ = batch["bucket"]
            assert batch["latents"].shape[2:] == (height // 8, width // 8)
            keys += batch["keys"]
        assert sorted(keys) == expected, epoch  # every sample once per epoch
    loader.close()


def _new_images(folder: Path, count: int) -> list[str]:
    names = []
    for i in range(count):
        img = Image.new("RGB", (96 + 16 * i, 128), (40 * i, 200 - 30 * i, 90))
        img.putpixel((i, i), (255, 0, 0))
        img.save(folder / f"new_{i}.png")
        (folder / f"new_{i}.txt").write_text(f"a new flat test image number {i}")
        names.append(f"new_{i}.png")
    return names


def test_a_refresh_keeps_old_shards_byte_identical_and_adds_shards_for_new_inputs(tiny_flux, demo_images,
                                                                                     tmp_path):
    out = tmp_path / "out"
    prep_in_process(_recipe(tiny_flux, demo_images, out))
    before = {stage: _shards(out, stage) for stage in ("ingest", *STAGES)}
    _new_images(demo_images, 3)
    result = prep_in_process(_recipe(tiny_flux, demo_images, out))
    for stage in ("ingest", *STAGES):
        after = _shards(out, stage)
        assert {n: after[n] for n in before[stage]} == before[stage], stage  # same names, same bytes
        added = {n: v for n, v in after.items() if n not in before[stage]}
        assert added and sum(samples for _, _, samples in added.values()) == 3, (stage, added)
        records = result[stage][2]
        assert sum(r.samples_in for r in records if not r.reused) == 3, stage  # only the new inputs ran


def test_a_killed_prep_resumes_to_the_bytes_of_an_uninterrupted_one(tiny_flux, demo_images, tmp_path):
    """The disk as a SIGKILL inside the cache stage leaves it: the first cache unit committed, the second's
    shard half-written as ``.tmp``, no unit record, no manifest. The next prep reuses the first unit, runs
    the second, and ends with the bytes of a prep that was never interrupted (same units, same shards)."""
    clean = _recipe(tiny_flux, demo_images, tmp_path / "clean")
    prep_in_process(clean)
    killed = _recipe(tiny_flux, demo_images, tmp_path / "killed")
    for stage in ("ingest", "caption", "curate", "bucket"):
        sd = StageDir(killed.stage_dir(stage), stage).ensure()
        records = [sd.run_unit(u, stage_processor(stage, killed)) for u in plan_stage(stage, killed)]
        from latentmill.pipelines.prep import manifest_header

        sd.write_manifest(records, manifest_header(stage, killed))
    sd = StageDir(killed.stage_dir("cache"), "cache").ensure()
    units = plan_stage("cache", killed)
    assert len(units) == 2
    sd.run_unit(units[0], stage_processor("cache", killed))
    partial = sd.shard_dir / f"cache-{units[1].unit_id[:16]}-0.tar.tmp"
    partial.write_bytes(b"\0" * 5000)  # what the killed writer left
    result = prep_in_process(killed)
    reused = {r.unit_id: r.reused for r in result["cache"][2]}
    assert reused == {units[0].unit_id: True, units[1].unit_id: False}
    for stage in ("ingest", *STAGES):
        assert _shards(tmp_path / "killed", stage) == _shards(tmp_path / "clean", stage), stage
