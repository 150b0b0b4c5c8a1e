"""Checkpoints that hold everything an exact resume needs, written atomically under ``step-NNNNNN/`` folders.

Layout of ``<train_dir>/checkpoints/step-000010/``:

* ``model.safetensors``  - the trainable parameters (all of them in full mode, the LoRA ones in lora mode);
* ``optimizer.pt``       - optimizer and LR-scheduler state dicts (``torch.save``; loaded ``weights_only=True``);
* ``rng-rank0.safetensors`` - torch CPU (and CUDA) RNG and noise-sampling generator states (uint8), one
  file per rank;
* ``trainer_state.json`` - step, loader position, last loss, config.

A folder is written as ``step-000010.tmp`` and renamed once complete (by rank 0, after every rank wrote
its part), so ``latest_checkpoint`` (the highest ``step-NNNNNN`` without suffix) never picks a partial
one. ``keep_latest_k`` prunes older steps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_FILE, OPTIM_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "trainer_state.json"


def rng_file(rank: int) -> str:
    """Name of the RNG-state file of ``rank``."""
    return f"rng-rank{rank}.safetensors"


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
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Write ``step-NNNNNN`` atomically (tmp folder, then rename), prune to ``keep_latest_k``; return its path.

    Under DDP every rank calls this with its ``rank`` and a ``barrier``: rank 0 writes the shared files,
    each rank its RNG state, and rank 0 renames the folder once all are written.
    """
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / (final.name + ".tmp")
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # leftover of a run killed while saving
        tmp.mkdir()
    barrier()

    written = [rng_file(rank)]
    rng = {"torch_cpu": torch.get_rng_state(), "sampling": sampling_generator.get_state()}
    if torch.cuda.is_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    save_file(rng, tmp / rng_file(rank))
    if rank == 0:
        weights = {k: v.to("cpu").contiguous() for k, v in trainable_state_dict(model).items()}
        save_file(weights, tmp / MODEL_FILE)
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / OPTIM_FILE
        )
        (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2, sort_keys=True))
        written += [MODEL_FILE, OPTIM_FILE, STATE_FILE]
    for name in written:
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    barrier()

    if rank == 0:
        if final.exists():  # re-saving a step (e.g. after resuming from an older one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        prune_checkpoints(ckpt_dir, keep_latest_k)
    barrier()
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
    rank: int = 0,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and ``rank``'s RNG states in place; return the ``trainer_state``."""
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
    if (path / rng_file(rank)).is_file():
        rng = load_file(path / rng_file(rank))
        torch.set_rng_state(rng["torch_cpu"])
        sampling_generator.set_state(rng["sampling"])
        if "torch_cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["torch_cuda"])
    else:  # saved with fewer processes: this rank keeps its fresh seed
        log.warning("%s has no RNG state for rank %d; this rank's noise starts from its seed", path, rank)
    return json.loads((path / STATE_FILE).read_text())
