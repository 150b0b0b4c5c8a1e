"""Checkpoints that hold everything an exact resume needs, written atomically under ``step-NNNNNN/`` folders.

Layout of ``<train_dir>/checkpoints/step-000010/``:

* ``model.safetensors``  - the trainable parameters (all of them in full mode, the LoRA ones in lora mode);
* ``optimizer.pt``       - optimizer and LR-scheduler state dicts (``torch.save``; loaded ``weights_only=True``);
* ``rng.safetensors``    - torch CPU (and CUDA) RNG state and the noise-sampling generator state (uint8);
* ``trainer_state.json`` - step, loader position, last loss, config.

A folder is written as ``step-000010.tmp`` and renamed once complete, so ``latest_checkpoint`` (the highest
``step-NNNNNN`` without suffix) never picks a partial one. ``keep_latest_k`` prunes older steps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_FILE, OPTIM_FILE, RNG_FILE, STATE_FILE = (
    "model.safetensors",
    "optimizer.pt",
    "rng.safetensors",
    "trainer_state.json",
)


def step_dir_name(step: int) -> str:
    """``step-000010`` for step 10."""
    return f"step-{step:06d}"


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``ckpt_dir`` as (step, path), lowest step first; ``.tmp`` folders are ignored."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for child in ckpt_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (``requires_grad``), by their names in ``model``."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampling_generator: torch.Generator,
    trainer_state: dict[str, Any],
    keep_latest_k: int = 0,
) -> Path:
    """Write ``step-NNNNNN`` atomically (tmp folder, then rename), prune to ``keep_latest_k``; return its path."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / (final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # leftover of a run killed while saving
    tmp.mkdir()

    weights = {k: v.to("cpu").contiguous() for k, v in trainable_state_dict(model).items()}
    save_file(weights, tmp / MODEL_FILE)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / OPTIM_FILE)
    rng = {"torch_cpu": torch.get_rng_state(), "sampling": sampling_generator.get_state()}
    if torch.cuda.is_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    save_file(rng, tmp / RNG_FILE)
    (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2, sort_keys=True))
    for name in (MODEL_FILE, OPTIM_FILE, RNG_FILE, STATE_FILE):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())

    if final.exists():  # re-saving a step (e.g. after resuming from an older one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    prune_checkpoints(ckpt_dir, keep_latest_k)
    return final


def prune_checkpoints(ckpt_dir: str | Path, keep_latest_k: int) -> list[Path]:
    """Delete all but the ``keep_latest_k`` newest complete checkpoints (0 keeps all); return what went."""
    if keep_latest_k <= 0:
        return []
    doomed = [path for _, path in list_checkpoints(ckpt_dir)[:-keep_latest_k]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def resolve_resume(resume: str | None, ckpt_dir: str | Path) -> Path | None:
    """Turn ``trainer.resume`` into a checkpoint folder: None, ``latest`` (None if there is none yet) or a path."""
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(ckpt_dir)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"trainer.resume: {path} is not a complete checkpoint folder (no {STATE_FILE})"
        )
    return path


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampling_generator: torch.Generator,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states in place; return the saved ``trainer_state``."""
    path = Path(path)
    weights = load_file(path / MODEL_FILE)
    expected = set(trainable_state_dict(model))
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(
            f"{path}: checkpoint weights do not match the model's trainable parameters "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}); was it saved in another trainer.mode?"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    optim = torch.load(path / OPTIM_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(optim["optimizer"])
    scheduler.load_state_dict(optim["scheduler"])
    rng = load_file(path / RNG_FILE)
    torch.set_rng_state(rng["torch_cpu"])
    sampling_generator.set_state(rng["sampling"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])
    return json.loads((path / STATE_FILE).read_text())
