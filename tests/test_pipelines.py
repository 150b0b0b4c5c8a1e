"""The prep flow as users run it: incremental re-runs, snapshots, refresh, artifacts, task runners."""

from __future__ import annotations

import json
import shutil

import pytest
from prefect import flow, task

from latentmill.inspect import verify_path
from latentmill.recipe import load_recipe
from pipelines.flows import refresh
from pipelines.prep import run_prep
from pipelines.snapshot import latest_name, resolve_snapshot
from tests.conftest import DEMO_CONFIG

pytestmark = pytest.mark.slow


def _recipe(tiny_flux, images, out, *extra):
    return load_recipe(DEMO_CONFIG, [f"output_dir={out}", f"model.pretrained={tiny_flux}",
                                     f"ingest.source={images}", *extra])


def _processed(result):
    return {name: (s["processed"], s["reused"]) for name, s in result["stages"].items()}


def test_incremental_reruns_and_snapshots(tiny_flux, demo_images, tmp_path):
    out = tmp_path / "out"
    first = run_prep(_recipe(tiny_flux, demo_images, out))
    assert first["snapshot"]["new"] and first["snapshot"]["name"].startswith("0001-")

    again = run_prep(_recipe(tiny_flux, demo_images, out))
    assert _processed(again) == {"ingest": (0, 26), "caption": (0, 25), "bucket": (0, 25), "cache": (0, 25)}
    assert again["snapshot"] == {**first["snapshot"], "new": False}

    # A changed bucket option re-runs bucket and cache, not ingest or caption; text embeddings are reused.
    rebucket = run_prep(_recipe(tiny_flux, demo_images, out, "bucket.resolution=96"))
    assert _processed(rebucket)["ingest"] == (0, 26) and _processed(rebucket)["caption"] == (0, 25)
    assert _processed(rebucket)["bucket"] == (25, 0)
    assert rebucket["stages"]["cache"]["components"] == {"vae": {"processed": 24, "reused": 0},
                                                         "text": {"processed": 0, "reused": 24}}
    second = rebucket["snapshot"]
    assert second["new"] and second["name"].startswith("0002-")
    manifest = json.loads((resolve_snapshot(out, "latest") / "manifest.json").read_text())
    assert manifest["snapshot"]["parent"] == first["snapshot"]["name"]
    assert set(manifest["snapshot"]["buckets"]) == {"96x96x1", "80x112x1", "112x80x1", "128x64x1", "64x128x1"}
    # The older snapshot still resolves and every shard it names is intact.
    assert verify_path(resolve_snapshot(out, first["snapshot"]["name"])) == 0
    with pytest.raises(FileNotFoundError, match="snapshot 'nope' not found"):
        resolve_snapshot(out, "nope")


def test_inspect_prints_a_snapshot_report(tiny_flux, demo_images, tmp_path, capsys):
    from latentmill.inspect import inspect_path

    out = tmp_path / "out"
    name = run_prep(_recipe(tiny_flux, demo_images, out))["snapshot"]["name"]
    capsys.readouterr()
    assert inspect_path(resolve_snapshot(out, "latest")) == 0
    report = capsys.readouterr().out
    manifest = json.loads((resolve_snapshot(out, "latest") / "manifest.json").read_text())
    assert f"snapshot {name}" in report and "24 samples" in report
    assert f"{manifest['snapshot']['bytes'] / 1e6:.2f} MB" in report
    assert "128x128x1: 8" in report
    assert f"vae: AutoencoderKL fingerprint {manifest['models']['vae']['fingerprint'][:16]}" in report
    assert "quarantined at ingest: 1 × not a readable image" in report
    assert "quarantined at cache: 1 × cannot decode pixels" in report


def test_refresh_trains_only_on_a_new_snapshot(tiny_flux, demo_images, tmp_path):
    out = tmp_path / "out"
    overrides = [f"output_dir={out}", f"model.pretrained={tiny_flux}", f"ingest.source={demo_images}",
                 "trainer.max_steps=2", "trainer.save_every=0"]
    first = refresh(str(DEMO_CONFIG), overrides, train=True)
    assert first["train"]["steps"] == 2 and first["snapshot"]["new"]
    unchanged = refresh(str(DEMO_CONFIG), overrides, train=True)
    assert "train" not in unchanged and not unchanged["snapshot"]["new"]

    shutil.copy(demo_images / "img_001.jpg", demo_images / "zz_new.jpg")
    (demo_images / "zz_new.txt").write_text("a newly added picture\n")
    grown = refresh(str(DEMO_CONFIG), overrides, train=True)
    assert grown["snapshot"]["new"] and grown["stages"]["cache"]["out"] == 25
    # only the new file's work: one new unit per stage, every other unit reused without a task run
    assert _processed(grown) == {"ingest": (1, 26), "caption": (1, 25), "bucket": (1, 25), "cache": (1, 25)}
    assert {s: grown["stages"][s]["units"] for s in ("ingest", "cache")} == {
        s: unchanged["stages"][s]["units"] + 1 for s in ("ingest", "cache")}
    assert grown["train"]["steps"] == 2
    assert latest_name(out) == grown["snapshot"]["name"]
    from stages.families import _encoders

    assert not _encoders  # prep's encoders were let go before training in this process


def test_prep_publishes_artifacts(tiny_flux, demo_images, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    run_prep(_recipe(tiny_flux, demo_images, tmp_path / "out"))
    with get_client(sync_client=True) as client:
        counts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prep-counts"])))
        buckets = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prep-buckets"])))
        quarantine = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prep-quarantine"])))
    def newest(artifacts):  # other tests of this session published artifacts under the same keys
        data = max(artifacts, key=lambda a: a.created).data
        return json.loads(data) if isinstance(data, str) and data[:1] in "[{" else data

    rows = newest(counts)
    assert [r["stage"] for r in rows] == ["ingest", "caption", "bucket", "cache"]
    assert rows[0]["in"] == 26 and rows[3]["out"] == 24
    assert "128x128x1" in newest(buckets)
    reasons = newest(quarantine)
    assert {r["stage"] for r in reasons} == {"ingest", "cache"}


def _shard_digests(out):
    digests = {}
    for stage in ("ingest", "caption", "bucket", "cache"):
        manifest = json.loads((out / "prep" / stage / "manifest.json").read_text())
        digests[stage] = [(s["name"], s["sha256"]) for s in manifest["shards"]]
    return digests


@task
def _worker_number(_: int) -> tuple[int, str | None]:
    import os
    import time

    time.sleep(0.2)  # long enough for the pool to start both workers
    return os.getpid(), os.environ.get("LATENTMILL_WORKER_INDEX")


def test_process_workers_are_numbered_once_each():
    """The processes runner numbers its worker processes 0, 1, ... (one GPU each, stages.workers)."""
    from latentmill.recipe import RunnerConfig
    from pipelines.prep import task_runner

    @flow(task_runner=task_runner(RunnerConfig(kind="processes", workers=2)))
    def numbered() -> list[tuple[int, str | None]]:
        return [future.result() for future in _worker_number.map(range(6))]

    by_pid = {}
    for pid, number in numbered():
        by_pid.setdefault(pid, set()).add(number)
    assert all(len(numbers) == 1 for numbers in by_pid.values())  # a worker keeps its number
    assert sorted(n for numbers in by_pid.values() for n in numbers) == [str(i) for i in range(len(by_pid))]
    assert len(by_pid) == 2


@pytest.mark.parametrize("kind", ["processes", "dask", "ray"])
def test_other_runners_write_identical_bytes(tiny_flux, demo_images, tmp_path, kind):
    if kind in ("dask", "ray"):
        pytest.importorskip(f"prefect_{kind}")
    threads = run_prep(_recipe(tiny_flux, demo_images, tmp_path / "threads"))
    other = run_prep(_recipe(tiny_flux, demo_images, tmp_path / kind, f"runner.kind={kind}", "runner.workers=2"))
    assert _processed(other) == _processed(threads)
    assert _shard_digests(tmp_path / kind) == _shard_digests(tmp_path / "threads")


def test_progress_artifacts_follow_stages_with_several_task_runs(tiny_flux, demo_images, tmp_path):
    """A stage whose pending work spans several task runs shows a progress artifact that ends at 100%; a
    refresh whose new data is one task run per stage creates none (two API calls per stage saved)."""
    import datetime

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

    from pipelines.prep import plan_stage, task_chunks

    def progress_since(start):
        with get_client(sync_client=True) as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])))
        return sorted((a.description, a.data) for a in found if a.created >= start)

    # one unit per task run: the demo's 26 inputs alone are too few to split (MIN_TASK_SAMPLES)
    recipe = _recipe(tiny_flux, demo_images, tmp_path / "out", "runner.units_per_task=1")
    start = datetime.datetime.now(datetime.timezone.utc)
    run_prep(recipe)
    first = progress_since(start)
    several = [stage for stage in ("ingest", "caption", "bucket", "cache")
               if len(task_chunks(plan_stage(stage, recipe), recipe.runner)) > 1]
    assert "cache" in several  # one unit per bucket shard
    assert first == sorted((f"{stage}: samples done", 100.0) for stage in several)

    shutil.copy(demo_images / "img_001.jpg", demo_images / "zz_new.jpg")
    (demo_images / "zz_new.txt").write_text("a newly added picture\n")
    start = datetime.datetime.now(datetime.timezone.utc)
    grown = run_prep(recipe)
    assert _processed(grown)["cache"][0] == 1  # one new sample, encoded in one task run
    assert progress_since(start) == []
