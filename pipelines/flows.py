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
from pipelines.prep import prep, release_prep_models, run_prep
from pipelines.snapshot import resolve_snapshot


@task(name="train-model", cache_policy=NONE)
def train_task(recipe_data: dict) -> dict[str, Any]:
    """Train on the recipe's latent cache in this process and export the result."""
    return train_recipe(recipe_from_dict(recipe_data))


@dataclasses.dataclass(frozen=True)
class Launch:
    """How many training processes, and on how many nodes (torchrun's c10d rendezvous when > 1)."""

    nproc: int = 1  # processes on this node
    nnodes: int = 1
    rdzv_endpoint: str | None = None  # host:port of the rendezvous (the first node), needed when nnodes > 1
    rdzv_id: str = "latentmill"

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone", f"--nproc-per-node={self.nproc}"]
        return [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}"]


@task(name="train-torchrun", cache_policy=NONE)
def torchrun_task(recipe_data: dict, launch: Launch) -> dict[str, Any]:
    """Train with the processes torchrun starts on this node; return the summary (rank 0's node only)."""
    recipe = recipe_from_dict(recipe_data)
    recipe.train_dir.mkdir(parents=True, exist_ok=True)
    recipe_json, summary_json = recipe.train_dir / "launch-recipe.json", recipe.train_dir / "launch-summary.json"
    recipe_json.write_text(json.dumps(recipe_data))
    summary_json.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch.torchrun_args(),
           "-m", "pipelines.launch", str(recipe_json), str(summary_json)]
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with status {done.returncode}; see the rank logs above")
    if not summary_json.is_file():  # another node holds global rank 0
        return {"steps": None, "note": "the summary is written on the node that holds global rank 0"}
    return json.loads(summary_json.read_text())


def check_launch(recipe: Recipe, launch: Launch) -> None:
    """Fail before any work when the process layout does not fit the recipe's parallel strategy."""
    if launch.nproc < 1 or launch.nnodes < 1:
        raise ConfigError(f"--nproc and --nnodes: must be >= 1, got {launch.nproc} and {launch.nnodes}")
    world = launch.nproc * launch.nnodes
    if world > 1 and recipe.parallel.strategy == "none":
        raise ConfigError(f"{world} processes need parallel.strategy 'ddp' or 'fsdp2' (allowed with more than "
                          "one process: 'ddp', 'fsdp2'); add parallel.strategy=ddp or parallel.strategy=fsdp2")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the first node's address)")
    check_gpus_per_node(launch.nproc, _visible_gpus())


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus_per_node(nproc: int, gpus: int) -> None:
    """On a node with GPUs each process trains on one of its own (NCCL refuses two ranks on one GPU)."""
    if gpus and nproc > gpus:
        raise ConfigError(f"--nproc {nproc}: this node has {gpus} GPU{'s' if gpus > 1 else ''}, one process "
                          f"trains per GPU; use --nproc {gpus} or fewer")


def run_train(recipe: Recipe, launch: Launch = Launch()) -> dict[str, Any]:
    """Train on the recipe's snapshot, in this process or under torchrun."""
    check_launch(recipe, launch)
    resolve_snapshot(recipe.output_dir, recipe.snapshot)  # clear error if prep has not run
    if launch.nproc * launch.nnodes == 1:
        return train_task(recipe.to_dict())
    return torchrun_task(recipe.to_dict(), launch)


@flow(name="train")
def train(config: str = "configs/demo.yaml", overrides: list[str] | None = None, nproc: int = 1,
          nnodes: int = 1, rdzv_endpoint: str | None = None) -> dict[str, Any]:
    """Train on a prepared dataset snapshot: ``{"train": {...}}``."""
    recipe = load_recipe(config, overrides)
    return {"train": run_train(recipe, Launch(nproc, nnodes, rdzv_endpoint))}


@flow(name="prep-then-train")
def prep_then_train(config: str = "configs/demo.yaml", overrides: list[str] | None = None,
                    nproc: int = 1) -> dict[str, Any]:
    """Prepare the latent cache, then train on its snapshot: ``{"stages", "snapshot", "train"}``."""
    recipe = load_recipe(config, overrides)
    check_launch(recipe, Launch(nproc))
    prepared = run_prep(recipe)
    release_prep_models()  # the encoders are done: training gets the GPUs whole
    return {**prepared, "train": run_train(recipe, Launch(nproc))}


@flow(name="refresh")
def refresh(config: str = "configs/demo.yaml", overrides: list[str] | None = None, train: bool = False,
            nproc: int = 1) -> dict[str, Any]:
    """Prep incrementally (only new or changed inputs cost work); train on the snapshot if it is new."""
    recipe = load_recipe(config, overrides)
    check_launch(recipe, Launch(nproc))
    prepared = run_prep(recipe)
    result = dict(prepared)
    if train and prepared["snapshot"]["new"]:
        snapshot = dataclasses.replace(recipe, snapshot=prepared["snapshot"]["name"])
        release_prep_models()  # the encoders are done: training gets the GPUs whole
        result["train"] = run_train(snapshot, Launch(nproc))
    return result


__all__ = ["prep", "train", "prep_then_train", "refresh"]
