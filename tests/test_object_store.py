"""An output_dir on an S3-compatible store, against a real S3 server (moto's, tests/conftest.py ``s3_server``):
the start-up check, the writer lease, publishing order and copies (docs/object-stores.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import fsspec
import pytest
from latentmill.pipelines import objectstore, storeruns
from latentmill.pipelines.flows import Launch, run_train
from latentmill.pipelines.retention import OutputBusyError

from latentmill.cli import main
from latentmill.core.store import work_dir_for
from latentmill.recipe import load_recipe
from tests.helpers import store

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def _prep_fails_before_work(url: str, tmp_path: Path, monkeypatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)
    assert main(["prep", str(DEMO_CONFIG), f"output_dir={url}", "model.pretrained=/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "work").exists() and os.listdir(tmp_path) in ([], ["work"])  # nothing written here
    return err


def test_an_unreachable_endpoint_fails_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "work"))
    err = _prep_fails_before_work("s3://some-bucket/out", tmp_path, monkeypatch, capsys)
    assert err.startswith("latentmill: error: output_dir: s3://some-bucket/out: cannot reach the store "
                          f"(endpoint http://127.0.0.1:{port}): EndpointConnectionError"), err
    assert "check AWS_ENDPOINT_URL" in err


def test_a_missing_bucket_fails_in_one_line_before_any_work(s3_bucket, tmp_path, monkeypatch, capsys):
    err = _prep_fails_before_work(f"s3://{s3_bucket}-absent/out", tmp_path, monkeypatch, capsys)
    assert err == (f"latentmill: error: output_dir: s3://{s3_bucket}-absent/out: the bucket '{s3_bucket}-absent' "
                   f"does not exist on the store; create it first (e.g. `aws s3 mb s3://{s3_bucket}-absent`)")


def test_credentials_in_the_url_are_refused(tmp_path, monkeypatch, capsys):
    err = _prep_fails_before_work("s3://AKIA:secret@bucket/out", tmp_path, monkeypatch, capsys)
    assert "output_dir: the URL holds credentials; give them through the environment" in err
    assert "secret" not in err.split("credentials", 1)[1].split("(", 1)[0]


def test_one_writer_holds_the_lease_and_a_second_is_refused_naming_it(s3_bucket, capsys):
    url = f"s3://{s3_bucket}/out"
    with objectstore.store_lease(url, "prep", lease_s=30):
        with pytest.raises(OutputBusyError, match=rf"^{url} is busy: a prep is writing it \(PID {os.getpid()} on "):
            with objectstore.store_lease(url, "gc", on_busy="fail"):
                pass
        with pytest.raises(OutputBusyError, match="a prep is writing it"):
            objectstore.check_not_busy(url)
    objectstore.check_not_busy(url)  # released
    with objectstore.store_lease(url, "gc", on_busy="fail") as lease:
        data, _ = lease.read()
        assert ": gc since " in data["holder"] and data["expires"] > time.time()
    assert "taking over" not in capsys.readouterr().out  # a released lease is free, not left behind


def test_a_lease_is_renewed_while_held_and_taken_over_once_its_holder_stops(s3_bucket, capsys):
    url = f"s3://{s3_bucket}/out"
    with objectstore.store_lease(url, "prep", lease_s=1.5) as held:
        first_etag, (first, taken) = held.etag, (held.read()[0][k] for k in ("expires", "holder"))
        deadline = time.monotonic() + 60
        time.sleep(1.1)  # the next second: a renewal's holder line would say so
        while held.etag == first_etag and time.monotonic() < deadline:  # renewed every lease_s / 3
            time.sleep(0.1)
        assert held.read()[0]["expires"] > first and held.lost is None
        assert held.read()[0]["holder"] == taken  # "since" is when it was taken, not the last renewal
        # another writer overwrites it (a clock far ahead saw it expired): the next renewal fails, and this
        # writer publishes no snapshot
        other = "PID 1 on elsewhere: prep since 2026-12-02T00:00:00Z"
        store("s3").pipe_file(held.path, json.dumps({"holder": other, "expires": time.time() + 60}).encode())
        while held.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held.lost.endswith(f"now held by {other}")
        with pytest.raises(objectstore.LostLease, match="nothing more was published by this writer"):
            held.check()
    assert held.read()[0]["holder"] == other  # not released by the writer that lost it
    assert objectstore.StoreLease(url, "gc").try_acquire() == other  # live until its lease runs out
    before = held.read()[1]
    store("s3").pipe_file(held.path, json.dumps({"holder": other, "expires": time.time() - 1}).encode())
    taker = objectstore.StoreLease(url, "prep", lease_s=30)  # ... which it now has: its holder died
    assert taker.try_acquire() is None
    assert f"taking over the writer lease of {url} left by {other} (its lease ran out)" in capsys.readouterr().out
    assert taker.read()[0]["holder"].startswith(f"PID {os.getpid()} on ")
    with pytest.raises(OSError):  # a write conditional on an older version fails
        taker._write(time.time() + 30, before)


@pytest.fixture(params=["gs", "az"])
def other_store(request) -> tuple[str, str]:
    """A new bucket on the GCS or the Azure test server (the lease's other conditional writes): scheme, name."""
    return request.param, request.getfixturevalue({"gs": "gcs_bucket", "az": "azure_bucket"}[request.param])


def test_a_lease_on_gcs_or_azure_whose_holder_stopped_renewing_is_taken_over_and_the_old_holder_lost_it(
        other_store, capsys):
    """The S3 test above on the stores whose conditional write differs (GCS's generation, Azure's etag)."""
    scheme, bucket = other_store
    url = f"{scheme}://{bucket}/out"
    first = objectstore.StoreLease(url, "prep", lease_s=1.0)
    assert first.try_acquire() is None  # and never renewed: its process stopped
    holder = first.read()[0]["holder"]
    second = objectstore.StoreLease(url, "gc", lease_s=30)
    assert second.try_acquire() == holder  # live until its lease runs out
    time.sleep(max(0.0, first.read()[0]["expires"] - time.time()) + 0.1)
    assert second.try_acquire() is None
    assert f"gc: taking over the writer lease of {url} left by {holder} (its lease ran out)" in capsys.readouterr().out
    data, version = second.read()
    assert ": gc since " in data["holder"] and version == second.etag != first.etag
    with pytest.raises(FileExistsError):  # a renewal with the stale version is refused by the store
        first.put(b"{}", first.etag)
    with pytest.raises(FileExistsError):  # and so is a create over the held lease
        first.put(b"{}", None)
    first.start()  # its renewer finds the lease lost at the first renewal, and names the new holder
    deadline = time.monotonic() + 30
    while first.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.lost == f"the writer lease of {url} was lost (FileExistsError); now held by {data['holder']}"
    with pytest.raises(objectstore.LostLease, match="nothing more was published by this writer"):
        first.check()
    first.release()
    assert second.read() == (data, version)  # not released by the writer that lost it
    second.release()
    assert second.read()[0] == {"holder": "", "expires": 0}
    store(scheme).rm_file(second.path)
    with pytest.raises(FileExistsError):  # a write conditional on the version of an object that went: refused too
        second.put(b"{}", version)


def test_a_lease_refuses_a_store_without_conditional_writes(capsys):
    from latentmill.core.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        objectstore.StoreLease("memory://bucket/out", "prep")
    assert str(refused.value) == (
        "output_dir: memory://bucket/out: the writer lease needs conditional writes (If-None-Match and If-Match, "
        "or GCS's ifGenerationMatch): s3://, gs:// and az:// have them")
    with objectstore.training_lease("memory://bucket/out") as lease:
        assert lease is None
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and out.startswith("train: a second training of memory://bucket/out would not "
                                                         "be refused: its lease needs conditional writes")


def test_publishing_order_puts_parts_before_records_before_manifests_before_the_pointer():
    order = ["prep/cache/shards/cache-0123-0.tar", "prep/cache/shards/cache-0123-0.idx",
             "prep/cache/shards/cache-0123-detail.json", "prep/cache/units/0123.json", "prep/cache/manifest.json",
             "prep/cache/quarantine.jsonl", "prep/scores.parquet", "snapshots/0001-abc/manifest.json",
             "snapshots/LATEST"]
    assert [objectstore.phase(rel) for rel in order] == [0, 0, 0, 1, 2, 2, 2, 3, 4]
    local = ["prep/catalog.sqlite", "prep/catalog.sqlite-wal", "prep/ingest/file-hashes.sqlite",
             "prep/last-run.json", ".writer.lock", "pins/0001-abc.pin", "prep/cache/shards/.x.tar.123.tmp",
             "train/runs/r/metrics.jsonl"]
    assert [objectstore.shared(rel) for rel in order + local] == [True] * len(order) + [False] * len(local)


def test_push_then_pull_copies_the_shared_files_and_skips_what_is_there(s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/out"
    work = tmp_path / "a"
    files = {"prep/cache/shards/cache-01-0.tar": b"t" * 3000, "prep/cache/units/01.json": b'{"u": 1}',
             "prep/cache/manifest.json": b'{"m": 1}', "snapshots/0001-x/manifest.json": b'{"s": 1}',
             "snapshots/LATEST": b"0001-x\n", "prep/catalog.sqlite": b"local only", "prep/last-run.json": b"{}"}
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)
    assert objectstore.push(work, url) == {"uploaded": 5, "bytes": 3000 + 8 + 8 + 8 + 7}
    assert objectstore.push(work, url)["uploaded"] == 0  # everything there already
    (work / "prep/cache/manifest.json").write_bytes(b'{"m": 2}')  # same size, new bytes: found by its ETag
    assert objectstore.push(work, url)["uploaded"] == 1
    fresh = tmp_path / "b"
    pulled = objectstore.pull(url, fresh)
    assert (pulled["downloaded"], pulled["bytes"]) == (5, 3031)
    got = {p.relative_to(fresh).as_posix(): p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
    assert got == {rel: (b'{"m": 2}' if rel.endswith("cache/manifest.json") else data)
                   for rel, data in files.items() if objectstore.shared(rel)}
    assert objectstore.pull(url, fresh)["downloaded"] == 0
    fs = store("s3")
    for rel in got:  # a downloaded file carries its object's time on the store: gc orders units by it
        stamp = fs.info(f"{s3_bucket}/out/{rel}")["LastModified"].timestamp()
        assert abs((fresh / rel).stat().st_mtime - stamp) < 1e-3, rel
    assert json.loads(fs.cat_file(f"{s3_bucket}/out/prep/cache/manifest.json")) == {"m": 2}
    assert not fs.exists(f"{s3_bucket}/out/prep/catalog.sqlite")


def test_what_another_writer_deleted_is_gone_for_the_next_listing(s3_bucket):
    """A pin deleted by another process: the listing this process made before does not bring it back (no
    cached listing: ``store_fs``)."""
    url = f"s3://{s3_bucket}/out"
    pin = f"{s3_bucket}/out/pins/0001-x.pin"
    store("s3").pipe_file(pin, json.dumps({"snapshot": "0001-x"}).encode())
    assert list(objectstore.store_pins(url)) == ["0001-x"]
    fsspec.filesystem("s3", skip_instance_cache=True).rm_file(pin)  # another process's client
    assert objectstore.store_pins(url) == {}
    assert objectstore.unpin_store(url, "0001-x") is False  # not pinned any more: nothing to remove


def test_a_training_run_is_published_checkpoint_parts_first_and_pruned_checkpoints_deleted(s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/out"
    work = tmp_path / "w"
    run = work / "train" / "runs" / "r1"
    step2 = run / "checkpoints" / "step-000002"
    step2.mkdir(parents=True)
    (step2 / "model.safetensors").write_bytes(b"weights")
    (step2 / "trainer_state.json").write_text("{}")
    (run / "checkpoints" / "step-000004.tmp").mkdir()
    (run / "checkpoints" / "step-000004.tmp" / "model.safetensors").write_bytes(b"being written")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (work / "train" / "LATEST").write_text("r1\n")
    (work / "train" / "metrics.jsonl").symlink_to(run / "metrics.jsonl")
    fs = store("s3")
    fs.ls(s3_bucket)
    sent: list[str] = []
    record = lambda request, **_: sent.append(request.url.split(f"/{s3_bucket}/out/", 1)[-1].split("?")[0])  # noqa: E731
    fs.s3.meta.events.register("before-send.s3.PutObject", record)
    with storeruns.RunPublisher(work, url, every_s=3600) as publisher:
        assert publisher.publish() == 4 and publisher.publish() == 0
    prefix = "train/runs/r1/"
    assert sent == [prefix + "checkpoints/step-000002/model.safetensors",
                    prefix + "checkpoints/step-000002/trainer_state.json", prefix + "metrics.jsonl", "train/LATEST"]
    # the next checkpoint, and the older one pruned: deleted from the store too; a grown metrics file again
    os.rename(run / "checkpoints" / "step-000004.tmp", run / "checkpoints" / "step-000004")
    (run / "checkpoints" / "step-000004" / "trainer_state.json").write_text("{}")
    for path in step2.iterdir():
        path.unlink()
    step2.rmdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with storeruns.RunPublisher(work, url, every_s=3600):  # knows what the store holds
        pass
    assert sorted(fs.find(f"{s3_bucket}/out")) == [f"{s3_bucket}/out/{rel}" for rel in (
        "train/LATEST", prefix + "checkpoints/step-000004/model.safetensors",
        prefix + "checkpoints/step-000004/trainer_state.json", prefix + "metrics.jsonl")]
    assert fs.cat_file(f"{s3_bucket}/out/{prefix}metrics.jsonl") == b'{"step": 1}\n{"step": 2}\n'
    # a fresh machine pulls the runs back; what it holds already stays its own
    fresh = tmp_path / "fresh"
    (fresh / "train").mkdir(parents=True)
    (fresh / "train" / "LATEST").write_text("mine\n")
    assert storeruns.pull_runs(url, fresh)["downloaded"] == 3
    assert (fresh / prefix / "checkpoints" / "step-000004" / "model.safetensors").read_bytes() == b"being written"
    assert (fresh / "train" / "LATEST").read_text() == "mine\n"


def test_a_running_prep_publishes_each_committed_unit_parts_first(s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/out"
    work = tmp_path / "w"
    stage = work / "prep" / "cache"
    (stage / "shards").mkdir(parents=True)
    (stage / "units").mkdir()
    (stage / "shards" / "cache-01-0.tar").write_bytes(b"tar")
    (stage / "shards" / "cache-01-0.idx").write_bytes(b"idx")
    (stage / "shards" / "cache-01-detail.json").write_bytes(b"{}")
    (stage / "shards" / "cache-01-scores.parquet").write_bytes(b"a file of the unit its record does not name")
    (stage / "shards" / "cache-02-0.tar.tmp").write_bytes(b"a unit being written")
    (stage / "shards" / "cache-02-detail.json").write_bytes(b"{}")
    record = {"stage": "cache", "unit_id": "01", "extra": {"detail": "shards/cache-01-detail.json"},
              "shards": [{"path": "shards/cache-01-0.tar", "index": {"name": "cache-01-0.idx"}}]}
    (stage / "units" / "01.json").write_text(json.dumps(record))
    fs = store("s3")
    with objectstore.UnitPublisher(work, url, every_s=3600) as publisher:
        assert publisher.publish() == 1 and publisher.publish() == 0  # published once
    assert sorted(fs.find(f"{s3_bucket}/out")) == [f"{s3_bucket}/out/prep/cache/{rel}" for rel in (
        "shards/cache-01-0.idx", "shards/cache-01-0.tar", "shards/cache-01-detail.json",
        "shards/cache-01-scores.parquet", "units/01.json")]
    (stage / "units" / "02.json").write_text(json.dumps({"stage": "cache", "unit_id": "02", "shards": []}))
    with objectstore.UnitPublisher(work, url, every_s=3600) as publisher:  # knows 01 from the store
        pass
    assert publisher.published == 1 and fs.exists(f"{s3_bucket}/out/prep/cache/units/02.json")
    assert fs.exists(f"{s3_bucket}/out/prep/cache/shards/cache-02-detail.json")


_HOLD_TRAINING = """
import sys, time
from latentmill.pipelines.objectstore import training_lease
with training_lease(sys.argv[1], lease_s=float(sys.argv[2])):
    print("training", flush=True)
    time.sleep(3600)
"""


def test_a_second_training_of_a_store_output_is_refused_until_the_first_dies_and_its_lease_runs_out(
        s3_bucket, tmp_path, capsys):
    """Two trainings would prune, set aside and overwrite each other's checkpoints on the store: while one holds
    the training lease (a process, SIGKILLed later), a second is refused in one line naming it, before it pulls
    anything; once the dead holder's lease ran out, the next training takes it over."""
    url = f"s3://{s3_bucket}/out"
    lease_s = 1.5
    log = tmp_path / "holder.log"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_TRAINING, url, str(lease_s)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={url}"])
    fs = store("s3")
    lock = f"{s3_bucket}/out/{objectstore.TRAIN_LOCK}"
    try:
        deadline = time.monotonic() + 120
        while "training" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        with pytest.raises(OutputBusyError) as refused:
            run_train(recipe)
        assert str(refused.value) == (
            f"{url} is busy: a training is writing it ({json.loads(fs.cat_file(lock))['holder']}; lease "
            f"{url}/{objectstore.TRAIN_LOCK}). Wait for it to finish, or train into another output_dir")
        assert f"PID {proc.pid} on " in str(refused.value)
        assert not work_dir_for(url).exists()  # refused before pulling anything or choosing a run folder
    finally:
        proc.kill()
        proc.wait(timeout=30)
    time.sleep(max(0.0, json.loads(fs.cat_file(lock))["expires"] - time.time()) + 0.1)  # its lease runs out
    capsys.readouterr()
    with pytest.raises(FileNotFoundError, match="no snapshot published"):  # past the lease, to the missing prep
        run_train(recipe)
    assert f"training: taking over the lease {objectstore.TRAIN_LOCK} of {url} left by PID {proc.pid} on " in \
        capsys.readouterr().out
    assert not fs.exists(lock)  # released when that training ended


def test_a_training_that_lost_its_lease_publishes_nothing_more(s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/out"
    work = tmp_path / "work"
    (work / "train" / "runs" / "r").mkdir(parents=True)
    (work / "train" / "runs" / "r" / "run.json").write_text("{}")
    fs = store("s3")
    with pytest.raises(objectstore.LostLease, match=f"the lease {objectstore.TRAIN_LOCK} of {url} was lost"):
        with objectstore.training_lease(url, lease_s=0.6) as lease:
            with storeruns.RunPublisher(work, url, every_s=3600, lease=lease) as publisher:
                assert publisher.publish() == 1
                other = "PID 1 on elsewhere: training since 2026-12-02T00:00:00Z"  # took it over: a clock ahead
                fs.pipe_file(lease.path, json.dumps({"holder": other, "expires": time.time() + 60}).encode())
                (work / "train" / "runs" / "r" / "run.json").write_text('{"step": 1}')
                deadline = time.monotonic() + 30
                while lease.lost is None and time.monotonic() < deadline:
                    time.sleep(0.05)
    assert json.loads(fs.cat_file(f"{s3_bucket}/out/train/runs/r/run.json")) == {}  # the change stayed local
    assert json.loads(fs.cat_file(lease.path))["holder"] == other  # not released by the run that lost it


def _two_rank_dcp(folder: Path) -> None:
    """A DCP folder whose ``.metadata`` names a shard of rank 0 (written here) and one of rank 1 (not here:
    another node's), as a 2-rank FSDP2 save on two nodes leaves in the folder of rank 0's node."""
    import dataclasses
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    with warnings.catch_warnings():  # one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": {"a": torch.ones(2), "b": torch.zeros(2)}}, checkpoint_id=folder)
    metadata = FileSystemReader(str(folder)).read_metadata()
    index = next(index for index in metadata.storage_data if index.fqn == "model.b")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="__1_0.distcp")
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))  # DCP's own format (FileSystemWriter.finish)


def test_a_checkpoint_of_several_nodes_is_published_whole_and_run_files_only_by_rank_0s_node(s3_bucket, tmp_path):
    """Two nodes' work folders of one run: the checkpoint's trainer_state.json waits until every rank's RNG file
    and every shard its DCP metadata names are on the store, whichever node publishes them; the node without
    global rank 0's mark publishes its ranks' parts only (no run file, no trainer_state.json, no deletion); a
    pruned checkpoint is deleted by rank 0's node as a whole folder, the other node's parts with it."""
    url = f"s3://{s3_bucket}/out"
    fs = store("s3")
    prefix, ckpt = "train/runs/r1", "train/runs/r1/checkpoints/step-000002"
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for node in (node0, node1):  # both flow processes planned the run: run.json and LATEST in both
        (node / prefix / "checkpoints").mkdir(parents=True)
        (node / prefix / "run.json").write_text(json.dumps({"node": node.name}))
        (node / "train" / "LATEST").write_text("r1\n")
    _two_rank_dcp(node0 / ckpt / "dcp")
    (node0 / ckpt / "rng-rank0.safetensors").write_bytes(b"rng0")
    (node0 / ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "world_size": 2}))
    (node1 / ckpt / "dcp").mkdir(parents=True)
    (node1 / ckpt / "dcp" / "__1_0.distcp").write_bytes(b"rank 1's shard")
    (node1 / ckpt / "rng-rank1.safetensors").write_bytes(b"rng1")
    on_store = lambda: sorted(p.split("/out/", 1)[1] for p in fs.find(f"{s3_bucket}/out"))  # noqa: E731

    first = storeruns.RunPublisher(node0, url, every_s=3600, run_dir=node0 / prefix, hold_s=30)
    second = storeruns.RunPublisher(node1, url, every_s=3600, run_dir=node1 / prefix, hold_s=30)
    with first, second:
        (node0 / prefix / storeruns.RANK0_MARKER).touch()  # global rank 0 trains on node 0 (pipelines.launch)
        assert first.main and not second.main
        first.publish()
        assert first.held == [f"{ckpt}/trainer_state.json"]  # rank 1's shard and RNG state are not there yet
        assert on_store() == ["train/LATEST", f"{ckpt}/dcp/.metadata", f"{ckpt}/dcp/__0_0.distcp",
                              f"{ckpt}/rng-rank0.safetensors", f"{prefix}/run.json"]
        assert second.publish() == 2  # its ranks' parts, not its run.json or LATEST
        assert json.loads(fs.cat_file(f"{s3_bucket}/out/{prefix}/run.json")) == {"node": "node0"}
        first.publish()
        assert first.held == [] and fs.exists(f"{s3_bucket}/out/{ckpt}/trainer_state.json")
        # node 0 prunes the checkpoint (keep_latest_k), node 1 too: the whole folder goes, by node 0 only
        shutil.rmtree(node1 / ckpt)
        second.publish()
        assert fs.exists(f"{s3_bucket}/out/{ckpt}/dcp/__1_0.distcp")
        shutil.rmtree(node0 / ckpt)
        first.publish()
        assert on_store() == ["train/LATEST", f"{prefix}/run.json"]
        # a round of node 1 that listed its parts before it pruned them uploads them late: node 0's next rounds
        # delete them again (for hold_s seconds after the pruning)
        fs.pipe_file(f"{s3_bucket}/out/{ckpt}/rng-rank1.safetensors", b"rng1")
        first.publish()
        assert on_store() == ["train/LATEST", f"{prefix}/run.json"]
        (node0 / prefix / "checkpoints" / "step-000004").mkdir()
        (node0 / prefix / "checkpoints" / "step-000004" / "trainer_state.json").write_text('{"world_size": 2}')
        first.hold_s = 0.2  # its last round waits that long for the parts of node 1 that never come
    assert first.held == [f"{prefix}/checkpoints/step-000004/trainer_state.json"]  # rng-rank1 never came
    assert not fs.exists(f"{s3_bucket}/out/{prefix}/checkpoints/step-000004/trainer_state.json")
    assert storeruns.RANK0_MARKER not in " ".join(on_store())


def test_the_nodes_of_one_rendezvous_join_its_training_lease_and_take_the_holders_run_folder(s3_bucket):
    """The first node holds the lease, naming the rendezvous; a node of the same rendezvous joins it and waits for
    the run folder the holder records; a training of another rendezvous, or of none, is refused in one line."""
    url = f"s3://{s3_bucket}/out"
    rendezvous = "127.0.0.1:29400/job-1"
    with objectstore.training_lease(url, lease_s=30, rendezvous=rendezvous) as lease:
        assert not lease.joined
        for other in ("127.0.0.1:29400/job-2", None):
            with pytest.raises(OutputBusyError, match=rf"^{url} is busy: a training is writing it \(PID "
                               rf"{os.getpid()} on .*: training of rendezvous {rendezvous} since "):
                with objectstore.training_lease(url, rendezvous=other):
                    pass
        with objectstore.training_lease(url, rendezvous=rendezvous) as joined:
            assert joined.joined
            later = threading.Timer(0.3, lambda: lease.record(run="abc123", done=False))
            later.start()
            started = time.monotonic()
            chosen = joined.recorded("run", poll_s=0.05, wait_s=30)
            assert chosen["run"] == "abc123" and chosen["done"] is False and time.monotonic() - started >= 0.25
            later.join()
        assert lease.read()[0]["run"] == "abc123"  # a joiner leaves the lease to its holder
        time.sleep(0.2)
    assert not store("s3").exists(lease.path)  # released by its holder
    with objectstore.training_lease(url, rendezvous="127.0.0.1:29400/job-2") as alone:  # free again
        assert not alone.joined
        with pytest.raises(OutputBusyError, match="recorded no run in 0 s"):  # a holder that records nothing
            with objectstore.training_lease(url, rendezvous="127.0.0.1:29400/job-2") as joined:
                joined.recorded("run", poll_s=0.01, wait_s=0)


def test_a_joining_node_takes_the_run_folder_the_lease_holder_chose(s3_bucket):
    """A node of a training on several nodes trains into the run folder the lease holder recorded, not one of its
    own plan (nodes that start at different times could choose differently): here a folder its own plan would
    never name, recorded as a finished run, so the joining node stops there, as its holder did."""
    url = f"s3://{s3_bucket}/out"
    fs = store("s3")
    fs.pipe_file(f"{s3_bucket}/out/snapshots/LATEST", b"0001-s\n")
    fs.pipe_file(f"{s3_bucket}/out/snapshots/0001-s/manifest.json", b"{}")
    launch = Launch(nproc=1, nnodes=2, rdzv_endpoint="127.0.0.1:29400")
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={url}", "parallel.strategy=ddp"])
    with objectstore.training_lease(url, rendezvous=launch.rendezvous) as lease:  # the first node
        lease.record(run="0123-chosen", done=True)
        result = run_train(recipe, launch)
    folder = work_dir_for(url) / "train" / "runs" / "0123-chosen"
    assert result == {"already_trained": True, "run_dir": str(folder)}
    assert (folder.parent.parent / "LATEST").read_text() == "0123-chosen\n" and (folder / "run.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == ["0123-chosen"]


def test_a_cluster_launch_trains_on_a_store_under_its_training_lease(s3_bucket, tmp_path, capsys):
    """``deploy/launch.sh``'s node step (``python -m latentmill.pipelines.runs``) on an object store passes where
    ``latentmill train`` does (``runs.training_run``): refused in one line while another training holds the
    store's lease; else it plans the run in the work folder under the lease, runs torchrun's command with that
    folder and publishes the run."""
    from latentmill.pipelines.runs import main as launch_node

    url = f"s3://{s3_bucket}/out"
    fs = store("s3")
    fs.pipe_file(f"{s3_bucket}/out/snapshots/LATEST", b"0001-s\n")
    fs.pipe_file(f"{s3_bucket}/out/snapshots/0001-s/manifest.json", b"{}")
    recipe_json = tmp_path / "recipe.json"
    recipe_json.write_text(json.dumps(load_recipe(DEMO_CONFIG, [f"output_dir={url}", "parallel.strategy=ddp"]).to_dict()))
    ran = tmp_path / "ran"
    # torchrun's part: global rank 0 marks its node's run folder (pipelines.launch), so this node publishes the run
    command = ["--", sys.executable, "-c", f"import sys; open({str(ran)!r}, 'w').write(sys.argv[1]); "
               f"open(sys.argv[1] + '/{storeruns.RANK0_MARKER}', 'w')"]
    with objectstore.training_lease(url, lease_s=30) as other:
        assert launch_node([str(recipe_json), "2", "", *command]) == 2
        assert capsys.readouterr().err.startswith(f"{url} is busy: a training is writing it (")
        assert not ran.exists()
    assert not fs.exists(other.path)
    rendezvous = "127.0.0.1:29400/job-1"
    assert launch_node([str(recipe_json), "4", rendezvous, *command]) == 0
    run = Path(ran.read_text())
    assert run.parent == work_dir_for(url) / "train" / "runs"
    published = json.loads(fs.cat_file(f"{s3_bucket}/out/train/runs/{run.name}/run.json"))
    assert published["snapshot"] == "0001-s" and fs.cat_file(f"{s3_bucket}/out/train/LATEST") == f"{run.name}\n".encode()
    assert not fs.exists(other.path)  # the lease went with the launch
