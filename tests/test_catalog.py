"""The output folder's catalog (``stages/catalog.py``): rows written in each unit's commit, rebuilt from the
unit records when missing or behind, and the lookups the curate and cache stages reuse work by."""

from __future__ import annotations

import json
import os
import time

import pytest
from latentmill.stages.catalog import FILE, Catalog, raw_key
from latentmill.stages.shardio import StageDir, StageRecords, UnitOutput, WorkUnit


def _key(n: int) -> str:
    return f"{n:064x}"


def _commit(stage_dir: StageDir, unit_id: str, extra: dict, samples: int = 1) -> None:
    """A committed unit with one shard of ``samples`` samples and ``extra`` in its record."""
    out = UnitOutput(stage_dir.ensure(), WorkUnit(unit_id, [], {}, samples))
    for n in range(samples):
        out.add({"__key__": f"{unit_id}-{n}", "json": b"{}"})
    out.extra.update(extra)
    out.commit(0.0)


def _curate_extra(scores: dict[str, float], ekeys: list[str] | None = None) -> dict:
    rows = {f"s{n}": {"keys": {"sharpness": key}, "values": {"sharpness": value}}
            for n, (key, value) in enumerate(scores.items())}
    extra = {"scores": rows}
    if ekeys is not None:
        extra["embeddings"] = {"file": "shards/emb.npy", "ekeys": ekeys, "keys": list(rows)}
    return extra


def _cache_extra(components: dict[str, tuple[str, list[str]]], device: str = "cpu-a",
                 foreign: dict[str, str] | None = None) -> dict:
    extra = {"components": {s: {"vae": v, "text": t} for s, (v, t) in components.items()},
             "device": {"key": device}}
    if foreign:
        extra["foreign"] = foreign
    return extra


def test_a_commit_enters_its_rows_and_a_lookup_finds_them(tmp_path):
    curate = StageDir(tmp_path / "prep" / "curate", "curate")
    _commit(curate, "u1", _curate_extra({_key(1): 0.25, _key(2): 0.5}, [_key(10), _key(11)]))
    assert (tmp_path / "prep" / FILE).is_file()
    with curate.lookup() as found:
        assert (found.score(_key(1)), found.score(_key(2)), found.score(_key(3))) == (0.25, 0.5, None)
        assert found.embedding(_key(11)) == ("shards/emb.npy", 1)
        assert found.score("not a key") is None and found.embedding(_key(12)) is None


def test_a_missing_or_behind_catalog_is_rebuilt_from_the_unit_records(tmp_path):
    """The records are the truth: a catalog deleted, or one a killed run left behind its records (a record
    written, its rows not), gives the same lookups once synced; a unit whose record is gone (gc) is forgotten."""
    cache = StageDir(tmp_path / "prep" / "cache", "cache")
    _commit(cache, "u1", _cache_extra({"a": (_key(1), [_key(2)])}))
    _commit(cache, "u2", _cache_extra({"b": (_key(3), [_key(2), _key(4)])}))
    now = time.time_ns()

    def everything() -> dict:
        with cache.lookup() as found:
            return {k: found.component(cache.root, kind, _key(k), now)
                    for kind, k in (("vae", 1), ("text", 2), ("vae", 3), ("text", 4))}

    before = everything()
    assert before[1][1:] == ("a", 0, "cpu-a") and before[4][1:] == ("b", 2, "cpu-a")
    assert before[2][1] == "a"  # the older unit's, when two hold it
    (tmp_path / "prep" / FILE).unlink()
    assert everything() == before
    # behind: a record on disk that the catalog does not have (killed between the two writes)
    record = json.loads(cache.unit_path("u2").read_text())
    record["unit_id"] = "u3"
    cache.unit_path("u3").write_text(json.dumps(record))
    assert Catalog(tmp_path / "prep" / FILE).sync("cache", cache.unit_dir) == 1
    assert Catalog(tmp_path / "prep" / FILE).sync("cache", cache.unit_dir) == 0  # now in line
    # gone: gc removed a record, its rows go with it
    cache.unit_path("u1").unlink()
    after = everything()
    assert after[1] is None and after[2][1] == "b"


def test_a_component_comes_from_the_oldest_unit_before_the_cutoff_whose_shards_are_on_disk(tmp_path):
    cache = StageDir(tmp_path / "prep" / "cache", "cache")
    _commit(cache, "old", _cache_extra({"a": (_key(1), [_key(9)])}, device="gpu-x", foreign={_key(1): "gpu-y"}))
    time.sleep(0.01)
    _commit(cache, "new", _cache_extra({"b": (_key(1), [_key(9)])}))
    cutoff = time.time_ns()
    time.sleep(0.01)
    _commit(cache, "later", _cache_extra({"c": (_key(7), [_key(9)])}))
    with cache.lookup() as found:
        shards, sample, member, device = found.component(cache.root, "vae", _key(1), cutoff)
        assert (sample, member, device) == ("a", 0, "gpu-y")  # encoded elsewhere: the record's foreign origin
        assert all(p.is_file() for p in shards) and shards[0].parent == cache.shard_dir
        assert found.component(cache.root, "text", _key(9), cutoff)[3] == "gpu-x"
        assert found.component(cache.root, "vae", _key(7), cutoff) is None  # committed after the plan
    for shard in shards:
        shard.unlink()
    with cache.lookup() as found:
        assert found.component(cache.root, "vae", _key(1), cutoff)[1:] == ("b", 0, "cpu-a")


def test_what_a_unit_stored_goes_with_its_record(tmp_path):
    """Only committed records count: when gc removes a unit (or a user its stage folder), its scores and
    embeddings are no longer found, and a key another unit also holds still is."""
    curate = StageDir(tmp_path / "prep" / "curate", "curate")
    _commit(curate, "u1", _curate_extra({_key(1): 0.75, _key(2): 0.5}, [_key(5)]))
    _commit(curate, "u2", _curate_extra({_key(2): 0.5}))
    curate.unit_path("u1").unlink()
    with curate.lookup() as found:
        assert found.score(_key(1)) is None and found.embedding(_key(5)) is None
        assert found.score(_key(2)) == 0.5


def test_planned_units_travel_by_id(tmp_path):
    catalog = Catalog(tmp_path / FILE)
    units = [WorkUnit(f"u{n}", [_key(n)], {"items_json": json.dumps([{"id": n}]), "n": n}, n) for n in range(3)]
    catalog.put_plan("ingest", ((u.unit_id, json.dumps(u.to_json())) for u in units))
    got = [WorkUnit.from_json(d) for d in catalog.planned("ingest", ["u2", "u0"])]
    assert [vars(u) for u in got] == [vars(units[2]), vars(units[0])]
    catalog.put_plan("ingest", [])  # a new plan replaces the stage's last one
    with pytest.raises(KeyError, match="no planned ingest unit u1"):
        catalog.planned("ingest", ["u1"])


def test_keys_are_stored_as_their_32_bytes():
    assert raw_key(_key(255)) == bytes(31) + b"\xff"
    assert raw_key("xyz") is None and raw_key("g" * 64) is None


def test_stage_records_read_each_record_from_its_file(tmp_path):
    """What the flow holds of a stage is its unit ids: each pass reads the records again, in unit id order,
    with ``reused`` as this run found them."""
    curate = StageDir(tmp_path / "prep" / "curate", "curate")
    for unit_id in ("b", "a"):
        _commit(curate, unit_id, _curate_extra({_key(ord(unit_id)): 1.0}), samples=2)
    records = StageRecords(curate, ["b", "a"], reused=["a"])
    assert [(r.unit_id, r.reused, r.samples_out) for r in records] == [("a", True, 2), ("b", False, 2)]
    assert len(records) == 2 and records[1].unit_id == "b"
    assert list(records)[0].extra["scores"]["s0"]["values"] == {"sharpness": 1.0}
    os.unlink(curate.unit_path("b"))
    with pytest.raises(FileNotFoundError, match="was the output folder changed"):
        list(records)


def test_a_near_duplicate_update_with_nothing_new_keeps_the_index_width(tmp_path):
    """``neardup.update`` reads only records not entered before; with none (an unchanged re-run) it opens the
    index with the width it holds, not the thumbnail embedder's (a CLIP embedder's index is 512 wide)."""
    import numpy as np
    from latentmill.stages import neardup
    from latentmill.stages.shardio import UnitRecord

    fingerprint = {"embedder": "a 8-wide test embedder"}
    folder = neardup.index_folder(tmp_path, fingerprint)
    index = neardup.NearDupIndex(folder, 8)
    rng = np.random.default_rng(0)
    index.enter(["a", "b"], rng.standard_normal((2, 8)).astype(np.float32), [None, None], ["u1"])
    index.close()
    assert neardup.NearDupIndex.stored_dim(folder) == 8
    entered = UnitRecord("u1", "curate", [], [], [], 2, 0.0, {})
    summary = neardup.update(tmp_path, [entered], fingerprint, 0.9)
    assert summary["entered"] == 0 and summary["indexed"] == 2


def test_a_catalog_of_another_schema_is_emptied_and_refilled_from_the_records(tmp_path):
    import sqlite3

    curate = StageDir(tmp_path / "prep" / "curate", "curate")
    _commit(curate, "u1", _curate_extra({_key(1): 0.25}))
    db = sqlite3.connect(tmp_path / "prep" / FILE)
    db.execute("UPDATE meta SET value = '0' WHERE name = 'schema'")
    db.execute("INSERT INTO scores VALUES (?, 99, 0.5)", (raw_key(_key(2)),))  # a row the records do not hold
    db.commit()
    db.close()
    with curate.lookup() as found:
        assert found.score(_key(1)) == 0.25 and found.score(_key(2)) is None


def test_only_the_curate_and_cache_stages_enter_lookups(tmp_path):
    """Another stage's record may carry fields of the same names with other meanings (the caption stage's
    ``device`` is the captioner's, a string): its unit is entered, nothing of it is looked up."""
    caption = StageDir(tmp_path / "prep" / "caption", "caption")
    _commit(caption, "u1", {**_curate_extra({_key(1): 0.5}), **_cache_extra({"a": (_key(2), [_key(3)])}),
                            "device": "cpu"})
    now = time.time_ns()
    with caption.lookup() as found:
        assert found.score(_key(1)) is None and found.component(caption.root, "vae", _key(2), now) is None
