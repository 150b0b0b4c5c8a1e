"""Shard I/O: deterministic webdataset tars, atomic commits, unit records and reuse, manifests."""

from __future__ import annotations

import json

import pytest
import webdataset as wds
from latentmill.stages.shardio import StageDir, WorkUnit, stage_report
from latentmill.stages.tarshard import read_shard

from latentmill.core.hashing import sha256_file


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


def _safetensors_member(tensor_bytes: int = 16, header: bytes | None = None) -> bytes:
    """A safetensors member: its 8-byte header length, the JSON header, the tensor bytes."""
    if header is None:
        header = json.dumps({"x": {"dtype": "U8", "shape": [tensor_bytes], "data_offsets": [0, tensor_bytes]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\x07" * tensor_bytes


def _awkward_samples() -> list[dict]:
    """Samples that exercise the tar writer's corners: member sizes at and around 512, an empty member, a
    key in a folder, a key with a dot (its members parse back under another key), safetensors members with
    a valid, a cut-off and a too-short header, buckets, a key written twice (not adjacent)."""
    return [
        {"__key__": "a000", "json": json.dumps({"bucket": [64, 32, 1]}).encode(), "txt": b"", "jpg": b"\xff" * 512},
        {"__key__": "dir/b001", "json": b'{"bucket": [8, 8, 1]}', "txt": b"x" * 513, "__meta": "not written"},
        {"__key__": "c.002", "json": b"{}", "latent.safetensors": _safetensors_member(40)},
        {"__key__": "d003", "json": b'{"bucket": "not a list"}', "vae.safetensors": _safetensors_member(3),
         "bad.safetensors": (10 ** 6).to_bytes(8, "little") + b"{}", "tiny.safetensors": b"1234"},
        {"__key__": "a000", "json": b'{"bucket": [16, 16, 1]}', "txt": b"again" * 300},
    ]


def _tarwriter_bytes(samples) -> bytes:
    """What webdataset.TarWriter writes for ``samples`` with the options the shard writer has always used."""
    import io

    from latentmill.stages import tarshard

    buf = io.BytesIO()
    writer = wds.TarWriter(buf, user=tarshard._TAR_USER, group=tarshard._TAR_USER, mtime=0, encoder=False,
                           compress=False)
    for sample in samples:
        writer.write(sample)
    writer.close()
    return buf.getvalue()


@pytest.mark.parametrize("names", ["plain", "pax"])
def test_shard_sink_writes_tarwriters_bytes_and_the_index_of_a_read_back(tmp_path, names):
    """The shard writer writes tars directly (not through webdataset's TarWriter and tarfile's stream) and
    builds the shard index from what it wrote: both must be byte for byte what TarWriter wrote and what
    ``index_tar`` reads back. ``pax``: names over 100 bytes and non-ASCII ones (pax headers)."""
    from latentmill.stages.shardindex import index_path, index_tar
    from latentmill.stages.shardio import ShardSink

    samples = _awkward_samples()
    if names == "pax":
        samples += [{"__key__": "long/" + "n" * 120, "json": b'{"bucket": [1, 2, 3]}', "txt": b"long"},
                    {"__key__": "caf\u00e9-\u4e2d", "json": b"{}", "txt": b"utf8"}]
    path = tmp_path / "s.tar"
    sink = ShardSink(path)
    for sample in samples:
        sink.write(sample)
    digest = sink.commit()
    expected = _tarwriter_bytes(samples)
    assert path.read_bytes() == expected
    assert digest == sha256_file(path)
    assert sink.count == len(samples)
    assert index_path(path).read_bytes() == index_tar(path)
    assert sink.index["sha256"] == sha256_file(index_path(path))


def test_shard_sink_refuses_what_tarwriter_refuses(tmp_path):
    from latentmill.stages.shardio import ShardSink

    sink = ShardSink(tmp_path / "s.tar")
    with pytest.raises(ValueError, match="__key__"):
        sink.write({"txt": b"x"})
    with pytest.raises(ValueError, match="txt doesn't map to a bytes"):
        sink.write({"__key__": "k", "txt": "a str"})
    sink.abort()
    assert not list(tmp_path.iterdir())


def test_tar_member_header_is_tarfiles(tmp_path):
    """The template-filled header of a plain member equals ``tarfile``'s for names and sizes at the edges."""
    import tarfile

    from latentmill.stages.tarshard import _tar_info, tar_member_header

    for name in ["a.b", "k" * 96 + ".txt", "x" * 100, "d/e/f.json", "k" * 101, "\u00e9.txt", ""]:
        for size in [0, 1, 511, 512, 513, 8 ** 11 - 1, 8 ** 11]:
            expected = _tar_info(name, size).tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
            assert tar_member_header(name, size) == expected, (name, size)


def _webdataset_samples(path) -> list[dict]:
    """The samples webdataset's own grouping (``group_by_keys``, extensions kept as written) makes of the
    regular files ``tarfile`` lists: the reference for the one walker and the one grouping rule."""
    import tarfile

    from webdataset.tariterators import group_by_keys

    with tarfile.open(path, "r") as tar:
        files = [{"fname": m.name, "data": tar.extractfile(m).read(), "__url__": "u"} for m in tar if m.isfile()]
    return [{k: v for k, v in s.items() if k != "__url__"} for s in group_by_keys(iter(files), lcase=False)]


def test_one_walker_and_one_rule_read_what_tarfile_and_webdataset_read(tmp_path):
    """``tar_members`` lists what ``tarfile`` lists (plain ustar headers parsed directly, a pax, GNU, truncated
    or damaged tar through tarfile) and ``read_shard`` groups it as webdataset does; a compressed tar is
    streamed under the same rule; an extension twice in one sample is refused, as webdataset refuses it."""
    import gzip
    import io
    import os
    import tarfile

    from latentmill.stages.tarshard import _ustar_members, index_shard, tar_members

    def fast_members(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            return _ustar_members(fd)
        finally:
            os.close(fd)

    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        if data is None:
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        else:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

    plain = tmp_path / "plain.tar"
    plain.write_bytes(_tarwriter_bytes(_awkward_samples()))
    pax = tmp_path / "pax.tar"
    pax.write_bytes(_tarwriter_bytes([{"__key__": "p" * 150, "txt": b"long name"}, {"__key__": "q", "txt": b"q"}]))
    mixed = tmp_path / "mixed.tar"  # a directory, extension-less and dot-first files, a file in the directory
    with tarfile.open(mixed, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [("sub/", None), ("README", b"no extension"), ("sub/.hidden.txt", b"dot first"),
                           ("sub/k1.txt", b"one"), ("sub/k1.json", b"{}"), ("k1.txt", b"other folder")]:
            add(tar, name, data)
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(plain.read_bytes()[:2048])
    damaged = tmp_path / "damaged.tar"
    data = bytearray(plain.read_bytes())
    data[4 * 512 + 10] ^= 0x20  # a name byte of the third member's header (a000.txt): its checksum fails
    damaged.write_bytes(bytes(data))

    assert fast_members(plain) is not None and fast_members(mixed) is not None
    for path in (pax, truncated, damaged):
        assert fast_members(path) is None, path.name
    for path in (plain, pax, mixed, truncated, damaged):  # tarfile stops at a cut or a bad header
        with tarfile.open(path, "r:") as tar:
            assert tar_members(path) == [(m.name, m.offset_data, m.size) for m in tar if m.isfile()], path.name
        assert list(read_shard(path)) == _webdataset_samples(path), path.name
        assert [(s["__key__"], sorted(s)) for s in read_shard(path)] == [
            (key, sorted(["__key__", *members])) for key, members in index_shard(path)]
    assert [s["__key__"] for s in read_shard(plain)] == ["a000", "dir/b001", "c", "d003", "a000"]
    assert [s["__key__"] for s in read_shard(mixed)] == ["sub/", "sub/k1", "k1"]  # webdataset's corner: "sub/"
    assert [s["__key__"] for s in read_shard(damaged)] == ["a000"]

    gz = tmp_path / "plain.tar.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert list(read_shard(gz)) == list(read_shard(plain))
    with pytest.raises(tarfile.ReadError):
        tar_members(gz)

    twice = tmp_path / "twice.tar"
    with tarfile.open(twice, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("k.txt", "k.json", "k.txt"):
            add(tar, name, b"x")
    with pytest.raises(ValueError, match="twice.tar: member 'k.txt' repeats extension 'txt' of sample 'k'"):
        list(read_shard(twice))
    with pytest.raises(ValueError, match="duplicate file name"):
        _webdataset_samples(twice)
