"""The CLI's one-line errors for wrong paths and bad overrides, and what `inspect` and `verify` read."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from latentmill.trainer.checkpoint import resolve_resume

from latentmill.core.hashing import sha256_file
from latentmill.inspect import inspect_path
from latentmill.models import known_families
from tests.conftest import REPO_ROOT

STAGES = ("ingest", "caption", "curate", "bucket", "cache")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("PREFECT_LOGGING_LEVEL", None)  # as in a user's shell: the CLI chooses it (conftest sets one)
    return subprocess.run([sys.executable, "-m", "latentmill.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("latentmill: error: "), proc.stderr
    return lines[0]


def _fake_output_dir(root: Path) -> Path:
    """An output_dir with one shard per stage (stage folders made in reverse order) and one snapshot."""
    for stage in reversed(STAGES):
        stage_dir = root / "prep" / stage
        (stage_dir / "shards").mkdir(parents=True)
        shard = stage_dir / "shards" / f"{stage}-0.tar"
        shard.write_bytes(stage.encode())
        manifest = {"stage": stage, "counts": {"in": 1, "out": 1, "quarantined": 0},
                    "shards": [{"path": f"shards/{shard.name}", "sha256": sha256_file(shard), "samples": 1}]}
        (stage_dir / "manifest.json").write_text(json.dumps(manifest))
    snapshot = root / "snapshots" / "0001-abc"
    snapshot.mkdir(parents=True)
    cache = json.loads((root / "prep" / "cache" / "manifest.json").read_text())
    cache["shards"][0]["path"] = "../../prep/cache/shards/cache-0.tar"
    (snapshot / "manifest.json").write_text(json.dumps(cache))
    (root / "snapshots" / "LATEST").write_text("0001-abc\n")
    return root


def test_a_malformed_override_names_the_override():
    line = _one_error_line(_cli("train", "configs/demo.yaml", "bucket.aspect_ratios=[0.75,1.0"))
    assert "override 'bucket.aspect_ratios=[0.75,1.0': cannot parse the value as YAML" in line


def test_inspect_a_missing_recipe_says_it_does_not_exist():
    line = _one_error_line(_cli("inspect", "configs/nope.yaml"))
    assert line == "latentmill: error: recipe configs/nope.yaml does not exist"


def test_verify_a_missing_path_says_it_does_not_exist(tmp_path):
    line = _one_error_line(_cli("verify", str(tmp_path / "nonexistent")))
    assert line == f"latentmill: error: {tmp_path / 'nonexistent'} does not exist"


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_plain_file_is_named_as_a_file(tmp_path, command):
    path = tmp_path / "notes.txt"
    path.write_text("x")
    line = _one_error_line(_cli(command, str(path)))
    assert f"{path} is a file; pass " in line and "latentmill prep" not in line


def test_verify_a_recipe_says_it_is_a_recipe():
    line = _one_error_line(_cli("verify", "configs/demo.yaml"))
    assert "configs/demo.yaml is a recipe; verify reads an output_dir" in line


def test_verify_follows_snapshots_latest(tmp_path):
    out = _fake_output_dir(tmp_path / "out")
    proc = _cli("verify", str(out / "snapshots" / "LATEST"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"names the latest snapshot: reading {out / 'snapshots' / '0001-abc'}" in proc.stdout
    assert "verified 1 shards: 1 ok, 0 bad" in proc.stdout


def test_inspect_lists_stages_in_pipeline_order(tmp_path, capsys):
    out = _fake_output_dir(tmp_path / "out")
    (out / "snapshots" / "LATEST").unlink()  # a snapshot report needs more than this fake holds
    assert inspect_path(out) == 0
    printed = [line.split(" ")[0] for line in capsys.readouterr().out.splitlines()]
    assert printed == list(STAGES)


def test_resume_latest_without_a_checkpoint_says_so_on_rank_0(tmp_path, caplog):
    ckpt_dir = tmp_path / "checkpoints"
    with caplog.at_level(logging.INFO, logger="latentmill.trainer.checkpoint"):
        assert resolve_resume("latest", ckpt_dir) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer.resume=latest: no checkpoint found under {ckpt_dir}, starting from step 0"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="latentmill.trainer.checkpoint"):
        assert resolve_resume("latest", ckpt_dir, announce=False) is None  # other ranks stay quiet
        assert resolve_resume(None, ckpt_dir) is None  # a fresh start is not a failed resume
    assert caplog.records == []


def test_a_recipe_must_name_its_source_for_prep(tmp_path):
    recipe = tmp_path / "mine.yaml"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nmodel:\n  pretrained: {tmp_path / 'model'}\n")
    result = _cli("prep", str(recipe))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "latentmill: error: ingest.source: not set; name the media to prepare: a folder, a .txt file list, a "
        ".csv/.jsonl/.parquet manifest or webdataset shards (e.g. ingest.source=/data/photos)"]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------
# Paths are checked before any stage or Prefect start-up (issue 14, item 4)


def test_a_typo_in_the_tiny_model_folder_is_an_error_not_a_new_model(tmp_path):
    out = tmp_path / "out"
    line = _one_error_line(_cli("run", "configs/demo.yaml", f"output_dir={out}",
                                "model.pretrained=data/models/tiny-flx"))
    data = REPO_ROOT / "data"
    assert line == (f"latentmill: error: model.pretrained: data/models/tiny-flx does not exist; the tiny recipe "
                    f"{data / 'tiny-flux.yaml'} builds only into {data / 'models' / 'tiny-flux'} (set "
                    "model.pretrained to that, to an existing folder, or to a hub id)")
    assert not out.exists() and not (REPO_ROOT / "data" / "models" / "tiny-flx").exists()


@pytest.mark.parametrize("override, message", [
    ("model.pretrained=/nope/model", "model.pretrained: /nope/model does not exist, and is not a Hugging Face id"),
    ("model.vae=./vae-folder", "model.vae: ./vae-folder does not exist, and is not a Hugging Face id"),
])
def test_a_missing_model_folder_fails_before_any_stage(tmp_path, override, message):
    out = tmp_path / "out"
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "model_index.json").write_text("{}")
    line = _one_error_line(_cli("run", "configs/demo.yaml", f"output_dir={out}", "model.tiny_recipe=null",
                                f"model.pretrained={tmp_path / 'pipeline'}", override))
    assert line == f"latentmill: error: {message} (owner/name)"
    assert not out.exists()


def _pipeline_folder(root: Path, pipeline: str, components: dict[str, str]) -> Path:
    """A pipeline folder of config files only: its model_index.json and each component's config.json."""
    root.mkdir(parents=True)
    index = {"_class_name": pipeline}
    for name, cls in components.items():
        index[name] = ["diffusers" if cls.startswith("Autoencoder") else "transformers", cls]
        (root / name).mkdir()
        key = "_class_name" if cls.startswith("Autoencoder") else "architectures"
        (root / name / "config.json").write_text(json.dumps({key: cls if key == "_class_name" else [cls]}))
    (root / "model_index.json").write_text(json.dumps(index))
    return root


@pytest.mark.parametrize("overrides, message", [
    (["model.vae={wan}/vae"], "model.vae: {wan}/vae is a AutoencoderKLWan; the FluxPipeline at {flux} takes a "
                              "AutoencoderKL: a recipe cannot mix components of different model families"),
    (["model.family=wan"], "model.family: 'wan', but {flux} is a FluxPipeline (the 'flux' family); set "
                           "model.family to 'flux' or 'auto'"),
    (["model.family=sd3"], "model.family: 'sd3' is not a known family; allowed: 'auto', "
                           + ", ".join(repr(f) for f in known_families())),
])
def test_a_recipe_that_mixes_families_stops_before_any_work(tmp_path, overrides, message):
    flux = _pipeline_folder(tmp_path / "flux", "FluxPipeline", {"vae": "AutoencoderKL", "text_encoder": "CLIPTextModel",
                                                                 "text_encoder_2": "T5EncoderModel"})
    wan = _pipeline_folder(tmp_path / "wan", "WanPipeline", {"vae": "AutoencoderKLWan",
                                                              "text_encoder": "UMT5EncoderModel"})
    out = tmp_path / "out"
    line = _one_error_line(_cli("prep", "configs/demo.yaml", f"output_dir={out}", "model.tiny_recipe=null",
                                f"model.pretrained={flux}", *(o.format(wan=wan) for o in overrides)))
    assert line == "latentmill: error: " + message.format(wan=wan, flux=flux)
    assert not out.exists()


def test_an_edit_recipe_over_data_without_pairs_stops_before_any_work(tmp_path):
    out = tmp_path / "out"
    line = _one_error_line(_cli("prep", "configs/demo.yaml", f"output_dir={out}", "ingest.edit=true"))
    assert line.startswith(f"latentmill: error: ingest.edit: {REPO_ROOT / 'data' / 'demo' / 'images'} holds no edit "
                           "pairs; put each source image beside its target as <name>.src.<ext>")
    assert not out.exists()


def test_a_wrong_source_leaves_no_folders(tmp_path):
    out = tmp_path / "out"
    line = _one_error_line(_cli("prep", "configs/demo.yaml", f"output_dir={out}",
                                f"ingest.source={tmp_path / 'no-such-folder'}"))
    assert line == f"latentmill: error: ingest.source: {tmp_path / 'no-such-folder'} does not exist"
    assert not out.exists()


def test_train_before_prep_and_nproc_without_ddp_say_so_in_one_line(tmp_path):
    line = _one_error_line(_cli("train", "configs/demo.yaml", f"output_dir={tmp_path / 'new'}"))
    assert line.startswith(f"latentmill: error: no snapshot published under {tmp_path / 'new' / 'snapshots'}")
    line = _one_error_line(_cli("train", "configs/demo.yaml", f"output_dir={_fake_output_dir(tmp_path / 'o')}",
                                "--nproc", "2"))
    assert "2 processes need parallel.strategy 'ddp' or 'fsdp2'" in line


@pytest.mark.slow  # a prep that fails in a stage: Prefect starts
def test_an_unforeseen_failure_is_one_line_and_debug_shows_the_traceback(tmp_path):
    # An existing folder that is no pipeline passes the path checks and fails when the cache stage loads it.
    # Two images: the stages before the cache have less to do, the failure is the same.
    from tests.test_retention import IMAGES, _fill

    empty = tmp_path / "not-a-pipeline"
    empty.mkdir()
    (empty / "model_index.json").write_text("{ not json")
    _fill(tmp_path / "images", IMAGES[:2])
    args = ("prep", "configs/demo.yaml", f"output_dir={tmp_path / 'out'}", f"model.pretrained={empty}",
            "model.tiny_recipe=null", f"ingest.source={tmp_path / 'images'}")
    quiet = _cli(*args)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    errors = [line for line in quiet.stderr.splitlines() if line.startswith("latentmill: error: ")]
    assert len(errors) == 1 and errors[0].endswith("(run again with --debug, or LATENTMILL_DEBUG=1, for the traceback)")
    loud = _cli(*args, "--debug")
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr


def test_run_takes_the_launch_options_of_train(tmp_path):
    line = _one_error_line(_cli("run", "configs/demo.yaml", f"output_dir={tmp_path / 'o'}", "parallel.strategy=ddp",
                                "--nnodes", "2"))
    assert line == "latentmill: error: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (the first node's address)"
    assert not (tmp_path / "o").exists()


def test_preps_of_one_output_dir_take_turns(tmp_path, capsys):
    import threading
    import time

    from latentmill.pipelines.prep import writer_lock

    order = []

    def second():
        with writer_lock(tmp_path):
            order.append("second")

    printed = ""
    with writer_lock(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        for _ in range(600):  # until the second says it waits
            printed += capsys.readouterr().out
            if "waiting" in printed:
                break
            time.sleep(0.05)
        order.append("first")  # the second waits for the first to let go
    thread.join(timeout=30)
    assert order == ["first", "second"]
    assert f"prep: waiting for another prep writing to {tmp_path} (held by PID {os.getpid()}" in printed
