"""Checkpoints that hold everything an exact resume needs, written atomically under ``step-NNNNNN/`` folders.

Layout of ``<train_dir>/checkpoints/step-000010/``:

* ``model.safetensors``  - the trainable parameters (all of them in full mode, the LoRA ones in lora mode);
* ``optimizer.pt``       - optimizer and LR-scheduler state dicts (``torch.save``; loaded ``weights_only=True``);
* ``rng-rank0.safetensors`` - torch's CPU (and CUDA) RNG states (uint8), one file per rank (the noise of
  training draws from generators keyed by sample, not from these: ``latentmill.trainer.train.draw_micro_batch``);
* ``trainer_state.json`` - step, loader position, last loss, config;
* ``<component>/``         - a run of two models (``trainer.expert: both``): the second model's weights, optimizer
  and LR-schedule files, laid out as above (``others``).

With FSDP2 (``sharded=True``) the weights and optimizer state are not gathered: every rank writes its shards
with ``torch.distributed.checkpoint`` (DCP) into ``dcp/`` (model and optimizer state dicts from
``torch.distributed.checkpoint.state_dict.get_state_dict``, trainable parameters only), and the LR schedule
goes to ``lr_scheduler.pt``. A DCP checkpoint can be loaded by any strategy and world size (DCP reshards);
a ``model.safetensors`` checkpoint only by the unsharded strategies (none, ddp).

A folder is written as ``step-000010.tmp`` and renamed once complete (by rank 0, after every rank wrote
its part), so ``latest_checkpoint`` (the highest ``step-NNNNNN`` without suffix) never picks a partial
one. ``keep_latest_k`` prunes older steps. On nodes that each write a folder of their own (an output on an
object store: each node trains in its work folder, ``folder_rank`` the local rank), each node's local rank 0
makes, renames and prunes its node's folder, which holds its ranks' parts; global rank 0 alone still writes
the files that exist once (``trainer_state.json``, the weights or LR schedule).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from latentmill.core import durable
from latentmill.tinyio import apply_umask

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_FILE, OPTIM_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "trainer_state.json"
DCP_DIR, SCHED_FILE = "dcp", "lr_scheduler.pt"


def rng_file(rank: int) -> str:
    """Name of the RNG-state file of ``rank``."""
    return f"rng-rank{rank}.safetensors"


def step_dir_name(step: int) -> str:
    """``step-000010`` for step 10."""
    return f"step-{step:06d}"


def list_checkpoints(ckpt_dir: str | Path, whole: bool = True) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``ckpt_dir`` as (step, path), lowest step first; ``.tmp`` folders are ignored.
    ``whole=False``: every renamed ``step-N`` folder, with ``trainer_state.json`` or not (the parts another
    node than global rank 0's wrote)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for child in ckpt_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (not whole or (child / STATE_FILE).is_file()):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (``requires_grad``), by their names in ``model``."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    keep_latest_k: int = 0,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    sharded: bool = False,
    others: dict[str, tuple[nn.Module, torch.optim.Optimizer, Any]] | None = None,
    folder_rank: int | None = None,
) -> Path:
    """Write ``step-NNNNNN`` atomically (tmp folder, then rename), prune to ``keep_latest_k``; return its path.

    ``others``: further (model, optimizer, scheduler) of the run by subfolder name, each written like the first.

    Under DDP/FSDP2 every rank calls this with its ``rank`` and a ``barrier``: rank 0 writes the shared files,
    each rank its RNG state (and with ``sharded`` its DCP shards), and rank 0 renames the folder once all
    are written. ``folder_rank``: this rank's place among the ranks that share ``ckpt_dir``'s file system
    (None: ``rank``, one file system for every rank); the rank whose ``folder_rank`` is 0 makes, clears, renames
    and prunes the folder. Each node's local rank when each node writes a folder of its own.
    """
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / (final.name + ".tmp")
    folder_rank = rank if folder_rank is None else folder_rank
    if folder_rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # leftover of a run killed while saving
        tmp.mkdir()
    barrier()

    written = [rng_file(rank)]
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    save_file(rng, tmp / rng_file(rank))
    for folder, (part_model, part_optimizer, part_scheduler) in {"": (model, optimizer, scheduler),
                                                                 **(others or {})}.items():
        if folder:  # made before any rank writes its shards there
            if folder_rank == 0:
                (tmp / folder).mkdir()
            barrier()
        written += [str(Path(folder) / name) for name in
                    _save_weights(tmp / folder, part_model, part_optimizer, part_scheduler, rank, sharded)]
    if rank == 0:
        state = {**trainer_state, "step": step, "format": "dcp" if sharded else "safetensors"}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
        written += [STATE_FILE]
    for name in written:
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    barrier()

    if folder_rank == 0:
        apply_umask(tmp)  # safetensors writes 0600: give checkpoints the modes of every other file
        if final.exists():  # re-saving a step (e.g. after resuming from an older one)
            shutil.rmtree(final)
        durable.replace(tmp, final)
        # another node's folder holds no trainer_state.json: its step folders are its parts of the same steps
        prune_checkpoints(ckpt_dir, keep_latest_k, whole=rank == 0)
    barrier()
    return final


def _save_weights(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int,
                  sharded: bool) -> list[str]:
    """One model's weights, optimizer and LR schedule into ``folder``; the names of the files rank 0 wrote."""
    if sharded:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = _dcp_state_dicts(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=folder / DCP_DIR)
    if rank != 0:
        return []
    if sharded:
        torch.save({"scheduler": scheduler.state_dict()}, folder / SCHED_FILE)
        return [SCHED_FILE]
    weights = {k: v.to("cpu").contiguous() for k, v in trainable_state_dict(model).items()}
    save_file(weights, folder / MODEL_FILE)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, folder / OPTIM_FILE)
    return [MODEL_FILE, OPTIM_FILE]


def _dcp_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model (trainable parameters only) and optimizer state dicts keyed by parameter name, as DCP wants."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))


def prune_checkpoints(ckpt_dir: str | Path, keep_latest_k: int, whole: bool = True) -> list[Path]:
    """Delete all but the ``keep_latest_k`` newest complete checkpoints (0 keeps all); return what went.
    ``whole=False``: of every ``step-N`` folder (:func:`list_checkpoints`)."""
    if keep_latest_k <= 0:
        return []
    doomed = [path for _, path in list_checkpoints(ckpt_dir, whole)[:-keep_latest_k]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def resolve_resume(resume: str | None, ckpt_dir: str | Path, *, announce: bool = True) -> Path | None:
    """Turn ``trainer.resume`` into a checkpoint folder: None, ``latest`` (None if there is none yet) or a path.

    ``latest`` with no checkpoint yet starts from step 0 (a requeued job's first attempt), saying so in one
    log line when ``announce`` (rank 0 only, so a multi-process run prints it once).
    """
    if resume is None:
        return None
    if resume == "latest":
        found = latest_checkpoint(ckpt_dir)
        if found is None and announce:
            log.warning("trainer.resume=latest: no checkpoint found under %s, starting from step 0", ckpt_dir)
        return found
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
    rank: int = 0,
    others: dict[str, tuple[nn.Module, torch.optim.Optimizer, Any]] | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and ``rank``'s RNG states in place; return the ``trainer_state``.

    A sharded (DCP) checkpoint is loaded collectively: every rank of the run calls this, on any number of ranks
    (DCP reshards); an unsharded one holds the full weights and optimizer state, which every rank loads whole.
    ``others``: as saved.
    """
    path = Path(path)
    for folder, (part_model, part_optimizer, part_scheduler) in {"": (model, optimizer, scheduler),
                                                                 **(others or {})}.items():
        if (path / folder / DCP_DIR).is_dir():
            _load_dcp(path / folder, part_model, part_optimizer, part_scheduler)
        else:
            _load_safetensors(path / folder, part_model, part_optimizer, part_scheduler)
    if (path / rng_file(rank)).is_file():
        rng = load_file(path / rng_file(rank))
        torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["torch_cuda"])
    else:  # saved with fewer processes: this rank keeps torch's fresh RNG state
        log.info("%s has no RNG state for rank %d (saved on fewer ranks): torch's RNG keeps its seed", path, rank)
    return read_trainer_state(path)


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of checkpoint folder ``path`` (step, loader position, config)."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def _load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd, optim_sd = _dcp_state_dicts(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        with warnings.catch_warnings():  # loading shards in one process (strategy none) is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path / DCP_DIR)
    except Exception as err:  # DCP names the missing keys deep inside a CheckpointException
        raise ValueError(
            f"{path}: the sharded checkpoint does not match the model's trainable parameters or optimizer "
            f"(was it saved in another trainer.mode?): {str(err)[:500]}"
        ) from err
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        # strict=False: the frozen parameters are not in a state dict taken with ignore_frozen_params (and the
        # trainable ones were all checked by dcp.load above), which a strict load reports as missing
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    scheduler.load_state_dict(
        torch.load(path / SCHED_FILE, map_location="cpu", weights_only=True)["scheduler"]
    )


def _load_safetensors(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    if any(_is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            f"{path} was saved unsharded (parallel.strategy none or ddp); resume it with one of those, "
            "or start the FSDP2 run from the exported weights"
        )
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


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" or type(getattr(tensor, "data", None)).__name__ == "DTensor"
