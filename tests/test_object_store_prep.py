"""The demo prep with its output and its inputs on a real S3 server (moto's, tests/conftest.py ``s3_server``):
shards, records and the snapshot published there, `inspect` and `verify` reading it, a rerun from a fresh
machine reusing every unit, and no credential in anything written (docs/object-stores.md)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from latentmill.pipelines import objectstore
from latentmill.stages import remotetars

from latentmill.cli import main
from tests.conftest import S3_SECRET
from tests.helpers import store, upload_demo_inputs

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
DEMO_IMAGES = REPO / "data" / "demo" / "images"
STAGES = ["ingest", "caption", "curate", "bucket", "cache"]


def _prep(url: str, source: str, tiny_flux: Path, summary: Path) -> dict:
    assert main(["prep", str(DEMO_CONFIG), f"output_dir={url}", f"model.pretrained={tiny_flux}",
                 f"ingest.source={source}", "--summary-json", str(summary)]) == 0
    return json.loads(summary.read_text())


def _tar_objects(fs, root: str) -> dict[str, int]:
    """The tars on the store below ``root`` (bucket/prefix): path relative to it -> bytes."""
    return {info["name"][len(root) + 1:]: int(info["size"]) for info in fs.find(root, detail=True).values()
            if info["name"].endswith(".tar")}


def _files_below(folder: Path):
    return [p for p in Path(folder).rglob("*") if p.is_file()]


@pytest.mark.slow
def test_prep_publishes_to_the_store_and_a_fresh_machine_reuses_every_unit(s3_bucket, tiny_flux, tmp_path,
                                                                           monkeypatch, capsys):
    fs = store("s3")
    url = f"s3://{s3_bucket}/out"
    source = upload_demo_inputs(fs, s3_bucket)

    first = _prep(url, source, tiny_flux, tmp_path / "first.json")
    stages = first["stages"]
    assert list(stages) == STAGES
    assert (stages["ingest"]["in"], stages["ingest"]["out"]) == (28, 27)
    assert (stages["cache"]["in"], stages["cache"]["out"], stages["cache"]["processed"]) == (24, 24, 24)
    for s in stages.values():
        assert s["in"] == s["out"] + s["quarantined"] == s["processed"] + s["reused"]
    name = first["snapshot"]["name"]
    assert first["snapshot"]["path"] == f"{url}/snapshots/{name}" and first["snapshot"]["new"]
    assert first["store"]["downloaded"] == 0 and first["store"]["uploaded"] > 0

    # On the store: LATEST names the snapshot; every shard the manifests list is there with its recorded
    # sha256, and equals the work folder's copy; every unit's record is there
    work = Path(first["store"]["work_dir"])
    assert fs.cat_file(f"{s3_bucket}/out/snapshots/LATEST").decode().strip() == name
    snapshot = json.loads(fs.cat_file(f"{s3_bucket}/out/snapshots/{name}/manifest.json"))
    assert snapshot["snapshot"]["samples"] == 24
    for stage in STAGES:
        manifest = json.loads(fs.cat_file(f"{s3_bucket}/out/prep/{stage}/manifest.json"))
        assert manifest == json.loads((work / "prep" / stage / "manifest.json").read_text())
        for shard in manifest["shards"]:
            data = fs.cat_file(f"{s3_bucket}/out/prep/{stage}/{shard['path']}")
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
            assert data == (work / "prep" / stage / shard["path"]).read_bytes()
        for unit in manifest["units"]:
            assert fs.exists(f"{s3_bucket}/out/prep/{stage}/units/{unit}.json")
    assert not fs.exists(f"{s3_bucket}/out/prep/catalog.sqlite")  # local: rebuilt from the records

    # inspect and verify read the store
    capsys.readouterr()
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert f"snapshot {name} (" in out and ": 24 samples in " in out and "cache (" in out
    assert main(["verify", url]) == 0
    assert capsys.readouterr().out.strip().endswith(f"verified {sum(stages[s]['shards'] for s in STAGES)} "
                                                     f"shards on {url}: {sum(stages[s]['shards'] for s in STAGES)} "
                                                     "ok, 0 bad")

    # A fresh machine (an empty work folder) reuses every unit the store holds, and uploads nothing
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "work-fresh"))
    again = _prep(url, source, tiny_flux, tmp_path / "again.json")
    for stage in STAGES:
        assert again["stages"][stage]["processed"] == 0, stage
        assert again["stages"][stage]["reused"] == stages[stage]["in"], stage
    assert again["snapshot"]["name"] == name and not again["snapshot"]["new"]
    assert again["store"]["downloaded"] > 0 and again["store"]["uploaded"] == 0
    # ... and downloads no tar: its units are reused with their tars on the store; curation's duplicate index,
    # new on this machine, reads the json members of the caption shards alone
    assert again["store"]["tars_downloaded"] == 0
    assert not list(Path(again["store"]["work_dir"]).rglob("*.tar"))
    assert again["store"]["ranges_read"] == stages["caption"]["out"]

    # No credential in anything written: every object on the store, both work folders, the commands' output,
    # the Prefect database (flow-run parameters, logs, artifacts)
    secret = S3_SECRET.encode()
    captured = capsys.readouterr()
    assert S3_SECRET not in captured.out + captured.err
    objects = fs.find(s3_bucket)
    assert len(objects) > 50
    assert not [o for o in objects if secret in fs.cat_file(o)]
    prefect = _files_below(os.environ["PREFECT_HOME"])
    assert [p for p in prefect if p.suffix == ".db"]  # the API server's database: runs, logs, artifacts
    written = _files_below(tmp_path) + prefect
    assert len(written) > 50
    assert not [p for p in written if secret in p.read_bytes()]

    # A shard changed on the store is found by verify, reading the store's bytes
    cache = json.loads(fs.cat_file(f"{s3_bucket}/out/prep/cache/manifest.json"))
    damaged = f"{s3_bucket}/out/prep/cache/{cache['shards'][0]['path']}"
    data = bytearray(fs.cat_file(damaged))
    data[600] ^= 0xFF
    fs.pipe_file(damaged, bytes(data))
    capsys.readouterr()
    assert main(["verify", url]) == 1
    assert f"MISMATCH s3://{damaged}: sha256 differs from the manifest" in capsys.readouterr().out


@pytest.mark.slow
def test_a_second_prep_on_a_held_output_is_refused_in_one_line(s3_bucket, tiny_flux, capsys):
    fs = store("s3")
    url = f"s3://{s3_bucket}/out"
    with objectstore.store_lease(url, "prep"):
        assert main(["prep", str(DEMO_CONFIG), f"output_dir={url}", f"model.pretrained={tiny_flux}",
                     "prep.on_busy=fail"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"latentmill: error: {url} is busy: a prep is writing it "
                                                         f"(PID {os.getpid()} on "), err
    assert err.endswith("set prep.on_busy=wait to queue behind it")
    assert fs.find(s3_bucket) == [f"{s3_bucket}/out/.writer.lock"]  # nothing else written


def _shards(fs, root: str) -> dict[str, list[tuple[str, str]]]:
    """Each stage's shards (name, sha256) from its manifest on the store."""
    return {stage: [(x["name"], x["sha256"]) for x in json.loads(fs.cat_file(f"{root}/prep/{stage}/manifest.json"))
                    ["shards"]] for stage in STAGES}


@pytest.mark.heavy
def test_a_killed_prep_leaves_whole_units_another_machine_reuses_then_a_refresh_and_gc(
        s3_bucket, tiny_flux, tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys
    import time

    fs = store("s3")
    source = upload_demo_inputs(fs, s3_bucket)
    clean = _prep(f"s3://{s3_bucket}/clean", source, tiny_flux, tmp_path / "clean.json")

    url = f"s3://{s3_bucket}/out"
    log = tmp_path / "killed.log"
    killed = subprocess.Popen([sys.executable, "-m", "latentmill.cli", "prep", str(DEMO_CONFIG), f"output_dir={url}",
                               f"model.pretrained={tiny_flux}", f"ingest.source={source}"],
                              env={**os.environ, "PYTHONPATH": str(REPO), objectstore.PAUSE_ENV: "1"},
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 600
    while "publish: paused after 1 rounds" not in log.read_text():  # its first units are on the store
        assert killed.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    fs.invalidate_cache()
    assert not fs.exists(f"{s3_bucket}/out/snapshots/LATEST")
    # every record on the store has its parts there (parts first, then the record)
    records = fs.glob(f"{s3_bucket}/out/prep/*/units/*.json")
    for record in records:
        stage_root = record.rsplit("/units/", 1)[0]
        for shard in json.loads(fs.cat_file(record))["shards"]:
            data = fs.cat_file(f"{stage_root}/{shard['path']}")
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
    # its lease ran out (60 s: written so here rather than waited for); another machine takes over
    lock = f"{s3_bucket}/out/.writer.lock"
    holder = json.loads(fs.cat_file(lock))["holder"]
    assert holder.startswith(f"PID {killed.pid} on ")
    fs.pipe_file(lock, json.dumps({"holder": holder, "expires": time.time() - 1}).encode())
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "another-machine"))
    again = _prep(url, source, tiny_flux, tmp_path / "again.json")
    assert sum(again["stages"][s]["reused"] for s in STAGES) > 0  # the units the killed prep published
    assert again["store"]["downloaded"] >= 2 * len(records)  # records and their parts
    assert _shards(fs, f"{s3_bucket}/out") == _shards(fs, f"{s3_bucket}/clean")  # the same bytes as a clean run
    assert again["snapshot"]["name"] == clean["snapshot"]["name"]

    # A refresh through the store: two new inputs cost their own work, every old unit is reused
    _add_images(fs, s3_bucket, source, 2)
    refreshed = _prep(url, source, tiny_flux, tmp_path / "refreshed.json")
    ingest, cache = refreshed["stages"]["ingest"], refreshed["stages"]["cache"]
    assert (ingest["in"], ingest["processed"], ingest["reused"]) == (30, 2, 28)
    assert (cache["in"], cache["out"], cache["processed"]) == (26, 26, 2)
    assert refreshed["snapshot"]["new"] and refreshed["store"]["downloaded"] == 0
    assert fs.cat_file(f"{s3_bucket}/out/snapshots/LATEST").decode().strip() == refreshed["snapshot"]["name"]

    # gc --keep 1 on the store: the older snapshot goes, the newest stays whole; the store holds exactly what
    # the work folder's gc kept: its files and the tars it left on the store
    newest = refreshed["snapshot"]["name"]
    assert main(["gc", url, "--keep", "1"]) == 0
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3_bucket}/out/snapshots")) == sorted(["LATEST", newest])
    assert main(["verify", url]) == 0
    work = Path(refreshed["store"]["work_dir"])
    on_store = {p.removeprefix(f"{s3_bucket}/out/") for p in fs.find(f"{s3_bucket}/out")}
    left = {f"prep/{rel}" for rel in json.loads((work / "prep" / remotetars.LIST_FILE).read_text())["tars"]}
    assert {rel for rel in on_store if objectstore.shared(rel)} == set(objectstore.local_files(work)) | left


@pytest.mark.heavy
def test_two_preps_started_together_on_one_store_output_take_turns(s3_bucket, tiny_flux, tmp_path):
    import subprocess
    import sys

    fs = store("s3")
    source = upload_demo_inputs(fs, s3_bucket, 8)
    url = f"s3://{s3_bucket}/out"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [subprocess.Popen([sys.executable, "-m", "latentmill.cli", "prep", str(DEMO_CONFIG), f"output_dir={url}",
                               f"model.pretrained={tiny_flux}", f"ingest.source={source}"],
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, cwd=REPO) for log in logs]
    codes = [p.wait(timeout=600) for p in procs]
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    assert sum(f"prep: waiting for a prep writing to {url} (held by PID " in t for t in texts) == 1, texts
    fs.invalidate_cache()
    assert len(fs.ls(f"{s3_bucket}/out/snapshots")) == 2  # one snapshot and LATEST
    name = fs.cat_file(f"{s3_bucket}/out/snapshots/LATEST").decode().strip()
    assert all(f"snapshot: {name}" in t for t in texts)
    assert main(["verify", url]) == 0


def _add_images(fs, bucket: str, source: str, count: int) -> None:
    """``count`` new PNG images on the store, listed in the inputs' manifest."""
    import io

    import numpy as np
    from PIL import Image

    rows = fs.cat_file(source.removeprefix("s3://")).decode()
    for n in range(count):
        pixels = np.random.default_rng(n).integers(40, 200, (96, 128, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        fs.pipe_file(f"{bucket}/inputs/new_{n}.png", buffer.getvalue())
        rows += json.dumps({"path": f"new_{n}.png", "caption": f"a new picture {n}"}) + "\n"
    fs.pipe_file(source.removeprefix("s3://"), rows.encode())


def _local_shards(output: Path) -> dict[str, list[tuple[str, str]]]:
    return {stage: [(x["name"], x["sha256"]) for x in json.loads((output / "prep" / stage / "manifest.json").read_text())
                    ["shards"]] for stage in STAGES}


# make test covers the same path in parts: tests/test_remote_tars.py (a tar fetched when a reader opens it,
# members read alone, push and reuse without tars, a worker process fetching) and
# test_prep_publishes_to_the_store_and_a_fresh_machine_reuses_every_unit (a fresh machine's unchanged prep
# downloads no tar)
@pytest.mark.heavy
def test_a_refresh_on_a_fresh_machine_downloads_no_tar_of_a_reused_unit(s3_bucket, tiny_flux, tmp_path, monkeypatch):
    fs = store("s3")
    source = upload_demo_inputs(fs, s3_bucket)
    url, local = f"s3://{s3_bucket}/out", tmp_path / "local"
    _prep(url, source, tiny_flux, tmp_path / "first.json")
    _prep(str(local), source, tiny_flux, tmp_path / "local-first.json")
    _add_images(fs, s3_bucket, source, 4)
    before = {rel: n for rel, n in _tar_objects(fs, f"{s3_bucket}/out").items()}

    local_refresh = _prep(str(local), source, tiny_flux, tmp_path / "local-refresh.json")
    # a fresh machine, its runner's worker processes opening tars too
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "work-fresh"))
    assert main(["prep", str(DEMO_CONFIG), f"output_dir={url}", f"model.pretrained={tiny_flux}",
                 f"ingest.source={source}", "runner.kind=processes", "--summary-json",
                 str(tmp_path / "refresh.json")]) == 0
    refresh = json.loads((tmp_path / "refresh.json").read_text())
    ingest = refresh["stages"]["ingest"]
    assert (ingest["in"], ingest["processed"], ingest["reused"]) == (32, 4, 28)
    work = Path(refresh["store"]["work_dir"])
    downloaded = sorted(rel for rel in before if (work / rel).is_file())
    print(f"refresh from a fresh work folder: store summary {refresh['store']}; tars downloaded {len(downloaded)} "
          f"({sum(before[rel] for rel in downloaded)} bytes) of {len(before)} ({sum(before.values())} bytes)")
    assert downloaded == [] and refresh["store"]["tars_downloaded"] == 0
    # curation's duplicate index read the old caption shards' json members alone
    assert refresh["store"]["ranges_read"] == refresh["stages"]["caption"]["out"] - refresh["stages"]["caption"]["processed"]
    # the same bytes, units and snapshot as a local refresh of the same inputs
    assert _shards(fs, f"{s3_bucket}/out") == _local_shards(local)
    assert refresh["snapshot"]["name"] == local_refresh["snapshot"]["name"] and refresh["snapshot"]["new"]
    for stage in STAGES:
        assert refresh["stages"][stage]["processed"] == local_refresh["stages"][stage]["processed"], stage
    assert main(["verify", url]) == 0
