"""The flows users deploy: ``prep``, ``train`` and ``prep-then-train`` (see prefect.yaml).

Each flow takes a recipe path plus dotted overrides, validates the whole recipe before any work starts,
and returns the run summary (``{"stages": {...}, "train": {...}}``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE

from latentmill.config import ConfigError
from latentmill.recipe import Recipe, load_recipe, recipe_from_dict
from pipelines.launch import train_recipe
from pipelines.prep import prep, run_prep
from stages.shardio import StageDir


@task(name="train-model", cache_policy=NONE)
def train_task(recipe_data: dict) -> dict[str, Any]:
    """Train on the recipe's latent cache in this process and export the result."""
    return train_recipe(recipe_from_dict(recipe_data))


@task(name="train-torchrun", cache_policy=NONE)
def torchrun_task(recipe_data: dict, nproc: int) -> dict[str, Any]:
    """Train with ``nproc`` processes started by torchrun on this node; return rank 0's summary."""
    recipe = recipe_from_dict(recipe_data)
    recipe.train_dir.mkdir(parents=True, exist_ok=True)
    recipe_json, summary_json = recipe.train_dir / "launch-recipe.json", recipe.train_dir / "launch-summary.json"
    recipe_json.write_text(json.dumps(recipe_data))
    summary_json.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pipelines.launch", str(recipe_json), str(summary_json)]
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with status {done.returncode}; see the rank logs above")
    return json.loads(summary_json.read_text())


def check_nproc(recipe: Recipe, nproc: int) -> None:
    """Fail before any work when the process count does not fit the recipe's parallel strategy."""
    if nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {nproc}")
    if nproc > 1 and recipe.parallel.strategy == "none":
        raise ConfigError(f"--nproc {nproc} needs parallel.strategy: 'ddp' (allowed with --nproc > 1: 'ddp'); "
                          "add parallel.strategy=ddp")


def run_train(recipe: Recipe, nproc: int = 1) -> dict[str, Any]:
    """Train from the cache stage's manifest, in this process or under torchrun."""
    check_nproc(recipe, nproc)
    StageDir(recipe.stage_dir("cache"), "cache").read_manifest()  # clear error if prep has not run
    if nproc == 1:
        return train_task(recipe.to_dict())
    return torchrun_task(recipe.to_dict(), nproc)


@flow(name="train")
def train(config: str = "configs/demo.yaml", overrides: list[str] | None = None, nproc: int = 1) -> dict[str, Any]:
    """Train on a prepared latent cache: ``{"train": {...}}``."""
    recipe = load_recipe(config, overrides)
    return {"train": run_train(recipe, nproc)}


@flow(name="prep-then-train")
def prep_then_train(config: str = "configs/demo.yaml", overrides: list[str] | None = None,
                    nproc: int = 1) -> dict[str, Any]:
    """Prepare the latent cache, then train on it: ``{"stages": {...}, "train": {...}}``."""
    recipe = load_recipe(config, overrides)
    check_nproc(recipe, nproc)
    stages = run_prep(recipe)
    return {"stages": stages, "train": run_train(recipe, nproc)}


__all__ = ["prep", "train", "prep_then_train"]
