"""Leases on a GCS output, against a real GCS server (fake-gcs-server, tests/conftest.py ``gcs_server``): the
same lease as on S3 with the generation for the ETag (docs/object-stores.md)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from latentmill.pipelines import objectstore
from latentmill.pipelines.retention import OutputBusyError

from tests.helpers import store


def test_two_writers_on_a_gcs_output_one_holds_the_lease_the_other_is_refused_naming_it(gcs_bucket, capsys):
    url = f"gs://{gcs_bucket}/out"
    with objectstore.store_lease(url, "prep", lease_s=30) as held:
        data, generation = held.read()
        assert generation == held.etag and int(generation) > 0 and data["expires"] > time.time()
        with pytest.raises(OutputBusyError, match=rf"^{url} is busy: a prep is writing it \(PID {os.getpid()} on "):
            with objectstore.store_lease(url, "gc", on_busy="fail"):
                pass
        with pytest.raises(OutputBusyError, match="a prep is writing it"):
            objectstore.check_not_busy(url)
        assert held.read()[1] == generation  # the refused writer wrote nothing
    assert json.loads(store("gs").cat_file(f"{gcs_bucket}/out/.writer.lock")) == {"holder": "", "expires": 0}
    objectstore.check_not_busy(url)  # released
    with objectstore.store_lease(url, "gc", on_busy="fail") as lease:
        assert ": gc since " in lease.read()[0]["holder"]
    assert "taking over" not in capsys.readouterr().out  # a released lease is free, not left behind


def test_a_training_run_pin_on_gcs_is_a_lease_deleted_at_its_end(gcs_bucket):
    url = f"gs://{gcs_bucket}/out"
    fs = store("gs")
    fs.pipe_file(f"{gcs_bucket}/out/snapshots/0001-abc/manifest.json", b"{}")
    fs.pipe_file(f"{gcs_bucket}/out/snapshots/LATEST", b"0001-abc\n")
    with objectstore.pinned_on_store(url, "latest", lease_s=30) as name:
        assert name == "0001-abc"
        pins = objectstore.store_pins(url)
        assert list(pins) == ["0001-abc"] and pins["0001-abc"][0]["file"].startswith("0001-abc@")
    assert objectstore.store_pins(url) == {} and fs.find(f"{gcs_bucket}/out/pins", refresh=True) == []


def test_a_second_push_to_gcs_uploads_only_what_changed(gcs_bucket, tmp_path):
    """GCS's ETag is no MD5: objects are compared by their md5Hash, so an unchanged file is not sent again."""
    url = f"gs://{gcs_bucket}/out"
    files = {"prep/cache/shards/cache-01-0.tar": b"t" * 3000, "prep/cache/units/01.json": b'{"u": 1}',
             "prep/cache/manifest.json": b'{"m": 1}', "snapshots/LATEST": b"0001-x\n"}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    assert objectstore.push(tmp_path, url) == {"uploaded": 4, "bytes": 3000 + 8 + 8 + 7}
    assert objectstore.push(tmp_path, url)["uploaded"] == 0
    (tmp_path / "prep/cache/manifest.json").write_bytes(b'{"m": 2}')  # same size, new bytes
    assert objectstore.push(tmp_path, url) == {"uploaded": 1, "bytes": 8}
    assert store("gs").cat_file(f"{gcs_bucket}/out/prep/cache/manifest.json") == b'{"m": 2}'


@pytest.mark.heavy
def test_the_demo_prep_on_gcs_publishes_is_reused_from_a_fresh_machine_then_pin_and_gc_keep_1(
        gcs_bucket, tiny_flux, tmp_path, monkeypatch, capsys):
    """The S3 prep test's path on GCS (tests/test_object_store_prep.py): the prep takes the lease there, a fresh
    machine reuses every unit and uploads nothing (objects compared by md5Hash), pin and gc work there."""
    from latentmill.cli import main
    from tests.helpers import demo_prep_twice_on_store

    url, first = demo_prep_twice_on_store("gs", gcs_bucket, tiny_flux, tmp_path, monkeypatch)
    name = first["snapshot"]["name"]
    capsys.readouterr()
    assert main(["pin", url, "latest"]) == 0
    assert main(["gc", url, "--keep", "1"]) == 0
    assert main(["verify", url]) == 0
    assert capsys.readouterr().out.strip().endswith("ok, 0 bad")
    assert list(objectstore.store_pins(url)) == [name]


def test_a_missing_gcs_bucket_fails_in_one_line_naming_the_gcs_command(gcs_bucket, tmp_path, monkeypatch, capsys):
    from latentmill.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    assert main(["prep", config, f"output_dir=gs://{gcs_bucket}-absent/out", "model.pretrained=/nonexistent"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"latentmill: error: output_dir: gs://{gcs_bucket}-absent/out: the bucket '{gcs_bucket}-absent' does not "
        f"exist on the store; create it first (e.g. `gcloud storage buckets create gs://{gcs_bucket}-absent`)")
    assert not (tmp_path / "work").exists()
