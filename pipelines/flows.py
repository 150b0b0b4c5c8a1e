"""The flows users deploy: ``prep``, ``train`` and ``prep-then-train`` (see prefect.yaml).

Each flow takes a recipe path plus dotted overrides, validates the whole recipe before any work starts,
and returns the run summary (``{"stages": {...}, "train": {...}}``).
"""

from __future__ import annotations

import dataclasses
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
from pipelines.snapshot import resolve_snapshot


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
    resolve_snapshot(recipe.output_dir, recipe.snapshot)  # clear error if prep has not run
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
    """Prepare the latent cache, then train on its snapshot: ``{"stages", "snapshot", "train"}``."""
    recipe = load_recipe(config, overrides)
    check_nproc(recipe, nproc)
    prepared = run_prep(recipe)
    return {**prepared, "train": run_train(recipe, nproc)}


@flow(name="refresh")
def refresh(config: str = "configs/demo.yaml", overrides: list[str] | None = None, train: bool = False,
            nproc: int = 1) -> dict[str, Any]:
    """Prep incrementally (only new or changed inputs cost work); train on the snapshot if it is new."""
    recipe = load_recipe(config, overrides)
    check_nproc(recipe, nproc)
    prepared = run_prep(recipe)
    result = dict(prepared)
    if train and prepared["snapshot"]["new"]:
        result["train"] = run_train(dataclasses.replace(recipe, snapshot=prepared["snapshot"]["name"]), nproc)
    return result


__all__ = ["prep", "train", "prep_then_train", "refresh"]
