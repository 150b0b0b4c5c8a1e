"""Process-level parallelism, applied from outside to an unmodified model.

``strategy: none`` is one process. ``strategy: ddp`` is PyTorch DistributedDataParallel over the processes
that ``torchrun --nproc-per-node N`` starts (NCCL on CUDA, gloo on CPU): every rank holds the full model,
reads its own share of each epoch's batches (``LatentLoader(rank=, world_size=)``) and draws its own noise;
gradients are averaged, so weights and optimizer state stay identical on every rank. Rank 0 writes metrics,
checkpoint weights and the export; every rank writes its own RNG state. ``fsdp2`` is not implemented yet.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from latentmill.config import ConfigError
from trainer.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass
class DistContext:
    """Where this process sits: rank, world size and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized: bool = False  # a process group joins the ranks (barrier and all-reduce are real)
    owns_group: bool = False  # this context started the group, so ``shutdown`` ends it

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the files that exist once (metrics, weights, export)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""
        if self.initialized:
            dist.barrier()

    def mean(self, value: float) -> float:
        """Average a float over ranks (for logging the loss of the whole global batch)."""
        if not self.initialized:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def sum(self, value: int) -> int:
        """Sum an int over ranks (e.g. the global batch size)."""
        if not self.initialized:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t)
        return int(t.item())


def _launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(parallel: ParallelConfig) -> DistContext:
    """Set up this process for ``parallel.strategy``; start the process group when torchrun launched several."""
    parallel.validate()
    cuda = torch.cuda.is_available()
    world = _launched_world_size()
    if parallel.strategy == "none":
        if world > 1:
            raise ConfigError(
                f"parallel.strategy: 'none' but {world} processes were launched; use 'ddp' with --nproc > 1"
            )
        return DistContext(device=torch.device("cuda" if cuda else "cpu"))
    # ddp
    if world == 1 or "RANK" not in os.environ:
        log.info("parallel.strategy ddp in a single process: training without DDP")
        return DistContext(device=torch.device("cuda" if cuda else "cpu"))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return DistContext(rank, world, local_rank, device, initialized=True, owns_group=owns_group)


def parallelize(model: nn.Module, parallel: ParallelConfig, ctx: DistContext) -> nn.Module:
    """Wrap ``model`` for the strategy; the unwrapped module stays the one to save and export."""
    if parallel.strategy == "ddp" and ctx.initialized:
        device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


def shutdown(ctx: DistContext) -> None:
    """End the process group this context started."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
