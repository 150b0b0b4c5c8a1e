"""Compaction (``latentmill compact``, and on its own at the end of a prep): small cache shards merged into
full-size ones by copying members byte for byte, with nothing re-encoded.

The output under test is real: a first prep of six demo images with the tiny Flux models, then five
refreshes of three new images each (``cache.shard_bytes`` is the demo's 512 KiB, so every refresh's cache
unit is a small one), each published as a snapshot. Compaction must merge the small units into the unit the
next prep's planner asks for, keep every sample's bytes, run no encoder, leave the older snapshots readable
until gc, and survive a SIGKILL. On an object store (moto's S3 server, tests/conftest.py ``s3_bucket``) it must
publish what a local compaction writes, parts before records before manifests before ``LATEST``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from latentmill.pipelines import objectstore
from latentmill.pipelines.compaction import compact
from latentmill.pipelines.retention import gc
from latentmill.pipelines.snapshot import latest_name, publish, resolve_snapshot
from latentmill.stages import cache as cache_stage
from latentmill.stages.compact import PAUSE_ENV, plan_compaction
from latentmill.stages.shardindex import index_path, index_tar
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from latentmill.trainer.loader import LatentLoader

from latentmill.core.config import ConfigError
from latentmill.core.hashing import sha256_file
from latentmill.inspect import verify_path
from tests.conftest import DEMO_CONFIG, DEMO_IMAGES, REPO_ROOT
from tests.helpers import store

pytestmark = pytest.mark.slow

IMAGES = sorted(p.stem for p in DEMO_IMAGES.glob("img_*.*") if p.suffix != ".txt")  # 24 good images
# A first prep of 6 images, then five refreshes of 3 new images each; 6 images stay for a later refresh.
SETS = [IMAGES[:6]] + [IMAGES[6 + 3 * i : 9 + 3 * i] for i in range(5)]


def _add(folder: Path, stems: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for path in DEMO_IMAGES.iterdir():
        if path.stem in stems:
            shutil.copy2(path, folder / path.name)


def _recipe(out: Path, source: Path, tiny_flux: Path, *overrides: str):
    from latentmill.recipe import load_recipe

    return load_recipe(DEMO_CONFIG, [f"output_dir={out}", f"model.pretrained={tiny_flux}",
                                     f"ingest.source={source}", "compaction.auto_after=0", *overrides])


def _prep(out: Path, source: Path, tiny_flux: Path, *overrides: str) -> dict:
    from latentmill.pipelines.prep import run_stages_in_process

    recipe = _recipe(out, source, tiny_flux, *overrides)
    result = run_stages_in_process(recipe)
    return {"result": result, "snapshot": publish(out, recipe.stage_dir("cache"))}


@pytest.fixture(scope="module")
def refreshed(tiny_flux, tmp_path_factory):
    """An output_dir after a first prep and five small refreshes: six snapshots, six small cache units."""
    root = tmp_path_factory.mktemp("compaction")
    out, source = root / "out", root / "images"
    for stems in SETS:
        _add(source, stems)
        _prep(out, source, tiny_flux)
    return out, source


@pytest.fixture()
def output(refreshed, tmp_path):
    """A private copy of the refreshed output_dir and its image folder (compaction changes them)."""
    out, source = refreshed
    shutil.copytree(out, tmp_path / "out")
    shutil.copytree(source, tmp_path / "images")
    return tmp_path / "out", tmp_path / "images"


def _members(folder: Path) -> dict[tuple[str, str], bytes]:
    """(sample key, member) -> bytes of every sample of a snapshot or stage manifest's shards."""
    manifest = json.loads((folder / "manifest.json").read_text())
    found = {}
    for shard in manifest["shards"]:
        for sample in read_shard(folder / shard["path"]):
            for ext, data in sample.items():
                if not ext.startswith("__"):
                    found[sample["__key__"], ext] = data
    return found


def _epoch(folder: Path) -> dict[str, torch.Tensor]:
    """Sample key -> latents of one epoch of the trainer's loader on a snapshot."""
    loader = LatentLoader(folder, batch_size=2, seed=3, prefetch=False)
    seen = {}
    for batch in loader:
        if batch["epoch"] > 0:
            break
        for key, latents in zip(batch["keys"], batch["latents"]):
            seen[key] = latents.clone()
    return seen


def _tripwire(monkeypatch) -> None:
    """Any encoder load fails the test: compaction must never need one."""
    def refuse(*args, **kwargs):
        raise AssertionError("an encoder was loaded")
    monkeypatch.setattr(cache_stage, "get_encoders", refuse)


def test_compaction_copies_members_byte_for_byte_and_runs_no_encoder(output, monkeypatch):
    out, _ = output
    cache = StageDir(out / "prep" / "cache", "cache")
    before_manifest = json.loads(cache.manifest_path.read_text())
    old_snapshot = resolve_snapshot(out, "latest")
    old_members = _members(old_snapshot)
    old_epoch = _epoch(old_snapshot)
    groups, seen = plan_compaction(cache, 0.5)
    assert seen["units"] == 6 and seen["small_units"] == 6
    merged = {u.unit_id for g in groups for u in g}
    merged_shards = [s for s in before_manifest["shards"] if s["name"].split("-")[1] in {u[:16] for u in merged}]
    member_bytes = sum(len(old_members[k, e]) for s in merged_shards
                       for k, e in [(x["__key__"], ext) for x in read_shard(cache.root / s["path"]) for ext in x
                                    if not ext.startswith("__")])

    _tripwire(monkeypatch)
    report = compact(out)

    assert report["compacted"] and report["groups"] == len(groups) >= 1
    assert report["merged_units"] == len(merged) >= 4
    assert report["member_bytes_copied"] == report["member_bytes_in_merged_shards"] == member_bytes
    # one shard per group in place of one per merged unit; its tar only loses the other tars' end blocks
    assert report["shards_after"] == len(groups)
    assert 0 < report["tar_bytes_before"] - report["tar_bytes_after"] <= 10240 * len(merged)
    manifest = json.loads(cache.manifest_path.read_text())
    assert len(manifest["shards"]) == len(before_manifest["shards"]) - len(merged) + len(groups)
    assert manifest["counts"] == before_manifest["counts"]
    assert not merged & set(manifest["units"])
    # every member of every sample byte-identical, in the new snapshot as in the old one
    snapshot = resolve_snapshot(out, "latest")
    assert report["snapshot"]["new"] and snapshot != old_snapshot
    assert _members(snapshot) == old_members
    # the merged shard lists its samples as a cache unit does, by (bucket, key); its index is its tar's
    for name in report["units_written"]:
        record = json.loads(cache.unit_path(name).read_text())
        assert sorted(record["extra"]["compacted_from"]) == sorted(u.unit_id for g in groups for u in g
                                                                  if u.unit_id in record["extra"]["compacted_from"])
        (shard,) = record["shards"]
        tar = cache.root / shard["path"]
        order = [(json.loads(s["json"])["bucket"], s["__key__"]) for s in read_shard(tar)]
        assert order == sorted(order)
        assert index_path(tar).read_bytes() == index_tar(tar)
        assert shard["sha256"] == sha256_file(tar)
    # both snapshots read by the trainer's loader give the same latents; everything verifies
    assert verify_path(out) == 0
    new_epoch = _epoch(snapshot)
    assert sorted(new_epoch) == sorted(old_epoch) and len(old_epoch) == 21
    assert all(torch.equal(new_epoch[k], old_epoch[k]) for k in old_epoch)
    assert _epoch(old_snapshot).keys() == old_epoch.keys()  # the older snapshot stays readable


def test_next_prep_reuses_the_compacted_unit_and_a_refresh_leaves_it(output, tiny_flux, monkeypatch):
    out, source = output
    cache = StageDir(out / "prep" / "cache", "cache")
    report = compact(out)
    manifest = json.loads(cache.manifest_path.read_text())
    shard_files = {s["name"]: s["sha256"] for s in manifest["shards"]}
    _tripwire(monkeypatch)
    again = _prep(out, source, tiny_flux)  # same inputs: the planner asks for the compacted unit, finds it
    assert not again["snapshot"]["new"] and again["snapshot"]["name"] == report["snapshot"]["name"]
    assert json.loads(cache.manifest_path.read_text())["units"] == manifest["units"]
    assert all(r.reused for r in again["result"]["cache"][2])
    monkeypatch.undo()

    _add(source, IMAGES[21:23])  # a refresh with two new images
    refresh = _prep(out, source, tiny_flux)
    after = {s["name"]: s["sha256"] for s in json.loads(cache.manifest_path.read_text())["shards"]}
    assert {n: after.get(n) for n in shard_files} == shard_files  # every shard byte-identical, same name
    assert len(after) == len(shard_files) + 1
    counts = [r.extra["counts"]["vae"] for r in refresh["result"]["cache"][2] if not r.reused]
    assert counts == [{"encoded": 2, "reused": 0}]


def test_gc_after_compaction_frees_the_small_shards_and_a_removed_input_reuses_compacted_latents(
        output, tiny_flux):
    out, source = output
    cache = StageDir(out / "prep" / "cache", "cache")
    report = compact(out)
    freed = gc(out, keep=1)
    shards = {p.name for p in (cache.root / "shards").glob("*.tar")}
    manifest = json.loads(cache.manifest_path.read_text())
    assert shards == {s["name"] for s in manifest["shards"]}
    assert freed["stages"]["cache"]["shards"] >= 2 * report["merged_units"]  # tars and their indexes
    assert verify_path(out) == 0
    assert len(_epoch(resolve_snapshot(out, "latest"))) == 21
    # Removing one image re-runs the compacted unit that held it: every other latent is copied from the
    # compacted shard (the small shards that held them first are gone), nothing is encoded.
    record = json.loads(cache.unit_path(report["units_written"][0]).read_text())
    victim = json.loads(next(read_shard(cache.root / record["shards"][0]["path"]))["json"])["source"]
    (source / victim).unlink()
    result = _prep(out, source, tiny_flux)["result"]
    rerun = [r for r in result["cache"][2] if not r.reused]
    assert rerun and sum(r.samples_out for r in rerun) >= record["samples_in"] - 1 - len(record["quarantined"])
    assert [r.extra["counts"]["vae"] for r in rerun] == [{"encoded": 0, "reused": r.samples_out} for r in rerun]


def test_units_rolled_over_into_several_shards_give_their_latents_back(tmp_path, tiny_flux):
    """A unit larger than cache.shard_bytes writes several shards; its components are found in all of them
    (they were looked up in its first shard only, and encoded again)."""
    source = tmp_path / "images"
    _add(source, IMAGES[:10])
    out = tmp_path / "out"
    first = _prep(out, source, tiny_flux, "cache.shard_bytes=60000", "bucket.shard_bytes=10000000")
    (record,) = first["result"]["cache"][2]
    assert len(record.shards) >= 3
    next(p for p in source.iterdir() if p.stem == IMAGES[0]).unlink()
    result = _prep(out, source, tiny_flux, "cache.shard_bytes=60000", "bucket.shard_bytes=10000000")["result"]
    rerun = [r for r in result["cache"][2] if not r.reused]
    assert rerun and sum(r.samples_out for r in rerun) == 9
    assert [r.extra["counts"]["vae"] for r in rerun] == [{"encoded": 0, "reused": r.samples_out} for r in rerun]


def test_sigkill_in_the_middle_of_a_compaction_loses_nothing(output, tmp_path):
    out, _ = output
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    expected = compact(reference)
    latest = latest_name(out)
    before = _members(resolve_snapshot(out, "latest"))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), PAUSE_ENV: "7"}  # in the middle of the first tar
    log = tmp_path / "compact.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "latentmill.cli", "compact", str(out)], env=env,
                                stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "paused after 7 samples" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        assert list((out / "prep" / "cache" / "shards").glob("*.tmp"))  # a half-written tar
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert latest_name(out) == latest  # nothing published, every snapshot readable and verified
    assert verify_path(out) == 0
    assert _members(resolve_snapshot(out, "latest")) == before
    done = subprocess.run([sys.executable, "-m", "latentmill.cli", "compact", str(out)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "taking over the writer lock" in done.stdout
    got = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    want = json.loads((reference / "prep" / "cache" / "manifest.json").read_text())
    assert got["shards"] == want["shards"]  # the same bytes as an uninterrupted compaction
    assert latest_name(out) == expected["snapshot"]["name"]
    assert verify_path(out) == 0


def test_a_prep_compacts_on_its_own_past_the_threshold(output, tiny_flux):
    out, source = output
    cache = StageDir(out / "prep" / "cache", "cache")
    units = json.loads(cache.manifest_path.read_text())["units"]
    sizes = {u: sum((cache.root / s["path"]).stat().st_size
                    for s in json.loads(cache.unit_path(u).read_text())["shards"]) for u in units}
    first = max(sizes, key=sizes.get)  # the first prep's unit: 6 images, the refreshes' 3 each
    # Six small units, but by size tiers of a factor 6 the first prep's unit is alone in its tier and the
    # five refresh units are one short of six: nothing is merged.
    _prep(out, source, tiny_flux, "compaction.auto_after=6")
    assert json.loads(cache.manifest_path.read_text())["units"] == units
    result = _prep(out, source, tiny_flux, "compaction.auto_after=5")["result"]  # five of one tier: merged
    after = json.loads(cache.manifest_path.read_text())
    (merged,) = set(after["units"]) - set(units)
    assert sorted(json.loads(cache.unit_path(merged).read_text())["extra"]["compacted_from"]) == \
        sorted(set(units) - {first})
    assert sorted(after["units"]) == sorted([first, merged])
    assert sorted(r.unit_id for r in result["cache"][2]) == sorted(after["units"])
    assert verify_path(out) == 0


def test_dry_run_changes_nothing_and_bad_settings_are_refused(output, tiny_flux):
    out, source = output
    files = {p: p.stat().st_size for p in out.rglob("*") if p.is_file()}
    done = subprocess.run([sys.executable, "-m", "latentmill.cli", "compact", str(out), "--dry-run"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "would merge" in done.stdout and "6 small" in done.stdout
    assert {p: p.stat().st_size for p in out.rglob("*") if p.is_file()} == files
    for override, key in (("compaction.auto_after=1", "compaction.auto_after"),
                          ("compaction.small_below=0", "compaction.small_below")):
        with pytest.raises(ConfigError, match=key):
            _recipe(out, source, tiny_flux, override)
    bad = subprocess.run([sys.executable, "-m", "latentmill.cli", "compact", str(out), "--small-below", "2"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                         timeout=120)
    assert bad.returncode == 2 and "--small-below" in bad.stderr


def test_a_damaged_small_shard_is_not_copied_into_a_merged_one(output, monkeypatch):
    """Compaction copies members byte for byte: a small shard whose bytes no longer match its record's
    sha256 (a flipped byte, same size) would hand its damage to a merged shard with a fresh digest, where
    `verify` could not see it. Its group is left as it is and the report names the shard."""
    out, _ = output
    cache = StageDir(out / "prep" / "cache", "cache")
    groups, _ = plan_compaction(cache, 0.5)
    victim = groups[0][0]
    tar = cache.root / victim.shards[0].path
    data = bytearray(tar.read_bytes())
    data[700] ^= 0xFF  # inside the first member's data (after its 512-byte header)
    tar.write_bytes(bytes(data))
    before = json.loads(cache.manifest_path.read_text())

    _tripwire(monkeypatch)
    report = compact(out)

    assert [d["shard"] for d in report["damaged"]] == [victim.shards[0].path]
    assert "sha256" in report["damaged"][0]["reason"]
    kept = {r.unit_id for r in groups[0]}
    manifest = json.loads(cache.manifest_path.read_text())
    assert kept <= set(manifest["units"])  # the damaged group's units stay as they were
    assert report["groups"] == len(groups) - 1 and manifest["counts"] == before["counts"]
    from latentmill.pipelines.compaction import format_report

    assert "left as is" in format_report(report) and victim.shards[0].path in format_report(report)
    assert verify_path(out) != 0  # verify still sees the damage, in the shard it was in


def test_compact_on_a_store_publishes_the_bytes_of_a_local_compaction_parts_first(output, s3_bucket, tmp_path,
                                                                                   monkeypatch):
    from latentmill.cli import main

    out, _ = output
    url = f"s3://{s3_bucket}/out"
    objectstore.push(out, url)  # the output as a prep on the store leaves it
    _tripwire(monkeypatch)
    local = compact(out)  # the same output compacted locally: the oracle
    name = local["snapshot"]["name"]
    fs = store("s3")
    fs.ls(s3_bucket)
    sent: list[str] = []
    record = lambda request, **_: sent.append(request.url.split(f"/{s3_bucket}/out/", 1)[-1].split("?")[0])  # noqa: E731
    fs.s3.meta.events.register("before-send.s3.PutObject", record)
    try:
        assert main(["compact", url, "--json", str(tmp_path / "compact.json")]) == 0
    finally:
        fs.s3.meta.events.unregister("before-send.s3.PutObject", record)
    report = json.loads((tmp_path / "compact.json").read_text())
    assert report["compacted"] and report["units_written"] == local["units_written"]
    assert report["snapshot"] == {**local["snapshot"], "path": f"{url}/snapshots/{name}"}
    # published as a prep publishes: the merged units' parts, then their records, then the cache manifest,
    # the snapshot, LATEST last (the lease object is no part of the output)
    sent = [rel for rel in sent if rel != ".writer.lock"]
    assert report["store"]["downloaded"] > 0 and report["store"]["uploaded"] == len(sent)
    phases = [objectstore.phase(rel) for rel in sent]
    assert phases == sorted(phases) and sent[-1] == "snapshots/LATEST"
    new_records = [f"prep/cache/units/{unit}.json" for unit in local["units_written"]]
    new_shards = [f"prep/cache/{s['path']}" for unit in new_records for s in json.loads((out / unit).read_text())["shards"]]
    assert set(new_records) | set(new_shards) <= set(sent)
    assert f"snapshots/{name}/manifest.json" in sent and "prep/cache/manifest.json" in sent
    # the store's snapshot: the local compaction's shards, every member byte-identical; LATEST names it
    assert fs.cat_file(f"{s3_bucket}/out/snapshots/LATEST").decode().strip() == name
    stored = json.loads(fs.cat_file(f"{s3_bucket}/out/snapshots/{name}/manifest.json"))
    assert stored["shards"] == json.loads((out / "snapshots" / name / "manifest.json").read_text())["shards"]
    fresh = tmp_path / "fresh"
    objectstore.pull(url, fresh)
    assert _members(fresh / "snapshots" / name) == _members(out / "snapshots" / name)
    assert main(["verify", url]) == 0


def test_compact_on_a_store_downloads_only_the_tars_it_merges(output, store_bucket, monkeypatch):
    """The plan is made from the store's records, indexes and listing: a dry run downloads no tar, a compaction
    only the merged units' (not the unit too large to merge, nor another stage's), and publishes what a local
    compaction with the same threshold publishes."""
    from latentmill.core.store import work_dir_for

    out, _ = output
    scheme, bucket = store_bucket
    url = f"{scheme}://{bucket}/out"
    objectstore.push(out, url)
    cache = StageDir(out / "prep" / "cache", "cache")
    manifest = json.loads(cache.manifest_path.read_text())
    unit_bytes = {unit: sum((cache.root / s["path"]).stat().st_size
                            for s in json.loads(cache.unit_path(unit).read_text())["shards"]) for unit in manifest["units"]}
    big = max(unit_bytes, key=unit_bytes.get)  # the first prep's unit: 6 images, the refreshes' 3
    small_below = unit_bytes[big] / manifest["shard_bytes"]  # not under its own size: every other unit is small
    groups, seen = plan_compaction(cache, small_below)
    merged = {r.unit_id for g in groups for r in g}
    assert seen["small_units"] == 5 and big not in merged and len(merged) >= 2
    work = work_dir_for(url)

    def tars() -> set[str]:
        return {p.relative_to(work).as_posix() for p in work.rglob("*.tar")}

    dry = objectstore.compact_store(url, small_below, dry_run=True)
    assert (dry["small_units"], dry["merged_units"], dry["compacted"]) == (5, len(merged), False)
    assert tars() == set() and (work / "prep" / "cache" / "manifest.json").is_file()
    _tripwire(monkeypatch)
    local = compact(out, small_below)  # the oracle
    report = objectstore.compact_store(url, small_below)
    assert report["units_written"] == local["units_written"]
    assert report["snapshot"] == {**local["snapshot"], "path": f"{url}/snapshots/{local['snapshot']['name']}"}
    written = [f"prep/cache/{s['path']}" for unit in local["units_written"]
               for s in json.loads(cache.unit_path(unit).read_text())["shards"]]
    downloaded = [f"prep/cache/{s.path}" for g in groups for r in g for s in r.shards]
    assert tars() == set(written) | set(downloaded)
    fs = store(scheme)
    name = local["snapshot"]["name"]
    stored = json.loads(fs.cat_file(f"{bucket}/out/snapshots/{name}/manifest.json"))
    oracle = json.loads((out / "snapshots" / name / "manifest.json").read_text())
    assert stored["shards"] == oracle["shards"] and stored["snapshot"]["bytes"] == oracle["snapshot"]["bytes"]
