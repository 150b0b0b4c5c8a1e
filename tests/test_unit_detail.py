"""A unit's per-sample facts (a curate unit's score rows, a cache unit's component keys) live in a detail file
beside its shards, named by its record (``StageDir.unit_detail``): the record holds counts only, so every
pass over a stage's records costs per unit; the catalog is entered from the detail and rebuilt from it, and
an output folder written before detail files (the facts inside each record) is reused as it is."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from latentmill.stages.catalog import FILE
from latentmill.stages.shardio import StageDir, UnitOutput, WorkUnit


def _key(n: int) -> str:
    return f"{n:064x}"


def _commit_with_detail(stage_dir: StageDir, unit_id: str, detail: dict) -> None:
    out = UnitOutput(stage_dir.ensure(), WorkUnit(unit_id, [], {}, 1))
    out.add({"__key__": f"{unit_id}-0", "json": b"{}"})
    out.extra["counts"] = {"samples": 1}
    out.detail.update(detail)
    out.commit(0.0)


def test_the_record_names_its_detail_and_the_catalog_is_rebuilt_from_it(tmp_path):
    cache = StageDir(tmp_path / "prep" / "cache", "cache")
    curate = StageDir(tmp_path / "prep" / "curate", "curate")
    _commit_with_detail(cache, "u1", {"components": {"a": {"vae": _key(1), "text": [_key(2), _key(3)]}}})
    _commit_with_detail(curate, "c1", {"scores": {"s0": {"source": "a.jpg", "kind": "image",
                                                         "keys": {"sharpness": _key(7)},
                                                         "values": {"sharpness": 0.5}}}})
    record = json.loads(cache.unit_path("u1").read_text())
    assert "components" not in record["extra"] and record["extra"]["counts"] == {"samples": 1}
    assert record["extra"]["detail"] == "shards/cache-u1-detail.json"
    assert cache.unit_detail(cache.load_record("u1")) == {"components": {"a": {"vae": _key(1),
                                                                              "text": [_key(2), _key(3)]}}}
    now = time.time_ns()

    def lookups() -> tuple:
        with cache.lookup() as found:
            comps = tuple(found.component(cache.root, kind, _key(k), now)[1:3]
                          for kind, k in (("vae", 1), ("text", 2), ("text", 3)))
        with curate.lookup() as found:
            return comps, found.score(_key(7))

    committed = lookups()
    assert committed == ((("a", 0), ("a", 1), ("a", 2)), 0.5)
    (tmp_path / "prep" / FILE).unlink()
    assert lookups() == committed  # rebuilt from the records and their detail files
    # a unit whose detail file is gone is not complete: it runs again
    (cache.root / record["extra"]["detail"]).unlink()
    assert cache.load_record("u1") is None and curate.load_record("c1") is not None


def _to_records_of_before(stage_dir: StageDir) -> int:
    """Rewrite the stage's records as the commit before detail files wrote them (the per-sample facts inside
    ``extra``, no detail file, no per-unit scores table); returns how many were rewritten."""
    rewritten = 0
    for path in sorted(stage_dir.unit_dir.glob("*.json")):
        record = json.loads(path.read_text())
        extra = record["extra"]
        for key in ("detail", "scores_table"):
            if key in extra:
                name = extra.pop(key)
                if key == "detail":
                    extra.update(json.loads((stage_dir.root / name).read_text()))
                (stage_dir.root / name).unlink()
                rewritten += key == "detail"
        path.write_text(json.dumps(record, indent=1, sort_keys=True))
    return rewritten


@pytest.mark.slow
def test_an_output_written_before_detail_files_is_reused_whole(tmp_path, tiny_flux, demo_images):
    """A prep over an output folder whose records hold their per-sample facts (and no catalog): every unit of
    every stage is reused, the manifests and ``prep/scores.parquet`` are what they were, and a refresh with a
    new image encodes only that image, finding the old components through the catalog rebuilt from the old
    records."""
    import pyarrow.parquet as pq
    from latentmill.pipelines.prep import STAGES, run_stages_in_process
    from latentmill.stages import cache
    from PIL import Image

    from latentmill.recipe import load_recipe
    from tests.conftest import DEMO_CONFIG

    out = tmp_path / "out"
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={out}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={demo_images}", "compaction.auto_after=0"])
    first = run_stages_in_process(recipe)
    table = pq.read_table(out / "prep" / "scores.parquet").to_pylist()
    assert len(table) == 24 and all(row["sharpness"] is not None for row in table)
    assert _to_records_of_before(first["curate"][0]) == len(first["curate"][2]) > 0
    assert _to_records_of_before(first["cache"][0]) == len(first["cache"][2]) > 0
    (out / "prep" / FILE).unlink()
    (out / "prep" / "scores.parquet").unlink()

    again = run_stages_in_process(recipe)
    for stage in STAGES:
        records = again[stage][2]
        assert len(records) > 0 and records.reused == set(records.unit_ids), stage
        assert again[stage][1] == first[stage][1], stage
    assert pq.read_table(out / "prep" / "scores.parquet").to_pylist() == table

    # a refresh: one new image, its caption copied from an old one (so its text embedding is reused)
    old = sorted(demo_images.glob("*.png"))[0]
    image = Image.open(old).convert("RGB")
    image.putpixel((0, 0), (1, 2, 3))
    image.save(demo_images / "zz_new.png")
    shutil.copy(old.with_suffix(".txt"), demo_images / "zz_new.txt")
    refresh = run_stages_in_process(recipe)
    report = cache.component_report(refresh["cache"][2])["components"]
    assert report == {"vae": {"processed": 1, "reused": 24}, "text": {"processed": 0, "reused": 25}}
    rows = pq.read_table(out / "prep" / "scores.parquet").to_pylist()
    assert [r for r in rows if r["source"] != "zz_new.png"] == table and len(rows) == 25
