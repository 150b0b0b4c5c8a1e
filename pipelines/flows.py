"""The flows users deploy: ``prep``, ``train`` and ``prep-then-train`` (see prefect.yaml).

Each flow takes a recipe path plus dotted overrides, validates the whole recipe before any work starts,
and returns the run summary (``{"stages": {...}, "train": {...}}``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE

from latentmill.config import ConfigError
from latentmill.models import check_cache_compatible
from latentmill.recipe import Recipe, load_recipe
from pipelines.prep import prep, run_prep
from stages.shardio import StageDir


@task(name="train-model", cache_policy=NONE)
def train_task(recipe_data: dict) -> dict[str, Any]:
    """Train on the recipe's latent cache in this process and export the result."""
    from latentmill.recipe import recipe_from_dict
    from trainer import train

    recipe = recipe_from_dict(recipe_data)
    return train(
        recipe.trainer,
        cache_dir=recipe.stage_dir("cache"),
        pretrained=recipe.model.pretrained,
        train_dir=recipe.train_dir,
        seed=recipe.seed,
        export_dir=recipe.export_dir,
        parallel=recipe.parallel,
        check_cache=lambda manifest: check_cache_compatible(manifest, recipe.model),
    )


def check_nproc(nproc: int) -> None:
    """Fail before any work when the process count cannot be honoured."""
    if nproc != 1:
        raise ConfigError(f"--nproc {nproc}: multi-process training needs parallel.strategy ddp or fsdp2, "
                          "which this version does not have yet; use --nproc 1")


def run_train(recipe: Recipe, nproc: int = 1) -> dict[str, Any]:
    """Train from the cache stage's manifest; refuses a cache made by other models."""
    check_nproc(nproc)
    StageDir(recipe.stage_dir("cache"), "cache").read_manifest()  # clear error if prep has not run
    return train_task(recipe.to_dict())


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
    check_nproc(nproc)
    stages = run_prep(recipe)
    return {"stages": stages, "train": run_train(recipe, nproc)}


__all__ = ["prep", "train", "prep_then_train"]
