"""Shard I/O: deterministic webdataset tars, atomic commits, unit records and reuse, manifests."""

from __future__ import annotations

import json

import pytest
import webdataset as wds
from latentmill.stages.shardio import StageDir, WorkUnit, read_shard, sha256_file, stage_report


def _samples(n):
    return [{"__key__": f"k{i:03d}", "txt": f"caption {i}".encode(), "json": json.dumps({"i": i}).encode()}
            for i in range(n)]


def _writer(samples, part_of=lambda s: "0"):
    def process(unit, out):
        for s in samples:
            if s["__key__"] == "k002":
                out.quarantine(s["__key__"], "src/k002", "bad on purpose")
                continue
            out.add(s, part=part_of(s), bucket=[16, 16, 1])
    return process


def test_round_trip_and_webdataset_compatibility(tmp_path):
    stage = StageDir(tmp_path / "s", "demo").ensure()
    unit = WorkUnit("u" * 64, ["in1"], {}, samples_in=5)
    record = stage.run_unit(unit, _writer(_samples(5)))
    assert [s.samples for s in record.shards] == [4]
    assert record.quarantined == [{"key": "k002", "source": "src/k002", "stage": "demo", "reason": "bad on purpose"}]
    path = stage.root / record.shards[0].path
    assert record.shards[0].sha256 == sha256_file(path)
    ours = list(read_shard(path))
    assert [s["__key__"] for s in ours] == ["k000", "k001", "k003", "k004"]
    assert ours[1]["txt"] == b"caption 1"
    # The same tar through the webdataset library itself.
    theirs = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in theirs] == ["k000", "k001", "k003", "k004"]
    assert theirs[3]["json"] == ours[3]["json"]
    assert not list(stage.shard_dir.glob("*.tmp"))


def test_bytes_are_deterministic_and_units_are_reused(tmp_path):
    digests = []
    for name in ("a", "b"):
        stage = StageDir(tmp_path / name, "demo").ensure()
        record = stage.run_unit(WorkUnit("x" * 64, [], {}, 5), _writer(_samples(5)))
        digests.append(record.shards[0].sha256)
    assert digests[0] == digests[1]

    calls = []
    again = stage.run_unit(WorkUnit("x" * 64, [], {}, 5), lambda u, o: calls.append(1))
    assert again.reused and not calls and again.shards[0].sha256 == digests[1]


def test_failed_unit_leaves_nothing_behind(tmp_path):
    stage = StageDir(tmp_path / "s", "demo").ensure()

    def explode(unit, out):
        out.add(_samples(1)[0])
        raise RuntimeError("killed mid-shard")

    with pytest.raises(RuntimeError):
        stage.run_unit(WorkUnit("y" * 64, [], {}, 1), explode)
    assert list(stage.shard_dir.iterdir()) == []
    assert stage.load_record("y" * 64) is None


def test_record_without_its_shard_is_not_complete(tmp_path):
    stage = StageDir(tmp_path / "s", "demo").ensure()
    record = stage.run_unit(WorkUnit("z" * 64, [], {}, 5), _writer(_samples(5)))
    (stage.root / record.shards[0].path).unlink()
    assert stage.load_record("z" * 64) is None


def test_manifest_counts_conserve_and_parts_split(tmp_path):
    stage = StageDir(tmp_path / "s", "demo").ensure()
    by_parity = _writer(_samples(6), part_of=lambda s: str(int(s["__key__"][1:]) % 2))
    record = stage.run_unit(WorkUnit("w" * 64, [], {}, 6), by_parity)
    assert sorted(s.samples for s in record.shards) == [2, 3]
    manifest = stage.write_manifest([record], {"fingerprint": "f"})
    assert manifest["counts"] == {"in": 6, "out": 5, "quarantined": 1}
    assert json.loads(stage.manifest_path.read_text()) == manifest
    assert stage.quarantine_path.read_text().count("\n") == 1
    report = stage_report("demo", [record], 0.5)
    assert (report["in"], report["out"], report["quarantined"], report["processed"], report["reused"]) == (6, 5, 1, 6, 0)


def test_allocator_controls_are_found_on_linux():
    import sys

    from latentmill.stages import shardio

    if sys.platform.startswith("linux"):
        # otherwise prep's heap would silently never be trimmed nor its arenas capped
        assert shardio._malloc_trim is not None and shardio._mallopt is not None
        assert shardio._mallinfo2 is not None and shardio._mallinfo2().arena > 0
    shardio.tune_allocator()
    for _ in range(2 * shardio.TRIM_EVERY_UNITS):
        shardio.release_memory()
    assert 0 <= shardio._units_since_trim < shardio.TRIM_EVERY_UNITS


def test_shard_digest_is_hashed_while_writing_and_matches_the_file(tmp_path):
    import os

    stage = StageDir(tmp_path / "s", "demo").ensure()
    big = [{"__key__": f"k{i}", "bin": os.urandom(3_000_001 + i), "json": b"{}"} for i in range(3)]

    def process(unit, out):
        for s in big:
            out.add(s)

    record = stage.run_unit(WorkUnit("b" * 64, ["in"], {}, samples_in=3), process)
    path = stage.root / record.shards[0].path
    assert record.shards[0].sha256 == sha256_file(path) and path.stat().st_size % 512 == 0
    assert [s["bin"] for s in read_shard(path)] == [s["bin"] for s in big]
