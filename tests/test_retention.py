"""Retention and one writer per output_dir: ``latentmill gc``, ``pin``/``unpin``, training pins, the writer lock.

The output under test is real: three snapshots prepared on the demo images with the tiny Flux models (a
first set, the same plus new images, then a set with old images gone), each followed by a copy of the four
stage manifests of that prep. Those copies are the oracle for what a snapshot references: gc must keep
exactly the unit records and shards they name for the kept snapshots, and delete the rest.

Processes are real too: gc killed with SIGKILL mid-way (``LATENTMILL_GC_PAUSE_AFTER`` stops it after the
k-th removal, where the test kills it), ``latentmill prep`` processes started together or killed while
they hold the lock, a process holding a training pin. Their output goes to files, never to an unread pipe.

On an object store (moto's S3 server, tests/conftest.py ``s3_bucket``) the same output is uploaded as a prep
there publishes it; gc, pins, a training run's lease pin and the refresh flow's retention step run there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from latentmill.pipelines import objectstore
from latentmill.pipelines.retention import (
    PAUSE_ENV,
    gc,
    plan_gc,
    published,
)
from latentmill.pipelines.snapshot import LATEST, latest_name
from latentmill.stages.tarshard import read_shard

from latentmill.core.hashing import sha256_file
from latentmill.core.store import work_dir_for
from latentmill.inspect import verify_path
from tests.conftest import DEMO_CONFIG, DEMO_IMAGES, REPO_ROOT
from tests.helpers import store

pytestmark = pytest.mark.slow

STAGES = ("ingest", "caption", "curate", "bucket", "cache")
IMAGES = sorted(p.stem for p in DEMO_IMAGES.glob("img_*.*") if p.suffix != ".txt")  # 24 good images
# Snapshot 1: images 0-11; snapshot 2: 0-17 (new data); snapshot 3: 6-23 and the broken file (old data gone).
SETS = [IMAGES[:12], IMAGES[:18], IMAGES[6:] + ["broken"]]


def _fill(folder: Path, stems: list[str]) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in DEMO_IMAGES.iterdir():
        if path.stem in stems:
            shutil.copy2(path, folder / path.name)


def _recipe(out: Path, source: Path, tiny_flux: Path, *overrides: str):
    from latentmill.recipe import load_recipe

    return load_recipe(DEMO_CONFIG, [f"output_dir={out}", f"model.pretrained={tiny_flux}",
                                     f"ingest.source={source}", *overrides])


@pytest.fixture(scope="module")
def three_snapshots(tiny_flux, tmp_path_factory):
    """An output_dir with three snapshots, and each snapshot's four stage manifests as that prep wrote them."""
    from latentmill.pipelines.prep import run_stages_in_process
    from latentmill.pipelines.snapshot import publish

    root = tmp_path_factory.mktemp("retention")
    out, source = root / "out", root / "images"
    manifests = {}
    for stems in SETS:
        _fill(source, stems)
        recipe = _recipe(out, source, tiny_flux)
        run_stages_in_process(recipe)
        # with the recipe's held-out rule, as a prep publishes (a refresh of the same inputs then publishes nothing)
        name = publish(out, recipe.stage_dir("cache"), recipe.prep.eval_fraction, recipe.prep.eval_min_count)["name"]
        manifests[name] = {s: json.loads((out / "prep" / s / "manifest.json").read_text()) for s in STAGES}
    assert len(published(out)) == 3
    return out, source, manifests


@pytest.fixture()
def output(three_snapshots, tmp_path):
    """A private copy of the three-snapshot output_dir (gc changes it)."""
    out, source, manifests = three_snapshots
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    return copy, source, manifests


def _files(out: Path) -> dict[str, dict[str, int]]:
    """Every gc-managed file per stage (units/, shards/, empty_prompt-*), relative name -> bytes."""
    files = {}
    for stage in STAGES:
        root = out / "prep" / stage
        found = [p for p in root.rglob("*") if p.is_file()
                 and (p.parent.name in ("units", "shards") or p.name.startswith("empty_prompt-"))]
        files[stage] = {str(p.relative_to(root)): p.stat().st_size for p in found}
    return files


def _own_files(record: dict) -> set[str]:
    """The files of a unit's own that its record names, besides its shards: its detail file, its rows of the
    scores table."""
    return {record["extra"][k] for k in ("detail", "scores_table") if k in record["extra"]}


def _expected(out: Path, manifests: dict, kept: list[str], stages=STAGES) -> dict[str, set[str]]:
    """What the kept snapshots' preps wrote, per stage (the oracle): the unit records their stage manifests
    name, their shards with sidecars (``<shard stem>.*``, e.g. an index), the files of a unit's own that its
    record names (its detail file, curate's rows of the scores table) and the empty-prompt embedding."""
    expected: dict[str, set[str]] = {s: set() for s in stages}
    for stage in stages:
        root = out / "prep" / stage
        for name in kept:
            manifest = manifests[name][stage]
            expected[stage] |= {f"units/{u}.json" for u in manifest["units"]}
            for u in manifest["units"]:
                expected[stage] |= _own_files(json.loads((root / "units" / f"{u}.json").read_text()))
            for shard in manifest["shards"]:
                stem = shard["path"].rsplit(".", 1)[0]
                expected[stage] |= {f"shards/{p.name}" for p in (root / "shards").glob("*")
                                    if f"shards/{p.name}".startswith(stem + ".")}
            if "empty_prompt" in manifest:
                expected[stage].add(manifest["empty_prompt"]["path"])
    return expected


def _assert_lineage(out: Path, manifests: dict, current: str) -> None:
    """Upstream of the cache, by the data: every shard a kept unit reads (by sha256) is on disk in a kept
    unit of the stage before, hashed again here; every kept unit is current or wrote such a shard; every
    kept shard file belongs to a kept unit."""
    after = _files(out)
    for index in range(len(STAGES) - 2, -1, -1):
        stage, down = STAGES[index], STAGES[index + 1]
        root, down_root = out / "prep" / stage, out / "prep" / down
        kept = {f[len("units/"):-len(".json")] for f in after[stage] if f.startswith("units/")}
        records = {u: json.loads((root / "units" / f"{u}.json").read_text()) for u in kept}
        read = {sha for f in after[down] if f.startswith("units/")
                for sha in json.loads((down_root / f).read_text())["inputs"]}
        on_disk = {sha256_file(root / s["path"]) for r in records.values() for s in r["shards"]}
        assert read <= on_disk, stage
        assert set(manifests[current][stage]["units"]) <= kept, stage
        for unit, record in records.items():
            assert unit in manifests[current][stage]["units"] or any(s["sha256"] in read for s in record["shards"])
        stems = tuple(s["path"].rsplit(".", 1)[0] + "." for r in records.values() for s in r["shards"])
        own = {f for r in records.values() for f in _own_files(r)}
        assert all(f.startswith(stems) or f in own for f in after[stage] if f.startswith("shards/")), stage


def _tree(out: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}


def _assert_readable(out: Path, names: list[str]) -> None:
    """Each snapshot's manifest loads, every shard reads whole with the samples it lists, and verify is clean."""
    for name in names:
        folder = out / "snapshots" / name
        manifest = json.loads((folder / "manifest.json").read_text())
        for shard in manifest["shards"]:
            assert sum(1 for _ in read_shard(folder / shard["path"])) == shard["samples"]
        assert (folder / manifest["empty_prompt"]["path"]).is_file()
        assert verify_path(folder) == 0
    assert verify_path(out) == 0


@pytest.mark.parametrize("keep,pinned", [(1, False), (2, False), (1, True)], ids=["keep1", "keep2", "keep1+pin"])
def test_gc_keeps_exactly_what_the_newest_and_pinned_snapshots_reference(output, keep, pinned, tiny_flux):
    from latentmill.cli import main as cli

    out, source, manifests = output
    names = published(out)
    if pinned:
        assert cli(["pin", str(out), names[0]]) == 0
    kept = names[-keep:] if not pinned else [names[0], *names[-keep:]]
    before, tree = _files(out), _tree(out)
    # before gc, while the sidecars are there to be found: the cache exactly; every stage when only the
    # current snapshot is kept (older ones can share upstream shards with it: see _assert_lineage)
    expected = _expected(out, manifests, kept, STAGES if kept == names[-1:] else ("cache",))
    dry = gc(out, keep, dry_run=True)
    assert _tree(out) == tree  # a dry run changes nothing, not even an mtime
    report = gc(out, keep)
    assert {k: v for k, v in dry.items() if k != "dry_run"} == {k: v for k, v in report.items() if k != "dry_run"}
    after = _files(out)
    for stage in expected:
        assert set(after[stage]) == expected[stage], stage
    _assert_lineage(out, manifests, names[-1])
    for stage in STAGES:
        removed = set(before[stage]) - set(after[stage])
        assert report["stages"][stage]["files"] == len(removed)
        assert report["stages"][stage]["bytes"] == sum(before[stage][f] for f in removed)
        assert report["stages"][stage]["kept_bytes"] == sum(after[stage].values())
    assert published(out) == kept and report["snapshots_kept"] == kept
    assert report["snapshots_removed"] == [n for n in names if n not in kept]
    assert latest_name(out) == names[-1]
    assert report["snapshots"]["folders"] == len(names) - len(kept)
    if kept == names[-1:]:  # images 0-5 are in no kept snapshot: every stage frees their units
        assert all(report["stages"][s]["files"] > 0 for s in STAGES)
    _assert_readable(out, kept)
    assert gc(out, keep)["freed_files"] == 0  # nothing left to collect
    # The current manifests were kept: a refresh of the same data reuses every unit.
    from latentmill.pipelines.prep import run_stages_in_process

    result = run_stages_in_process(_recipe(out, source, tiny_flux))
    assert all(r.reused for stage in STAGES for r in result[stage][2])


def test_unpin_lets_gc_remove_a_pinned_snapshot(output, capsys):
    from latentmill.cli import main as cli

    out, _, manifests = output
    names = published(out)
    assert cli(["pin", str(out), names[0]]) == 0
    assert cli(["gc", str(out), "--keep", "1"]) == 0
    assert published(out) == [names[0], names[2]]
    assert cli(["pin", str(out)]) == 0
    assert f"{names[0]}: pinned by user" in capsys.readouterr().out
    assert cli(["unpin", str(out), names[0]]) == 0
    expected = _expected(out, manifests, [names[2]])
    assert cli(["gc", str(out), "--keep", "1", "--json", str(out.parent / "gc.json")]) == 0
    assert published(out) == [names[2]]
    assert {s: set(f) for s, f in _files(out).items()} == expected
    assert json.loads((out.parent / "gc.json").read_text())["snapshots_removed"] == [names[0]]
    assert cli(["unpin", str(out), names[0]]) == 2  # not pinned: one error line


def _gc_process(out: Path, pause_after: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, PAUSE_ENV: str(pause_after), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "latentmill.cli", "gc", str(out), "--keep", "1"], env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def _wait_for(log: Path, text: str, proc: subprocess.Popen, seconds: float = 120) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        content = log.read_text() if log.is_file() else ""
        if text in content:
            return content
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}: {content}"
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not seen in {seconds} s: {log.read_text()}")


def test_sigkill_in_the_middle_of_gc_loses_nothing(output, tmp_path):
    out, _, manifests = output
    names = published(out)
    def remaining() -> tuple[int, int]:
        plan = plan_gc(out, 1)
        records = sum(1 for v in plan.remove.values() for p in v if p.parent.name == "units")
        return len(plan.snapshots_removed) + sum(len(v) for v in plan.remove.values()), records

    removals, records = remaining()
    assert removals > 12 and records >= 4  # room for three distinct pause points
    expected = _expected(out, manifests, [names[-1]])
    # stopped after the first snapshot is out of sight; then among the unit records; then among the shards
    for i, pause in enumerate((lambda n, r: 1, lambda n, r: r // 2, lambda n, r: n - 2)):
        count = pause(*remaining())
        log = tmp_path / f"gc-{i}.log"
        proc = _gc_process(out, count, log)
        _wait_for(log, f"paused after {count} removals", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _assert_readable(out, published(out))  # whatever is still published reads whole
        assert latest_name(out) == names[-1]
    report = gc(out, 1)  # the next gc finishes the work
    assert published(out) == [names[-1]] and report["freed_files"] > 0
    assert not list((out / "snapshots").glob(".trash-*"))
    assert {s: set(f) for s, f in _files(out).items()} == expected
    _assert_readable(out, [names[-1]])


_HOLD_PIN = """
import sys, time
from latentmill.pipelines.retention import pinned_for_training
with pinned_for_training(sys.argv[1], sys.argv[2]) as folder:
    print("pinned", folder.name, flush=True)
    time.sleep(3600)
"""


def test_a_training_pin_protects_while_its_process_lives(output, tmp_path, capsys):
    out, _, _ = output
    names = published(out)
    log = tmp_path / "pin.log"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_PIN, str(out), names[0]], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        _wait_for(log, f"pinned {names[0]}", proc)
        assert gc(out, 1)["pinned"] == [names[0]]
        assert published(out) == [names[0], names[2]]
        _assert_readable(out, [names[0]])
    finally:
        proc.kill()
        proc.wait(timeout=30)
    capsys.readouterr()
    report = gc(out, 1)  # the pin's process is gone: its pin is stale
    assert f"dropping the stale pin {names[0]}@" in capsys.readouterr().out
    assert report["snapshots_removed"] == [names[0]] and published(out) == [names[2]]
    assert not list((out / "pins").glob("*.pin"))


def test_training_pins_the_snapshot_it_reads(output, tiny_flux, tmp_path):
    """A gc during a real training run (from its step callback) keeps the run's snapshot; after it, not."""
    from latentmill.pipelines.launch import train_recipe

    out, source, _ = output
    names = published(out)
    recipe = _recipe(out, source, tiny_flux, f"snapshot={names[0]}", "trainer.max_steps=3", "trainer.batch_size=1",
                     "trainer.export=false", "trainer.save_every=0", "trainer.log_every=1")
    reports = []

    def collect(record):
        if not reports:
            reports.append(gc(out, 1))

    summary = train_recipe(recipe, tmp_path / "run", progress=False, on_step=collect)
    assert summary["steps"] == 3
    assert reports[0]["pinned"] == [names[0]] and reports[0]["snapshots_removed"] == [names[1]]
    assert not list((out / "pins").glob("*.pin"))  # the pin ends with the run
    assert gc(out, 1)["snapshots_removed"] == [names[0]]


def test_refresh_flow_runs_gc_after_publishing(output, tiny_flux):
    """``retention.keep_snapshots`` in the recipe: the refresh flow publishes, then collects (``result["gc"]``)."""
    from latentmill.pipelines.flows import refresh

    out, source, manifests = output
    names = published(out)
    expected = _expected(out, manifests, names[-1:])
    overrides = [f"output_dir={out}", f"model.pretrained={tiny_flux}", f"ingest.source={source}"]
    assert "gc" not in refresh(str(DEMO_CONFIG), overrides)  # null by default: nothing is removed
    assert published(out) == names
    result = refresh(str(DEMO_CONFIG), [*overrides, "retention.keep_snapshots=1"])
    assert result["snapshot"] == {"name": names[-1], "new": False, "path": str(out / "snapshots" / names[-1])}
    assert result["gc"]["snapshots_removed"] == names[:-1] and published(out) == names[-1:]
    assert {s: set(f) for s, f in _files(out).items()} == expected
    _assert_readable(out, names[-1:])


# ---------------------------------------------------------------------------------------------------------
# The same output on an object store
# ---------------------------------------------------------------------------------------------------------


def _on_store(out: Path, bucket: str, scheme: str = "s3") -> str:
    """The output_dir uploaded to the store in publishing order (as a prep there leaves it); its URL."""
    url = f"{scheme}://{bucket}/out"
    objectstore.push(out, url)
    return url


def _store_snapshots(bucket: str, scheme: str = "s3") -> list[str]:
    fs = store(scheme)
    return sorted(p.split("/")[-2] for p in fs.find(f"{bucket}/out/snapshots", refresh=True)
                  if p.endswith("/manifest.json"))


def _store_files(bucket: str, scheme: str = "s3") -> dict[str, set[str]]:
    """``_files`` of the store's objects: every gc-managed object per stage, by its name below the stage."""
    fs = store(scheme)
    objects = [p.removeprefix(f"{bucket}/out/prep/").split("/") for p in fs.find(f"{bucket}/out/prep", refresh=True)]
    return {stage: {"/".join(parts[1:]) for parts in objects if parts[0] == stage and (
        (len(parts) == 3 and parts[1] in ("units", "shards")) or (len(parts) == 2 and parts[1].startswith(
            "empty_prompt-")))} for stage in STAGES}


def test_pin_and_unpin_on_a_store_keep_a_snapshot_through_gc_there(output, store_bucket, capsys):
    from latentmill.cli import main as cli

    out, _, manifests = output
    scheme, bucket = store_bucket
    names = published(out)
    expected = _expected(out, manifests, [names[2]])
    url = _on_store(out, bucket, scheme)
    assert cli(["pin", url, names[0]]) == 0
    assert cli(["pin", url]) == 0
    assert f"{names[0]}: pinned by user" in capsys.readouterr().out
    assert cli(["gc", url, "--keep", "1"]) == 0
    assert _store_snapshots(bucket, scheme) == [names[0], names[2]]
    assert cli(["verify", url]) == 0
    assert cli(["unpin", url, names[0]]) == 0
    capsys.readouterr()
    assert cli(["gc", url, "--keep", "1"]) == 0
    assert "deleted " in capsys.readouterr().out
    assert _store_snapshots(bucket, scheme) == [names[2]]
    assert _store_files(bucket, scheme) == expected  # what a local gc --keep 1 keeps
    assert not list(work_dir_for(url).rglob("*.tar"))  # and gc downloaded no tar (stages.remotetars)
    assert cli(["verify", url]) == 0
    assert cli(["unpin", url, names[0]]) == 2  # not pinned: one error line
    assert cli(["pin", url, "0099-absent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == (f"latentmill: error: snapshot '0099-absent' not found under {url}/snapshots; "
                                    f"`latentmill inspect {url}` lists the published ones")
    assert store(scheme).find(f"{bucket}/out/pins", refresh=True) == []


_HOLD_STORE_PIN = """
import sys, time
from latentmill.pipelines.objectstore import pinned_on_store
with pinned_on_store(sys.argv[1], sys.argv[2], lease_s=float(sys.argv[3])) as name:
    print("pinned", name, flush=True)
    time.sleep(3600)
"""


def test_a_training_lease_pin_on_a_store_protects_while_its_holder_lives_and_lapses_when_killed(
        output, s3_bucket, tmp_path, capsys):
    from latentmill.cli import main as cli

    out, _, _ = output
    names = published(out)
    url = _on_store(out, s3_bucket)
    lease_s = 3.0
    log = tmp_path / "pin.log"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_STORE_PIN, url, names[0], str(lease_s)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    fs = store("s3")
    try:
        _wait_for(log, f"pinned {names[0]}", proc)
        assert cli(["pin", url]) == 0
        assert f"{names[0]}: training PID {proc.pid} on " in capsys.readouterr().out
        report = objectstore.gc_store(url, 1)
        assert report["pinned"] == [names[0]] and report["snapshots_removed"] == [names[1]]
        time.sleep(lease_s + 0.5)  # past one lease: renewed by its living holder
        assert list(objectstore.store_pins(url)) == [names[0]]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    (pin,) = fs.find(f"{s3_bucket}/out/pins", refresh=True)
    time.sleep(max(0.0, json.loads(fs.cat_file(pin))["expires"] - time.time()) + 0.1)  # its lease runs out
    capsys.readouterr()
    report = objectstore.gc_store(url, 1)
    assert f"gc: dropping the stale pin {names[0]}@" in capsys.readouterr().out
    assert report["pinned"] == [] and report["snapshots_removed"] == [names[0]]
    assert _store_snapshots(s3_bucket) == [names[2]]
    assert fs.find(f"{s3_bucket}/out/pins", refresh=True) == []


def test_a_training_run_streaming_from_a_store_pins_its_snapshot_there(output, s3_bucket, tiny_flux):
    """A gc on the store during a real training run that streams from it (started once the run's pin is there)
    keeps the run's snapshot; the pin goes with the run, and the next gc removes the snapshot."""
    from latentmill.pipelines.flows import train

    out, source, _ = output
    names = published(out)
    url = _on_store(out, s3_bucket)
    overrides = [f"output_dir={url}", f"model.pretrained={tiny_flux}", f"ingest.source={source}",
                 f"snapshot={names[0]}", "trainer.max_steps=3", "trainer.batch_size=1", "trainer.export=false",
                 "trainer.save_every=0", "trainer.log_every=1"]
    reports: list[dict] = []
    done = threading.Event()

    def gc_once_pinned() -> None:
        while not done.is_set() and not reports:
            if objectstore.store_pins(url):
                reports.append(objectstore.gc_store(url, 1))
            time.sleep(0.1)

    watcher = threading.Thread(target=gc_once_pinned)
    watcher.start()
    try:
        summary = train(str(DEMO_CONFIG), overrides)["train"]
    finally:
        done.set()
        watcher.join()
    assert summary["steps"] == 3
    assert reports[0]["pinned"] == [names[0]] and reports[0]["snapshots_removed"] == [names[1]]
    assert objectstore.store_pins(url) == {}  # the pin ends with the run
    assert store("s3").find(f"{s3_bucket}/out/pins", refresh=True) == []
    assert objectstore.gc_store(url, 1)["snapshots_removed"] == [names[0]]
    assert _store_snapshots(s3_bucket) == [names[2]]


def test_refresh_flow_on_a_store_runs_gc_there(output, s3_bucket, tiny_flux):
    """``retention.keep_snapshots`` with ``output_dir`` on a store: the refresh preps there (every unit reused),
    then collects there what a local gc keeps."""
    from latentmill.pipelines.flows import refresh

    from latentmill.cli import main as cli

    out, source, manifests = output
    names = published(out)
    expected = _expected(out, manifests, names[-1:])
    url = _on_store(out, s3_bucket)
    result = refresh(str(DEMO_CONFIG), [f"output_dir={url}", f"model.pretrained={tiny_flux}", f"ingest.source={source}",
                                        "retention.keep_snapshots=1"])
    assert result["snapshot"]["name"] == names[-1] and not result["snapshot"]["new"]
    assert result["gc"]["snapshots_removed"] == names[:-1] and result["gc"]["store"]["deleted"] > 0
    assert _store_snapshots(s3_bucket) == names[-1:]
    assert store("s3").cat_file(f"{s3_bucket}/out/snapshots/{LATEST}").decode().strip() == names[-1]
    assert _store_files(s3_bucket) == expected
    assert cli(["verify", url]) == 0
