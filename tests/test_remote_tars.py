"""A work folder of an output on a store holds no tar until a reader opens one (latentmill.stages.remotetars),
on a real S3 server (moto's, tests/conftest.py ``s3_bucket``): units reused without their tars, a tar fetched
whole and checked where it is opened (in a worker process too), members read alone, a bad download never
used, and push neither sending nor losing a tar left on the store (docs/object-stores.md)."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from latentmill.pipelines import objectstore
from latentmill.stages import remotetars
from latentmill.stages.shardindex import index_tar, load_shard_index
from latentmill.stages.shardio import StageDir, WorkUnit
from latentmill.stages.tarshard import read_shard

from tests.helpers import store


def _samples(unit: str, count: int) -> list[dict]:
    return [{"__key__": f"{unit}-{i}", "json": json.dumps({"n": i}).encode(), "txt": f"{unit} {i} ".encode() * 300}
            for i in range(count)]


def _units_on_store(s3_bucket: str, tmp_path: Path) -> tuple[str, StageDir, dict[str, list[dict]]]:
    """Two committed caption units written by the stage code in a folder, published to the store: the
    output's URL, the folder's stage and each unit's samples."""
    src = StageDir(tmp_path / "src" / "prep" / "caption", "caption").ensure()
    written = {}
    for unit in ("unit-a", "unit-b"):
        written[unit] = _samples(unit, 3)

        def process(work, out, samples=written[unit]):
            for sample in samples:
                out.add(dict(sample))

        src.run_unit(WorkUnit(unit, [], {}, 3), process)
    url = f"s3://{s3_bucket}/out"
    assert objectstore.push(tmp_path / "src", url)["uploaded"] == 6  # 2 tars, 2 indexes, 2 records
    return url, src, written


def _tar(stage: StageDir, unit: str) -> Path:
    record = stage.load_record(unit)
    assert record is not None
    return stage.root / record.shards[0].path


def test_units_are_reused_without_their_tars_and_a_tar_is_fetched_when_a_reader_opens_it(s3_bucket, tmp_path):
    url, src, written = _units_on_store(s3_bucket, tmp_path)
    work = tmp_path / "work"
    pulled = objectstore.pull(url, work, tars=False, list_tars=True)
    assert pulled["downloaded"] == 4  # the records and indexes
    stage = StageDir(work / "prep" / "caption", "caption")
    tar_a, tar_b = _tar(stage, "unit-a"), _tar(stage, "unit-b")
    src_a, src_b = _tar(src, "unit-a"), _tar(src, "unit-b")
    assert not list(work.rglob("*.tar"))

    # reused: the record and the index are here, the tars on the store; the unit does not run
    def must_not_run(unit, out):
        raise AssertionError("a unit whose tars are on the store ran again")

    record = stage.run_unit(WorkUnit("unit-a", [], {}, 3), must_not_run)
    assert record.reused and record.samples_out == 3
    assert remotetars.held(tar_a) and not tar_a.exists()
    assert remotetars.tar_size(tar_b) == src_b.stat().st_size
    assert not remotetars.held(tar_a.with_name("caption-elsewhere-0.tar"))
    assert remotetars.fetched(work / "prep") == {"tars": 0, "tar_bytes": 0, "ranges": 0, "range_bytes": 0}

    # members read alone: one ranged request each, the tar stays on the store
    index = load_shard_index(tar_b)
    places = [index.members(i)["json"] for i in range(index.num_samples)]
    assert remotetars.read_ranges(tar_b, places) == [s["json"] for s in written["unit-b"]]
    assert not tar_b.exists()

    # a leftover of a killed download is never read: the reader downloads the tar whole, checks it, renames it
    leftover = tar_a.with_name(tar_a.name + ".1234-5678" + remotetars.PULLING)
    leftover.write_bytes(b"half a tar")
    assert list(read_shard(tar_a)) == written["unit-a"]
    assert tar_a.read_bytes() == src_a.read_bytes()
    assert leftover.read_bytes() == b"half a tar"  # not ours: left as it is, never opened
    read = remotetars.fetched(work / "prep")
    assert read == {"tars": 1, "tar_bytes": src_a.stat().st_size, "ranges": 3,
                    "range_bytes": sum(len(s["json"]) for s in written["unit-b"])}

    # a worker process (runner.kind: processes) finds the list by the tar's path and fetches the same way
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(index_tar, tar_b).result() == index_tar(src_b)
    assert tar_b.read_bytes() == src_b.read_bytes()
    assert remotetars.fetched(work / "prep")["tars"] == 2
    assert not [p for p in work.rglob("*" + remotetars.PULLING) if p != leftover]


def test_a_download_that_differs_from_the_store_listing_is_never_used(s3_bucket, tmp_path):
    url, _, _ = _units_on_store(s3_bucket, tmp_path)
    work = tmp_path / "work"
    objectstore.pull(url, work, tars=False, list_tars=True)
    stage = StageDir(work / "prep" / "caption", "caption")
    tar = _tar(stage, "unit-a")
    listing = json.loads((work / "prep" / remotetars.LIST_FILE).read_text())
    rel = f"caption/shards/{tar.name}"
    assert listing["url"] == url and listing["tars"][rel]["md5"]  # moto gives single-part uploads' MD5
    listing["tars"][rel]["md5"] = "0" * 32
    (work / "prep" / remotetars.LIST_FILE).write_text(json.dumps(listing))
    with pytest.raises(OSError, match="MD5 differs from the store's"):
        remotetars.local_tar(tar)
    listing["tars"][rel]["size"] += 1
    (work / "prep" / remotetars.LIST_FILE).write_text(json.dumps(listing))
    with pytest.raises(OSError, match=r"downloaded \d+ bytes, the store listed \d+"):
        list(read_shard(tar))
    assert not tar.exists() and not list(work.rglob("*" + remotetars.PULLING))
    assert remotetars.fetched(work / "prep")["tars"] == 0


def test_push_leaves_tars_on_the_store_alone_and_never_publishes_a_snapshot_whose_tars_are_nowhere(s3_bucket,
                                                                                                  tmp_path):
    url, src, _ = _units_on_store(s3_bucket, tmp_path)
    fs, root = store("s3"), f"{s3_bucket}/out"
    work = tmp_path / "work"
    objectstore.pull(url, work, tars=False, list_tars=True)
    before = {path: info["size"] for path, info in fs.find(root, detail=True).items()}
    assert objectstore.push(work, url) == {"uploaded": 0, "bytes": 0}  # absent here: neither changed nor gone
    assert {path: info["size"] for path, info in fs.find(root, detail=True).items()} == before

    # a snapshot of the store's tar is published; one naming a tar that is nowhere is refused, nothing sent
    record = src.load_record("unit-a")
    shard = {"name": record.shards[0].name, "path": f"../../prep/caption/{record.shards[0].path}",
             "index": record.shards[0].index}
    for name, shards in (("0001-aaaa", [shard]), ("0002-bbbb", [shard, {**shard, "name": "gone.tar",
                                                                        "path": "../../prep/caption/shards/gone.tar",
                                                                        "index": None}])):
        (work / "snapshots" / name).mkdir(parents=True)
        (work / "snapshots" / name / "manifest.json").write_text(json.dumps({"shards": shards}))
        (work / "snapshots" / "LATEST").write_text(name + "\n")
        if name == "0001-aaaa":
            assert objectstore.push(work, url)["uploaded"] == 2
            continue
        with pytest.raises(RuntimeError, match=r"prep/caption/shards/gone.tar: a shard of the snapshot to publish is "
                                               r"neither in the work folder .* nor on the store; nothing was published"):
            objectstore.push(work, url)
    assert fs.cat_file(f"{root}/snapshots/LATEST") == b"0001-aaaa\n"
    assert not fs.exists(f"{root}/snapshots/0002-bbbb/manifest.json")


_READ = "import sys\nfrom latentmill.stages.tarshard import read_shard\nprint(len(list(read_shard(sys.argv[1]))))\n"


def test_a_reader_killed_while_it_fetches_a_tar_leaves_nothing_a_reader_uses(s3_bucket, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    url, src, written = _units_on_store(s3_bucket, tmp_path)
    work = tmp_path / "work"
    objectstore.pull(url, work, tars=False, list_tars=True)
    tar = _tar(StageDir(work / "prep" / "caption", "caption"), "unit-a")
    log = tmp_path / "reader.log"
    repo = Path(__file__).resolve().parents[1]
    reader = subprocess.Popen([sys.executable, "-c", _READ, str(tar)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(repo), remotetars.PAUSE_ENV: "1"})
    deadline = time.monotonic() + 60
    while "fetch: paused after 1 downloads" not in log.read_text():  # downloaded, not yet checked nor renamed
        assert reader.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    reader.send_signal(signal.SIGKILL)
    reader.wait(timeout=30)
    (partial,) = tar.parent.glob(f"{tar.name}.{reader.pid}-*{remotetars.PULLING}")
    assert not tar.exists() and remotetars.held(tar)
    assert remotetars.fetched(work / "prep")["tars"] == 0
    assert list(read_shard(tar)) == written["unit-a"]  # fetched again, whole
    assert tar.read_bytes() == _tar(src, "unit-a").read_bytes() and partial.exists()
    assert remotetars.fetched(work / "prep")["tars"] == 1


def test_an_older_listing_never_replaces_a_newer_one(tmp_path):
    """Two pulls of one work folder (a training's beside a gc's): the one that listed the store last wins, whichever
    finishes last, so a tar uploaded between the two listings is never missing from the list."""
    prep = tmp_path / "prep"
    entry = {"size": 10, "md5": ""}
    assert remotetars.write_list(prep, "s3://b/out", {"cache/shards/cache-a-0.tar": entry}, listed_at=2.0)
    assert not remotetars.write_list(prep, "s3://b/out", {}, listed_at=1.0)
    assert remotetars.held(prep / "cache" / "shards" / "cache-a-0.tar")
    assert remotetars.listed(prep / "cache" / "shards") == [prep / "cache" / "shards" / "cache-a-0.tar"]
    remotetars.forget([prep / "cache" / "shards" / "cache-a-0.tar"])  # a gc dropped it
    assert not remotetars.held(prep / "cache" / "shards" / "cache-a-0.tar")
    assert remotetars.write_list(prep, "s3://b/out", {"cache/shards/cache-b-0.tar": entry}, listed_at=3.0)
    assert remotetars.tar_size(prep / "cache" / "shards" / "cache-b-0.tar") == 10
