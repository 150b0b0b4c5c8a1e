"""The CLI's one-line errors for wrong paths and bad overrides, and what `inspect` and `verify` read."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from latentmill.inspect import inspect_path
from stages.shardio import sha256_file
from tests.conftest import REPO_ROOT
from trainer.checkpoint import resolve_resume

STAGES = ("ingest", "caption", "bucket", "cache")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
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
    with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
        assert resolve_resume("latest", ckpt_dir) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer.resume=latest: no checkpoint found under {ckpt_dir}, starting from step 0"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
        assert resolve_resume("latest", ckpt_dir, announce=False) is None  # other ranks stay quiet
        assert resolve_resume(None, ckpt_dir) is None  # a fresh start is not a failed resume
    assert caplog.records == []


def test_a_recipe_must_name_its_source_for_prep(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nmodel:\n  pretrained: {tmp_path / 'model'}\n")
    result = _cli("prep", str(recipe))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "latentmill: error: ingest.source: not set; name the media to prepare: a folder, a .txt file list, a "
        ".csv/.jsonl/.parquet manifest or webdataset shards (e.g. ingest.source=/data/photos)"]
    assert not (tmp_path / "out").exists()
