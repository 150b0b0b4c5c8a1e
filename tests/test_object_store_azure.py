"""An output on Azure Blob Storage (``az://``), against a real Azure Blob server (Azurite, tests/conftest.py
``azure_server``): the same lease as on S3, written with Azure's If-None-Match and If-Match (docs/object-stores.md),
push and pull, the demo prep published there, no credential written anywhere."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import fsspec
import pytest
from latentmill.pipelines import objectstore
from latentmill.pipelines.retention import OutputBusyError

from latentmill.core.store import store_fs
from tests.conftest import AZURE_KEY
from tests.helpers import store


def _written_anywhere(container: str, *folders: Path) -> list[str]:
    """The objects of ``container`` and the files below ``folders`` that hold the account key or the connection
    string."""
    secrets = [AZURE_KEY.encode(), os.environ["AZURE_STORAGE_CONNECTION_STRING"].encode()]
    objects = [o for o in store("az").find(container) if any(s in store("az").cat_file(o) for s in secrets)]
    files = [str(p) for folder in folders for p in Path(folder).rglob("*")
             if p.is_file() and any(s in p.read_bytes() for s in secrets)]
    return objects + files


def test_two_writers_on_an_azure_output_one_holds_the_lease_the_other_is_refused_naming_it(azure_bucket, capsys):
    url = f"az://{azure_bucket}/out"
    with objectstore.store_lease(url, "prep", lease_s=30) as held:
        data, etag = held.read()
        assert etag == held.etag and etag.startswith('"0x') and data["expires"] > time.time()
        with pytest.raises(OutputBusyError, match=rf"^{url} is busy: a prep is writing it \(PID {os.getpid()} on "):
            with objectstore.store_lease(url, "gc", on_busy="fail"):
                pass
        with pytest.raises(OutputBusyError, match="a prep is writing it"):
            objectstore.check_not_busy(url)
        # abfs:// is the same filesystem in adlfs: the same object, the same holder
        assert objectstore.StoreLease(f"abfs://{azure_bucket}/out", "gc").try_acquire() == data["holder"]
        assert held.read()[1] == etag  # the refused writers wrote nothing
    assert json.loads(store("az").cat_file(f"{azure_bucket}/out/.writer.lock")) == {"holder": "", "expires": 0}
    objectstore.check_not_busy(url)  # released
    with objectstore.store_lease(url, "gc", on_busy="fail") as lease:
        assert ": gc since " in lease.read()[0]["holder"]
    assert "taking over" not in capsys.readouterr().out  # a released lease is free, not left behind
    with objectstore.training_lease(url, lease_s=30) as training:  # one training at a time, here too
        assert training is not None and training.path == f"{azure_bucket}/out/{objectstore.TRAIN_LOCK}"
        with pytest.raises(OutputBusyError, match="a training is writing it"):
            with objectstore.training_lease(url):
                pass


def test_push_then_pull_on_azure_sends_only_what_changed_and_writes_no_credential(azure_bucket, tmp_path):
    """Azure's ETag is no MD5: objects are compared by their Content-MD5, so an unchanged file is not sent again."""
    url = f"az://{azure_bucket}/out"
    work, fresh = tmp_path / "w", tmp_path / "fresh"
    files = {"prep/cache/shards/cache-01-0.tar": b"t" * 3000, "prep/cache/units/01.json": b'{"u": 1}',
             "prep/cache/manifest.json": b'{"m": 1}', "prep/catalog.sqlite": b"local", "snapshots/LATEST": b"0001-x\n"}
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)
    assert objectstore.push(work, url) == {"uploaded": 4, "bytes": 3000 + 8 + 8 + 7}
    assert objectstore.push(work, url)["uploaded"] == 0
    (work / "prep/cache/manifest.json").write_bytes(b'{"m": 2}')  # same size, new bytes
    assert objectstore.push(work, url) == {"uploaded": 1, "bytes": 8}
    pulled = objectstore.pull(url, fresh)
    assert pulled["downloaded"] == 4 and pulled["tar_sizes"] == {"prep/cache/shards/cache-01-0.tar": 3000}
    got = {p.relative_to(fresh).as_posix(): p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
    assert got == {rel: (b'{"m": 2}' if rel.endswith("manifest.json") else data)
                   for rel, data in files.items() if rel != "prep/catalog.sqlite"}
    assert objectstore.pull(url, fresh)["downloaded"] == 0
    for rel in got:  # a downloaded file carries its object's time on the store: gc orders units by it
        stamp = store("az").info(f"{azure_bucket}/out/{rel}")["last_modified"].timestamp()
        assert abs((fresh / rel).stat().st_mtime - stamp) < 1e-3, rel
    assert not store("az").exists(f"{azure_bucket}/out/prep/catalog.sqlite")
    with objectstore.store_lease(url, "gc"):
        assert _written_anywhere(azure_bucket, tmp_path) == []


def test_store_fs_takes_no_listing_cache_on_azure_and_sees_what_another_client_deleted(azure_bucket):
    """``store_fs`` gives adlfs ``use_listings_cache=False``, as every store: a listing asks the server."""
    fs, root = store_fs(f"az://{azure_bucket}/out")
    assert root == f"{azure_bucket}/out"
    for name in ("0001-x", "0002-y"):
        fs.pipe_file(f"{root}/pins/{name}.pin", b"{}")
    assert fs.ls(f"{root}/pins", detail=False) == [f"{root}/pins/0001-x.pin", f"{root}/pins/0002-y.pin"]
    fsspec.filesystem("az", skip_instance_cache=True).rm_file(f"{root}/pins/0001-x.pin")  # another process's client
    assert fs.ls(f"{root}/pins", detail=False) == [f"{root}/pins/0002-y.pin"]


def test_a_training_run_pin_on_azure_is_a_lease_deleted_at_its_end(azure_bucket):
    url = f"az://{azure_bucket}/out"
    fs = store("az")
    fs.pipe_file(f"{azure_bucket}/out/snapshots/0001-abc/manifest.json", b"{}")
    fs.pipe_file(f"{azure_bucket}/out/snapshots/LATEST", b"0001-abc\n")
    with objectstore.pinned_on_store(url, "latest", lease_s=30) as name:
        assert name == "0001-abc"
        pins = objectstore.store_pins(url)
        assert list(pins) == ["0001-abc"] and pins["0001-abc"][0]["file"].startswith("0001-abc@")
    assert objectstore.store_pins(url) == {} and fs.find(f"{azure_bucket}/out/pins") == []


def test_a_missing_azure_container_fails_in_one_line_naming_the_az_command(azure_bucket, tmp_path, monkeypatch,
                                                                          capsys):
    from latentmill.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    assert main(["prep", config, f"output_dir=az://{azure_bucket}-absent/out", "model.pretrained=/nonexistent"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"latentmill: error: output_dir: az://{azure_bucket}-absent/out: the bucket '{azure_bucket}-absent' does not "
        f"exist on the store; create it first (e.g. `az storage container create --name {azure_bucket}-absent`)")
    assert not (tmp_path / "work").exists()


def test_refused_credentials_and_an_unreachable_azure_endpoint_fail_in_one_line_naming_no_key(
        azure_bucket, azure_server, tmp_path, monkeypatch, capsys):
    """Before any work, in about a second (azure-storage-blob alone retries a closed port for ~80 s)."""
    from latentmill.cli import main
    from tests.helpers import free_port

    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    url = f"az://{azure_bucket}/out"
    wrong = AZURE_KEY[:-8] + "AAAAAAA="
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", os.environ["AZURE_STORAGE_CONNECTION_STRING"].replace(
        AZURE_KEY, wrong))
    assert main(["prep", config, f"output_dir={url}", "model.pretrained=/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"latentmill: error: output_dir: {url}: the store refused access to the bucket "
                          f"'{azure_bucket}' (Server failed to authenticate the request."), err
    assert err.endswith("check the credentials in the environment (AZURE_STORAGE_CONNECTION_STRING, ...)")
    port = free_port()  # nothing listens there
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", os.environ["AZURE_STORAGE_CONNECTION_STRING"].replace(
        azure_server, f"http://127.0.0.1:{port}/devstoreaccount1"))
    started = time.monotonic()
    assert main(["prep", config, f"output_dir={url}", "model.pretrained=/nonexistent"]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"latentmill: error: output_dir: {url}: cannot reach the store (endpoint "
                          f"127.0.0.1:{port}/devstoreaccount1): ServiceRequestError: "), err
    assert err.endswith("check AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME and the network")
    assert len(err.splitlines()) == 1 and AZURE_KEY[:20] not in err and wrong[:20] not in err
    assert not (tmp_path / "work").exists()


@pytest.mark.heavy  # two demo preps; make test runs the same path on S3 (tests/test_object_store_prep.py)
def test_the_demo_prep_on_azure_publishes_is_reused_from_a_fresh_machine_and_writes_no_credential(
        azure_bucket, tiny_flux, tmp_path, monkeypatch, capsys):
    from latentmill.cli import main
    from tests.helpers import demo_prep_twice_on_store

    url, first = demo_prep_twice_on_store("az", azure_bucket, tiny_flux, tmp_path, monkeypatch)  # by Content-MD5
    shards = sum(s["shards"] for s in first["stages"].values())
    capsys.readouterr()
    assert main(["verify", url]) == 0
    assert capsys.readouterr().out.strip().endswith(f"verified {shards} shards on {url}: {shards} ok, 0 bad")
    fs = store("az")
    assert len(fs.find(azure_bucket)) > 50
    assert _written_anywhere(azure_bucket, tmp_path, Path(os.environ["PREFECT_HOME"])) == []  # Prefect's database too
