"""Trackers and the model card: one tiny training run logs to TensorBoard, W&B (offline) and a real MLflow
tracking server on loopback at once, then exports a LoRA with its card; each test reads one of them back."""

import json
import logging
import os
import struct
import sys
from pathlib import Path

import pytest
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.card import model_card, public, trigger_phrase
from latentmill.trainer.trackers import TrackerError, flatten, scalars, start_trackers

from latentmill.core.config import ConfigError
from tests.helpers import free_port, loopback_server
from tests.trainer_helpers import add_validation_prompts, read_metrics, torch_threads, write_fake_cache

PREP = {"stages": {"ingest": {"in": 6, "out": 5, "quarantined": 1}, "cache": {"in": 4, "out": 4, "quarantined": 0}},
        "captioner": "/home/someone/models/blip", "curation": {"scorers": ["sharpness"],
                                                              "thresholds": {"min_sharpness": 20.0}}}
PROVENANCE = {"snapshot": "0003-abcdef012345", "snapshot_content_id": "abcdef0123456789" * 4, "run": "r1"}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 with a SQLite store in a temporary folder; stopped afterwards."""
    pytest.importorskip("mlflow")
    root, port = tmp_path_factory.mktemp("mlflow"), free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts")]
    uri = f"http://127.0.0.1:{port}"
    with loopback_server(cmd, f"{uri}/health", "mlflow server", timeout=180, poll=0.5, log=root / "server.log",
                         env=env):
        yield uri


@pytest.fixture(scope="module")
def tracked(tiny_flux, mlflow_server, tmp_path_factory):
    """One LoRA run of 2 steps with a validation at step 2, logged to all three trackers and exported."""
    root = tmp_path_factory.mktemp("tracked")
    cache = root / "cache"
    manifest = write_fake_cache(cache, {(32, 32, 1): 4}, seq_len=16, smooth=True)
    manifest["snapshot"] = {"name": PROVENANCE["snapshot"], "samples": 4, "buckets": {"32x32x1": 4}, "prep": PREP}
    manifest["shards"][0]["held_out"] = [3]  # one held-out sample: the evaluation's losses go to every tracker
    (cache / "manifest.json").write_text(json.dumps(manifest))
    add_validation_prompts(cache, str(tiny_flux), ["a red square"], max_sequence_length=16)  # as a prep does
    cfg = TrainerConfig(max_steps=2, batch_size=2, learning_rate=1e-3, save_every=0, mode="lora", lora_rank=4,
                        validate_every=2, validation_prompts=["a red square"], validation_steps=1,
                        validation_size=[32, 32], trackers=["tensorboard", "wandb", "mlflow"],
                        tracker_project="latentmill-test", license="apache-2.0")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": mlflow_server}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with torch_threads(1):
            summary = train(cfg, cache_dir=cache, pretrained=str(tiny_flux), train_dir=root / "run", seed=0,
                            progress=False, provenance=PROVENANCE, recipe={"trainer": {"max_steps": 2}, "seed": 0})
    finally:
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return summary, root / "run", mlflow_server


def _wandb_records(run_dir: Path):
    """The records of a W&B run's transaction log (``run-<id>.wandb``: LevelDB log blocks of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    found = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(found) == 1, sorted(str(p) for p in run_dir.rglob("*"))[:40]
    path = found[0]
    data, block, records, pending = path.read_bytes(), 32768, [], b""
    pos = 7  # ":W&B", a 2-byte magic, a 1-byte version
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _unflatten(items) -> dict:
    """W&B's items (a ``key``, or a ``nested_key`` path, and a JSON value) as one nested dict."""
    out: dict = {}
    for item in items:
        *parents, last = [item.key] if item.key else list(item.nested_key)
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = json.loads(item.value_json)
    return out


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_images_and_recipe(tracked):
    summary, run_dir, _ = tracked
    assert sorted(summary["trackers"]) == ["mlflow", "tensorboard", "wandb"]  # every one started
    records = _wandb_records(run_dir)
    history = [_unflatten(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert losses == pytest.approx([r["loss"] for r in read_metrics(run_dir)])
    assert [h["_step"] for h in history if "train/loss" in h] == [1, 2]
    (evaluated,) = [r["eval"] for r in read_metrics(run_dir) if "eval" in r]
    assert [(h["_step"], h["eval/loss"], h["eval/loss_0.5"]) for h in history if "eval/loss" in h] == \
        [(2, pytest.approx(evaluated["loss"]), pytest.approx(evaluated["loss_0.5"]))]
    (image,) = [(h["_step"], h["validation"]) for h in history if "validation" in h]
    assert image[0] == 2 and image[1]["_type"] == "image-file" and (image[1]["width"], image[1]["height"]) == (32, 32)
    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update(_unflatten(r.config.update))
    assert config["recipe"] == {"trainer": {"max_steps": 2}, "seed": 0}
    assert config["snapshot"] == PROVENANCE["snapshot"]
    assert config["prep"]["curation"]["thresholds"] == {"min_sharpness": 20.0}
    assert config["buckets"] == {"32x32x1": 4}
    assert summary["trackers"]["wandb"].startswith(str(run_dir / "wandb"))


@pytest.mark.slow
def test_mlflow_server_holds_the_metrics_params_and_artifacts(tracked):
    from mlflow import MlflowClient

    summary, run_dir, uri = tracked
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("latentmill-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [r["step"] for r in read_metrics(run_dir)]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in read_metrics(run_dir)])
    assert run.data.params["trainer.max_steps"] == "2" and run.data.params["seed"] == "0"
    (evaluated,) = [r["eval"] for r in read_metrics(run_dir) if "eval" in r]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/loss_0.9")] == \
        [(2, pytest.approx(evaluated["loss_0.9"]))]
    assert run.data.tags["snapshot"] == PROVENANCE["snapshot"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "validation")] == ["validation/step-000002.png"]
    provenance = client.download_artifacts(run.info.run_id, "provenance.json", str(run_dir / "dl"))
    assert json.loads(Path(provenance).read_text())["prep"]["stages"]["ingest"]["quarantined"] == 1
    assert summary["trackers"]["mlflow"] == f"{uri}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"


@pytest.mark.slow
def test_tensorboard_has_the_same_scalars_and_the_grid(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, _ = tracked
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in read_metrics(run_dir)])
    (evaluated,) = [r["eval"] for r in read_metrics(run_dir) if "eval" in r]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, pytest.approx(evaluated["loss"]))]
    (image,) = events.Images("validation")
    assert image.step == 2 and (image.width, image.height) == (32, 32)
    assert "recipe/text_summary" in events.Tags()["tensors"]


@pytest.mark.slow
def test_model_card_describes_the_export(tracked):
    import yaml

    summary, run_dir, _ = tracked
    export = Path(summary["export_dir"])
    text = (export / "README.md").read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert front["library_name"] == "diffusers" and front["license"] == "apache-2.0"
    assert "base_model" not in front  # a local folder is no Hub id
    assert front["tags"] == ["text-to-image", "diffusers", "latentmill", "flux", "lora"]
    assert front["widget"] == [{"text": "a red square", "output": {"url": "images/step-000002.png"}}]
    assert (export / "images" / "step-000002.png").read_bytes() == (run_dir / "validation" / "step-000002.png").read_bytes()
    assert "instance_prompt" not in front  # the fake captions ("caption 0", ...) share no phrase
    for expected in ("LoRA (rank 4, alpha 16)", "| steps | 2 |", "0.001, constant schedule",
                     "0003-abcdef012345", "| samples | 4 |", "| 32x32x1 | 4 |", "min_sharpness 20.0",
                     "| captioner | blip |", "| ingest | 6 | 5 | 1 |"):
        assert expected in text, expected
    assert str(Path.home()) not in text and "/tmp" not in text and str(run_dir) not in text


def test_card_never_shows_a_local_path_or_a_credential():
    cfg = TrainerConfig(mode="full")
    info = {**PROVENANCE, "family": "wan", "prep": {**PREP, "captioner": "C:\\models\\blip2"}}
    text = model_card(cfg=cfg, info=info, pretrained="/data/models/Wan2.1", steps=5, final_loss=0.1, video=True,
                      trigger="ohwx", images=[], prompts=[])
    assert "/data/models" not in text and "C:\\" not in text and "Wan2.1" in text
    assert "instance_prompt: ohwx" in text and "text-to-video" in text
    hub = model_card(cfg=cfg, info=info, pretrained="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", steps=5, final_loss=0.1,
                     video=True, trigger=None, images=[], prompts=[])
    assert "base_model: Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in hub
    assert public("https://user:hf_secret@example.com/x") == "https://example.com/x"
    assert public("file:///home/me/x.tar") == "x.tar" and public("sidecar") == "sidecar"


def test_trigger_phrase_is_the_shared_first_phrase():
    assert trigger_phrase(["ohwx dog, on a sofa", "ohwx dog , running", "ohwx dog"]) == "ohwx dog"
    assert trigger_phrase(["ohwx dog, on a sofa", "a cat, ohwx dog"]) is None
    assert trigger_phrase(["ohwx dog, alone"]) is None  # one caption shares nothing
    assert trigger_phrase(["", ""]) is None


def test_an_unknown_tracker_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"trainer.trackers: 'comet' is not a known tracker; known: 'tensorboard', "
                                          r"'wandb', 'mlflow'"):
        TrainerConfig(trackers=["wandb", "comet"]).validate()


def test_the_older_tensorboard_key_still_works():
    assert TrainerConfig().active_trackers() == ["tensorboard"]
    assert TrainerConfig(tensorboard=False).active_trackers() == []
    assert TrainerConfig(trackers=["wandb"], tensorboard=True).active_trackers() == ["wandb", "tensorboard"]
    assert TrainerConfig(trackers=["wandb", "tensorboard"], tensorboard=False).active_trackers() == ["wandb"]


def test_metrics_records_become_train_scalars():
    record = {"step": 3, "loss": 0.5, "lr": 1e-4, "skipped": False, "expert": "all", "grad_norm": 2}
    assert scalars(record) == {"train/loss": 0.5, "train/lr": 1e-4, "train/grad_norm": 2.0}
    assert flatten({"a": {"b": 1, "c": [1]}, "d": None}) == {"a.b": 1, "a.c": [1], "d": None}


@pytest.mark.slow
def test_a_tracker_that_cannot_start_is_one_warning_or_an_error_when_required(tmp_path, monkeypatch, caplog):
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    wandb.teardown()  # an earlier test's offline W&B session would otherwise be reused
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nobody listens there
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    with caplog.at_level(logging.WARNING, logger="latentmill.trainer.trackers"):
        trackers = start_trackers(["mlflow", "wandb"], project="p", run_name="r", log_dir=tmp_path)
    assert trackers.active == []
    lines = [r.getMessage() for r in caplog.records if r.name == "latentmill.trainer.trackers"]
    assert len(lines) == 2 and all("\n" not in line and line.endswith("the run goes on without it") for line in lines)
    assert lines[0].startswith("tracker mlflow not started: ConnectionError: the MLflow server http://127.0.0.1:")
    assert lines[1].startswith("tracker wandb not started: UsageError: No API key configured")
    with pytest.raises(TrackerError, match=r"trainer.trackers: mlflow could not start: ConnectionError: .*"
                                           r"\(trainer.trackers_required is true\)"):
        start_trackers(["mlflow"], project="p", run_name="r", log_dir=tmp_path, required=True)


@pytest.mark.slow
def test_a_prep_summary_goes_to_the_same_project_with_a_link_artifact(mlflow_server, tmp_path, monkeypatch):
    from latentmill.pipelines.prep import log_prep_to_trackers
    from latentmill.pipelines.report import publish_tracker_links
    from latentmill.pipelines.snapshot import publish
    from mlflow import MlflowClient
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from latentmill.recipe import recipe_from_dict

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out = tmp_path / "out"
    write_fake_cache(out / "prep" / "cache", {(32, 32, 1): 3}, seq_len=8)
    snapshot = publish(out, out / "prep" / "cache")
    recipe = recipe_from_dict({"output_dir": str(out), "model": {"pretrained": "unused"},
                               "trainer": {"trackers": ["tensorboard", "mlflow"], "tracker_project": "prep-test"}})
    report = {"cache": {"in": 3, "out": 3, "quarantined": 0, "processed": 3, "reused": 0}}

    @flow(name="prep-like")
    def prep_like() -> dict:  # what the prep flow does after publishing its snapshot
        urls = log_prep_to_trackers(recipe, report, snapshot)
        publish_tracker_links(urls, "prep")
        return urls

    urls = prep_like()
    assert list(urls) == ["mlflow"]  # TensorBoard has no project to share
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("prep-test").experiment_id])
    assert run.info.run_name == f"prep-{snapshot['name']}" and run.data.tags["job_type"] == "prep"
    assert run.data.metrics["prep/cache.in"] == 3 and run.data.metrics["prep/cache.quarantined"] == 0
    assert run.data.tags["snapshot"] == snapshot["name"] and run.data.params["trainer.tracker_project"] == "prep-test"
    with get_client(sync_client=True) as prefect:
        links = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prep-mlflow"])))
    assert max(links, key=lambda a: a.created).data == f"[mlflow: prep run]({urls['mlflow']})"


@pytest.mark.slow
@pytest.mark.heavy  # a 2-rank launch (about 100 s on the loaded 2-core box) of the path the tests above run
def test_only_rank_0_tracks(tmp_path, monkeypatch):
    from tests.trainer_helpers import build_tiny_transformer, launch_jobs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    pretrained = build_tiny_transformer(tmp_path / "pretrained")
    write_fake_cache(tmp_path / "cache", {(32, 32, 1): 4})
    cfg = {"max_steps": 2, "batch_size": 1, "learning_rate": 1e-3, "save_every": 0, "export": False,
           "trackers": ["tensorboard", "wandb"]}
    ((rank0, rank1),) = launch_jobs(tmp_path / "launch", [{"cfg": cfg, "cache": str(tmp_path / "cache"),
                                                          "pretrained": str(pretrained), "parallel": {"strategy": "ddp"},
                                                          "train_dir": str(tmp_path / "run")}])
    assert sorted(rank0["trackers"]) == ["tensorboard", "wandb"] and rank1["trackers"] == {}
    assert len(list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))) == 1
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
def test_a_run_ends_finished_failed_or_killed_in_mlflow(mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    uri = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    ids = {}
    for status in ("finished", "failed", "killed"):
        trackers = start_trackers(["mlflow"], project="statuses", run_name=status, log_dir=tmp_path)
        ids[status] = trackers.active[0].run_id
        trackers.close(status)
    client = MlflowClient(uri)
    assert {s: client.get_run(i).info.status for s, i in ids.items()} == {
        "finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


@pytest.fixture(scope="module")
def tracked_video(tiny_wan, mlflow_server, tmp_path_factory):
    """A Wan 2.1 run of 2 steps with a validation at step 2 (a 5-frame video), logged to all three trackers."""
    root = tmp_path_factory.mktemp("tracked-video")
    write_fake_cache(root / "cache", {(32, 32, 5): 4}, family="wan", trimmed=True, seq_len=16, smooth=True)
    add_validation_prompts(root / "cache", str(tiny_wan), ["a red ball"], max_sequence_length=16)  # as a prep does
    cfg = TrainerConfig(max_steps=2, batch_size=2, learning_rate=1e-3, save_every=0, mode="lora", lora_rank=4,
                        validate_every=2, validation_prompts=["a red ball"], validation_steps=1,
                        validation_size=[32, 32, 5], trackers=["tensorboard", "wandb", "mlflow"],
                        tracker_project="latentmill-video-test", export=False)
    pytest.importorskip("wandb").teardown()  # an earlier test's online W&B session would otherwise be reused
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": mlflow_server}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with torch_threads(1):
            summary = train(cfg, cache_dir=root / "cache", pretrained=str(tiny_wan), train_dir=root / "run", seed=0,
                            progress=False)
    finally:
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    gif = root / "run" / "validation" / "step-000002.gif"
    return summary, root / "run", gif, mlflow_server


@pytest.mark.slow
def test_a_video_validation_goes_to_every_tracker_as_a_video(tracked_video):
    from mlflow import MlflowClient
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, run_dir, gif, uri = tracked_video
    assert sorted(summary["trackers"]) == ["mlflow", "tensorboard", "wandb"]
    with Image.open(gif) as video:
        assert (video.format, video.n_frames, video.size) == ("GIF", 5, (32, 32))  # every frame of the video
    with Image.open(run_dir / "validation" / "step-000002.png") as grid:
        assert grid.size == (4 * 32, 32)  # the grid: four frames
    # W&B: a video at step 2, the GIF's bytes in the run's media folder
    history = [_unflatten(r.history.item) for r in _wandb_records(run_dir)
               if r.WhichOneof("record_type") == "history"]
    (video,) = [(h["_step"], h["validation_video"]) for h in history if "validation_video" in h]
    assert video[0] == 2 and video[1]["_type"] == "video-file" and video[1]["path"].endswith(".gif")
    (media,) = run_dir.glob(f"wandb/offline-run-*/files/{video[1]['path']}")
    assert media.read_bytes() == gif.read_bytes()
    # MLflow: the GIF as an artifact
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("latentmill-video-test").experiment_id])
    assert [a.path for a in client.list_artifacts(run.info.run_id, "validation_video")] == \
        ["validation_video/step-000002.gif"]
    fetched = client.download_artifacts(run.info.run_id, "validation_video/step-000002.gif", str(run_dir / "dl"))
    assert Path(fetched).read_bytes() == gif.read_bytes()
    # TensorBoard: the image summary add_video writes, holding the GIF
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("validation_video")
    assert image.step == 2 and image.encoded_image_string == gif.read_bytes()
