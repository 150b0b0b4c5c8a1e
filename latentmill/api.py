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

import contextlib
import importlib
import logging
import os
from typing import Any, Iterator

from latentmill.recipe import Recipe, recipe_from_dict

# The command line's defaults (latentmill.cli.main): no telemetry, and a loaded machine can take longer than
# Prefect's 20 s to start the temporary API. A setting in the environment wins, as it does there.
_CLI_SETTINGS = {"PREFECT_SERVER_ANALYTICS_ENABLED": False, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": 180}


def _checked(recipe: Recipe) -> dict:
    """The recipe as a dict, validated again (a Recipe built by hand skips the YAML path's checks)."""
    data = recipe.to_dict()
    recipe_from_dict(data)
    return data


class _NoPrefectInfo(logging.Filter):
    """Drops Prefect's records below WARNING (run states, stage lines, the temporary server's notices)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("prefect")


@contextlib.contextmanager
def _quiet_console() -> Iterator[None]:
    """Prefect's console without its INFO lines for the length of a call; its API handler keeps them all.

    The command line gets this from ``PREFECT_LOGGING_LEVEL`` set before Prefect is imported; a library
    cannot set that for its caller's process, so the filter goes on Prefect's console handler and comes off.
    """
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()
    quiet = _NoPrefectInfo()
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in consoles:
            handler.removeFilter(quiet)


def _run_flow(module: str, name: str, *args: Any) -> dict[str, Any]:
    """Run the flow ``module.name`` with the command line's Prefect set-up (``latentmill.cli``).

    Prefect's temporary API server is the command line's (``latentmill.prefect_env.start_api_early``: one
    per process, ended with it, stopped at exit without a log line), booting while the flows import, and it
    runs without Prefect's telemetry service: left on by default, it wrote its session into the server's
    SQLite file while the flow run did, and lost the lock with a ``database is locked`` traceback.
    Prefect's INFO lines stay off the console (:func:`_quiet_console`).
    """
    import prefect.settings

    from latentmill.prefect_env import start_api_early

    defaults = {getattr(prefect.settings, setting): value for setting, value in _CLI_SETTINGS.items()
                if setting not in os.environ}
    with prefect.settings.temporary_settings(defaults):
        early_api = start_api_early()  # None with PREFECT_API_URL set, or off the main thread
        flow = getattr(importlib.import_module(module), name)
        with _quiet_console():
            if early_api is None:
                return flow(*args)
            early_api.ready(prefect.settings.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
            with early_api.settings():
                return flow(*args)


def prep(recipe: Recipe) -> dict[str, Any]:
    """Prepare the latent cache and publish its snapshot: ``{"stages": {...}, "snapshot": {...}}``."""
    return _run_flow("latentmill.pipelines.prep", "prep_recipe", _checked(recipe))


def train(recipe: Recipe, nproc: int = 1, nnodes: int = 1, rdzv_endpoint: str | None = None) -> dict[str, Any]:
    """Train on the recipe's snapshot (``nproc`` > 1: under torchrun): ``{"train": {...}}``."""
    return _run_flow("latentmill.pipelines.flows", "train_recipe_flow", _checked(recipe), nproc, nnodes, rdzv_endpoint)


def run(recipe: Recipe, nproc: int = 1, nnodes: int = 1, rdzv_endpoint: str | None = None) -> dict[str, Any]:
    """Prep, then train on the new snapshot: ``{"stages": {...}, "snapshot": {...}, "train": {...}}``."""
    return _run_flow("latentmill.pipelines.flows", "prep_then_train_recipe", _checked(recipe), nproc, nnodes, rdzv_endpoint)


__all__ = ["prep", "train", "run"]
