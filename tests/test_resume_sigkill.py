"""A training process killed with SIGKILL mid-run resumes with exactly the losses of an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from latentmill.pipelines.snapshot import publish

from latentmill.recipe import load_recipe
from tests.conftest import DEMO_CONFIG, DEMO_IMAGES
from tests.helpers import prep_in_process

pytestmark = pytest.mark.slow

# Runs one training process. With KILL_AT > 0 the process SIGKILLs itself inside the loss of that step:
# no Python cleanup, no final checkpoint, a half-finished step, exactly like `kill -9`.
RUNNER = """
import importlib, json, os, signal, sys
from latentmill.recipe import recipe_from_dict
from latentmill.pipelines.launch import train_recipe
from latentmill.pipelines.runs import plan_run
from latentmill.pipelines.snapshot import resolve_snapshot

loop = importlib.import_module("latentmill.trainer.train")  # the module (the package exports a function `train`)
recipe_json, kill_at = sys.argv[1], int(sys.argv[2])
if kill_at:
    real, calls = loop.flow_matching_loss, [0]

    def loss(*args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    loop.flow_matching_loss = loss
recipe = recipe_from_dict(json.load(open(recipe_json)))
plan = plan_run(recipe, resolve_snapshot(recipe.output_dir, recipe.snapshot).name)  # resume: latest finds the run
train_recipe(recipe, plan.folder, progress=False)
"""


def _train(tmp_path, recipe, kill_at=0):
    path = tmp_path / f"recipe-{kill_at}-{recipe.trainer.resume}.json"
    path.write_text(json.dumps(recipe.to_dict()))
    return subprocess.run([sys.executable, "-c", RUNNER, str(path), str(kill_at)], capture_output=True, text=True)


def _losses(recipe):
    lines = (recipe.train_dir / "metrics.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


def test_sigkill_then_resume_matches_uninterrupted(tiny_flux, tmp_path):
    base = [f"model.pretrained={tiny_flux}", f"ingest.source={DEMO_IMAGES}", "trainer.max_steps=9",
            "trainer.save_every=3", "trainer.batch_size=2", "trainer.log_every=1"]
    prep = load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path / 'run'}", *base])
    prep_in_process(prep)
    publish(prep.output_dir, prep.stage_dir("cache"))

    import dataclasses
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "whole")
    whole = dataclasses.replace(prep, output_dir=str(tmp_path / "whole"))
    done = _train(tmp_path, whole)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _losses(whole)
    assert sorted(expected) == list(range(1, 10))

    killed = _train(tmp_path, prep, kill_at=5)  # dies inside step 5: the last checkpoint is step 3
    assert killed.returncode == -signal.SIGKILL
    assert max(_losses(prep)) == 4
    resumed = dataclasses.replace(prep, trainer=dataclasses.replace(prep.trainer, resume="latest"))
    done = _train(tmp_path, resumed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _losses(resumed) == expected  # bitwise: the same floats, step by step
