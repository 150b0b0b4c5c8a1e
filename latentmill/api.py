"""The typed Python API: the same runs as the command line, from a :class:`~latentmill.recipe.Recipe`.

    from latentmill.api import run
    from latentmill.recipe import load_recipe

    recipe = load_recipe("configs/demo.yaml", ["trainer.max_steps=50"])
    summary = run(recipe)                     # prep, then train: {"stages", "snapshot", "train"}
    print(summary["train"]["final_loss"], summary["train"]["export_dir"])

A recipe can also be built from its typed parts (``Recipe(output_dir=..., model=ModelConfig(...), ...)``).
Each call is a Prefect flow run (``prep``, ``train``, ``prep-then-train``) that records the whole recipe, with
the same artifacts and summary as ``latentmill prep|train|run``. A bad recipe raises
:class:`~latentmill.core.config.ConfigError` before any work starts.
"""

from __future__ import annotations

import importlib
from typing import Any

from latentmill.prefect_env import run_command
from latentmill.recipe import Recipe, recipe_from_dict


def _checked(recipe: Recipe) -> dict:
    """The recipe as a dict, validated again (a Recipe built by hand skips the YAML path's checks)."""
    data = recipe.to_dict()
    recipe_from_dict(data)
    return data


def _run_flow(module: str, name: str, *args: Any) -> dict[str, Any]:
    """Run the flow ``module.name`` as the command line runs its flows (``latentmill.prefect_env.run_command``:
    the same settings and temporary API server), with Prefect's INFO lines off the console."""

    def prepare():
        flow = getattr(importlib.import_module(module), name)  # while the temporary API server boots
        return lambda: flow(*args)

    return run_command(prepare, quiet_console=True)


def prep(recipe: Recipe) -> dict[str, Any]:
    """Prepare the latent cache and publish its snapshot: ``{"stages": {...}, "snapshot": {...}}``."""
    return _run_flow("latentmill.pipelines.prep", "prep_recipe", _checked(recipe))


def train(recipe: Recipe, nproc: int = 1, nnodes: int | None = None, rdzv_endpoint: str | None = None
          ) -> dict[str, Any]:
    """Train on the recipe's snapshot (``nproc`` > 1: under torchrun; ``nnodes`` None: ``parallel.nnodes``, else
    1): ``{"train": {...}}``."""
    return _run_flow("latentmill.pipelines.flows", "train_recipe_flow", _checked(recipe), nproc,
                     recipe.parallel.launch_nodes(nnodes), rdzv_endpoint)


def run(recipe: Recipe, nproc: int = 1, nnodes: int | None = None, rdzv_endpoint: str | None = None
        ) -> dict[str, Any]:
    """Prep, then train on the new snapshot: ``{"stages": {...}, "snapshot": {...}, "train": {...}}``."""
    return _run_flow("latentmill.pipelines.flows", "prep_then_train_recipe", _checked(recipe), nproc,
                     recipe.parallel.launch_nodes(nnodes), rdzv_endpoint)


__all__ = ["prep", "train", "run"]
