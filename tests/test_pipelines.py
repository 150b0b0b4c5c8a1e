"""The prep flow as users run it: incremental re-runs, snapshots, refresh, artifacts, task runners."""

from __future__ import annotations

import json

import pytest
from latentmill.pipelines.flows import refresh
from latentmill.pipelines.prep import run_prep
from latentmill.pipelines.snapshot import latest_name, resolve_snapshot
from PIL import Image
from prefect import flow, task

from latentmill.inspect import verify_path
from latentmill.recipe import load_recipe
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
    assert _processed(again) == {"ingest": (0, 26), "caption": (0, 25), "curate": (0, 25), "bucket": (0, 24),
                                 "cache": (0, 24)}
    assert again["snapshot"] == {**first["snapshot"], "new": False}

    # A changed bucket option re-runs bucket and cache, not ingest or caption; text embeddings are reused.
    rebucket = run_prep(_recipe(tiny_flux, demo_images, out, "bucket.resolution=96"))
    assert _processed(rebucket)["ingest"] == (0, 26) and _processed(rebucket)["caption"] == (0, 25)
    assert _processed(rebucket)["bucket"] == (24, 0)
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
    assert "quarantined at curate: 1 × cannot decode pixels" in report  # truncated.jpg, where it is decoded


def test_refresh_trains_only_on_a_new_snapshot(tiny_flux, demo_images, tmp_path):
    out = tmp_path / "out"
    overrides = [f"output_dir={out}", f"model.pretrained={tiny_flux}", f"ingest.source={demo_images}",
                 "trainer.max_steps=2", "trainer.save_every=0"]
    first = refresh(str(DEMO_CONFIG), overrides, train=True)
    assert first["train"]["steps"] == 2 and first["snapshot"]["new"]
    unchanged = refresh(str(DEMO_CONFIG), overrides, train=True)
    assert "train" not in unchanged and not unchanged["snapshot"]["new"]

    # a new picture (a plain copy would be an exact duplicate, which the curate stage drops)
    with Image.open(demo_images / "img_001.jpg") as img:
        img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(demo_images / "zz_new.jpg", quality=90)
    (demo_images / "zz_new.txt").write_text("a newly added picture\n")
    grown = refresh(str(DEMO_CONFIG), overrides, train=True)
    assert grown["snapshot"]["new"] and grown["stages"]["cache"]["out"] == 25
    # only the new file's work: one new unit per stage, every other unit reused without a task run
    assert _processed(grown) == {"ingest": (1, 26), "caption": (1, 25), "curate": (1, 25), "bucket": (1, 24),
                                 "cache": (1, 24)}
    assert {s: grown["stages"][s]["units"] for s in ("ingest", "cache")} == {
        s: unchanged["stages"][s]["units"] + 1 for s in ("ingest", "cache")}
    assert grown["train"]["steps"] == 2
    assert latest_name(out) == grown["snapshot"]["name"]
    from latentmill.stages.families import _encoders

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
    assert [r["stage"] for r in rows] == ["ingest", "caption", "curate", "bucket", "cache"]
    assert rows[0]["in"] == 26 and rows[4]["out"] == 24
    assert "128x128x1" in newest(buckets)
    reasons = newest(quarantine)
    assert {r["stage"] for r in reasons} == {"ingest", "curate"}


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


def _api_servers_started_here() -> set[int]:
    """The PIDs of the Prefect API servers this process started (its children running Prefect's server app)."""
    import os
    from pathlib import Path

    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"prefect.server.api.server" in (stat.parent / "cmdline").read_bytes():
                found.add(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_process_workers_are_numbered_once_each():
    """The processes runner numbers its worker processes 0, 1, ... (one GPU each, stages.workers); it starts no
    second temporary API server (Prefect's message forwarder thread did, where it read the settings of Prefect's
    import, without the URL of the server this process uses)."""
    from latentmill.pipelines.prep import task_runner

    from latentmill.recipe import RunnerConfig

    @flow(task_runner=task_runner(RunnerConfig(kind="processes", workers=2)))
    def numbered() -> list[tuple[int, str | None]]:
        return [future.result() for future in _worker_number.map(range(6))]

    servers = _api_servers_started_here()
    by_pid = {}
    for pid, number in numbered():
        by_pid.setdefault(pid, set()).add(number)
    assert all(len(numbers) == 1 for numbers in by_pid.values())  # a worker keeps its number
    assert sorted(n for numbers in by_pid.values() for n in numbers) == [str(i) for i in range(len(by_pid))]
    assert len(by_pid) == 2
    assert _api_servers_started_here() == servers


@pytest.fixture(scope="module")
def threads_prep(tiny_flux, tmp_path_factory):
    """The demo prepped once on the default threads runner: the bytes every other runner must write, from the
    same images folder (the demo's, as ``demo_images`` copies it)."""
    import shutil

    from tests.conftest import DEMO_IMAGES

    root = tmp_path_factory.mktemp("runners")
    images = root / "images"
    shutil.copytree(DEMO_IMAGES, images, ignore=shutil.ignore_patterns("overexposed_*"))
    result = run_prep(_recipe(tiny_flux, images, root / "threads"))
    return images, _processed(result), _shard_digests(root / "threads")


@pytest.mark.parametrize("kind", ["processes", pytest.param("ray", marks=pytest.mark.heavy),  # beside processes
                                  pytest.param("dask", marks=pytest.mark.heavy)])
def test_other_runners_write_identical_bytes(tiny_flux, threads_prep, tmp_path, kind):
    """Each runner writes the threads runner's bytes. Dask and Ray take the same path here (a Prefect
    integration's task runner over worker processes, made in ``task_runner``): make test runs Ray (the quicker
    to start), make test-all Dask too."""
    if kind in ("dask", "ray"):
        pytest.importorskip(f"prefect_{kind}")
    images, processed, digests = threads_prep
    other = run_prep(_recipe(tiny_flux, images, tmp_path / kind, f"runner.kind={kind}", "runner.workers=2"))
    assert _processed(other) == processed
    assert _shard_digests(tmp_path / kind) == digests


def test_progress_artifacts_follow_stages_with_several_task_runs(tiny_flux, demo_images, tmp_path):
    """A stage whose pending work spans several task runs shows a progress artifact that ends at 100%; a
    refresh whose new data is one task run per stage creates none (two API calls per stage saved)."""
    import datetime

    from latentmill.pipelines.prep import plan_stage, task_chunks
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

    def progress_since(start):
        with get_client(sync_client=True) as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])))
        return sorted((a.description, a.data) for a in found if a.created >= start)

    # one unit per task run: the demo's 26 inputs alone are too few to split (MIN_TASK_SAMPLES)
    recipe = _recipe(tiny_flux, demo_images, tmp_path / "out", "runner.units_per_task=1")
    start = datetime.datetime.now(datetime.timezone.utc)
    run_prep(recipe)
    first = progress_since(start)
    several = [stage for stage in ("ingest", "caption", "curate", "bucket", "cache")
               if len(task_chunks(plan_stage(stage, recipe), recipe.runner)) > 1]
    assert "cache" in several  # one unit per bucket shard
    assert first == sorted((f"{stage}: samples done", 100.0) for stage in several)

    # a new picture (a plain copy would be an exact duplicate, which the curate stage drops)
    with Image.open(demo_images / "img_001.jpg") as img:
        img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(demo_images / "zz_new.jpg", quality=90)
    (demo_images / "zz_new.txt").write_text("a newly added picture\n")
    start = datetime.datetime.now(datetime.timezone.utc)
    grown = run_prep(recipe)
    assert _processed(grown)["cache"][0] == 1  # one new sample, encoded in one task run
    assert progress_since(start) == []


def _poll(read, done, timeout=60.0):
    """``read()`` again until ``done(value)``: task runs arrive as events and logs in batches."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


@pytest.fixture()
def run_logs_at_info():
    """Send INFO lines of flow and task runs to the API (conftest sets PREFECT_LOGGING_LEVEL=WARNING)."""
    import logging

    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def test_started_run_tells_the_story(tiny_flux, demo_images, tmp_path, run_logs_at_info):
    """The run the user starts (here prep-then-train) carries the prep artifacts, one log line per stage and
    the training metrics; the inner prep-stages run has the artifacts and lines too; task runs are named by
    what they do."""
    import functools

    from latentmill.pipelines.flows import prep_then_train
    from latentmill.pipelines.prep import STAGES, plan_stage, task_chunks, units_run_name
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    out = tmp_path / "out"
    overrides = [f"output_dir={out}", f"model.pretrained={tiny_flux}", f"ingest.source={demo_images}",
                 "trainer.max_steps=2", "trainer.save_every=0"]
    state = prep_then_train(str(DEMO_CONFIG), overrides, return_state=True)
    assert state.is_completed()
    started, result = state.state_details.flow_run_id, state.result()
    with get_client(sync_client=True) as client:
        inner = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[started])))
        assert [run.flow_id for run in inner] == [client.read_flow_by_name("prep-stages").id]
        inner_id = inner[0].id

        def artifacts(run_id):
            found = client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
            return {a.key: json.loads(a.data) if a.type == "table" else a.data for a in found}

        def lines(run_id):
            return [log.message for log in client.read_logs(log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[run_id])))]

        def task_run_names():
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[started, inner_id])))
            return {run.name for run in runs}

        recipe = _recipe(tiny_flux, demo_images, out)
        expected = {units_run_name({"stage": stage, "unit_ids": [u.unit_id for u in chunk],
                                    "samples": sum(u.samples_in for u in chunk)})
                    for stage in STAGES for chunk in task_chunks(plan_stage(stage, recipe), recipe.runner)}
        expected.add("train · 2 steps · full")
        names = _poll(task_run_names, lambda names: expected <= names)
        assert expected <= names, names
        assert any(n.startswith("ingest · ") and n.endswith(" units · 26 samples") for n in names), names
        assert not any(n.startswith("run-units") or n.startswith("train-model") for n in names)

        stage_lines = [f"{stage}: {s['in']} in → {s['out']} out, {s['quarantined']} quarantined; "
                       f"{s['processed']} processed, {s['reused']} reused" for stage, s in result["stages"].items()]
        assert stage_lines[-1].startswith("cache: 24 in → 24 out, 0 quarantined; 24 processed, 0 reused")
        for run_id in (started, inner_id):
            logged = _poll(functools.partial(lines, run_id),
                           lambda got: all(any(m.startswith(s) for m in got) for s in stage_lines))
            for line in stage_lines:
                assert sum(m.startswith(line) for m in logged) == 1, (line, logged)

            found = artifacts(run_id)
            assert [row["stage"] for row in found["prep-counts"]] == list(STAGES)
            assert found["prep-counts"][4]["out"] == 24
            assert "128x128x1" in found["prep-buckets"]
            assert {row["stage"] for row in found["prep-quarantine"]} == {"ingest", "curate"}

        metrics = artifacts(started)["train-metrics"]
        assert metrics == [{k: result["train"][k] for k in ("steps", "final_loss", "samples_per_s",
                                                             "data_wait_fraction", "peak_rss_mb", "export_dir")}]
        assert metrics[0]["steps"] == 2 and metrics[0]["export_dir"] == str(out / "export")
        assert "train-metrics" not in artifacts(inner_id)
        def trained(got):
            return any(m.startswith("train: 2 steps, final loss ") for m in got)

        assert trained(_poll(functools.partial(lines, started), trained))


def test_training_progress_reports_sparsely(monkeypatch):
    """Training progress costs a few API calls per run, not one per step: the progress artifact moves at most
    every 5% and every interval, the last step is reported by finish() with the metrics table."""
    import latentmill.pipelines.report as report
    from prefect import flow

    calls = []
    monkeypatch.setattr(report, "create_progress_artifact", lambda p, **kw: calls.append(("create", p)) or "id")
    monkeypatch.setattr(report, "update_progress_artifact", lambda i, p: calls.append(("update", p)))
    monkeypatch.setattr(report, "create_table_artifact", lambda rows, **kw: calls.append(("table", rows)))

    @flow
    def training(max_steps: int, seconds_per_step: int) -> None:
        now = [0.0]
        progress = report.TrainProgress(max_steps, interval_s=5.0, clock=lambda: now[0])
        for step in range(1, max_steps + 1):
            now[0] = step * seconds_per_step
            progress({"step": step, "loss": 0.5, "samples_per_s": 10.0})
        progress.finish({"steps": max_steps, "final_loss": 0.5, "samples_per_s": 10.0, "data_wait_fraction": 0.01,
                         "peak_rss_mb": 100.0, "export_dir": "/x/export"})

    training(1000, 1)  # 1 s a step: every 5% (50 steps) is the binding limit
    assert calls[0] == ("create", 5.0) and calls[-2] == ("update", 100.0)
    assert [p for _, p in calls[1:-2]] == [5.0 * i for i in range(2, 20)]
    assert calls[-1] == ("table", [{"steps": 1000, "final_loss": 0.5, "samples_per_s": 10.0,
                                     "data_wait_fraction": 0.01, "peak_rss_mb": 100.0, "export_dir": "/x/export"}])
    calls.clear()
    training(20, 1)  # a short run (20 s): updates every 5 s at the most, 25% apart
    assert [p for _, p in calls[:-1]] == [25.0, 50.0, 75.0, 100.0]
    calls.clear()
    training(3, 1)  # shorter than the interval: no progress artifact, only the metrics
    assert [kind for kind, _ in calls] == ["table"]


def test_metrics_follower_reads_the_last_whole_line_of_this_run(tmp_path):
    import os

    from latentmill.pipelines.flows import MetricsFollower

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 7}\n')  # a previous run's line: not this run's progress
    follower = MetricsFollower(path)
    assert follower.last_record() is None
    os.replace(path, tmp_path / "metrics.previous.jsonl")  # what a fresh start does
    assert follower.last_record() is None
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')  # a line half written
    assert follower.last_record() == {"step": 2}
    with open(path, "a") as fh:
        fh.write('ep": 3}\n')
    assert follower.last_record() == {"step": 3}
