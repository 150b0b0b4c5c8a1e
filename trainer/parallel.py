"""Process-level parallelism, activation checkpointing and compile, applied from outside to an unmodified model.

``strategy: none`` is one process. ``strategy: ddp`` is PyTorch DistributedDataParallel over the processes
that ``torchrun --nproc-per-node N`` starts (NCCL on CUDA, gloo on CPU): every rank holds the full model,
reads its own share of each epoch's batches (``LatentLoader(rank=, world_size=)``) and draws its own noise;
gradients are averaged, so weights and optimizer state stay identical on every rank. Rank 0 writes metrics,
checkpoint weights and the export; every rank writes its own RNG state.

``strategy: fsdp2`` shards parameters, gradients and optimizer state with ``torch.distributed.fsdp.fully_shard``
(FSDP2): one FSDP unit per transformer block, then the root, on a 1-D ``DeviceMesh`` over all ranks, or a
2-D (replicate x shard) mesh for HSDP when ``parallel.hsdp_replicate`` > 1. On CUDA the mixed-precision
policy computes in bfloat16 and reduces gradients in float32. Checkpoints are then sharded
(``torch.distributed.checkpoint``, see ``latentmill.trainer.checkpoint``) and the export gathers a full state dict.
The same code runs on CPU with gloo (torch >= 2.6), which is how the tests exercise it.

Order, as in torchtitan: activation checkpointing, then compile (per block), then FSDP2/DDP.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from latentmill.trainer.config import ParallelConfig
from torch import nn

from latentmill.config import ConfigError

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
    strategy: str = "none"  # what ``parallelize`` applied: none | ddp | fsdp2

    @property
    def sharded(self) -> bool:
        """Parameters are FSDP2 DTensor shards (checkpoints via DCP, export gathers a full state dict)."""
        return self.strategy == "fsdp2"

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
    # ddp / fsdp2
    if world == 1 or "RANK" not in os.environ:
        if parallel.strategy == "ddp":
            log.info("parallel.strategy ddp in a single process: training without DDP")
            return DistContext(device=torch.device("cuda" if cuda else "cpu"))
        # fsdp2 in one process: a group of one (in-process store), so the sharded code path is the same
        return _start_group(parallel, 0, 0, cuda, store=dist.HashStore())
    return _start_group(parallel, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), cuda)


def local_gpu(local_rank: int, visible: int) -> int:
    """The GPU index of local rank ``local_rank`` among the ``visible`` ones: its own ordinal when the
    process sees every GPU of the node, 0 when a launcher gave each rank one GPU (``CUDA_VISIBLE_DEVICES``,
    ``srun --gpus-per-task=1``)."""
    if visible < 1:
        raise RuntimeError("CUDA is available but no GPU is visible to this process")
    return local_rank % visible


def _start_group(parallel: ParallelConfig, rank: int, local_rank: int, cuda: bool, store=None) -> DistContext:
    if cuda:
        torch.cuda.set_device(local_gpu(local_rank, torch.cuda.device_count()))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = "nccl" if cuda else "gloo"
        if store is None:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    world = dist.get_world_size()
    if parallel.strategy == "fsdp2" and world % parallel.hsdp_replicate:
        raise ConfigError(
            f"parallel.hsdp_replicate: {parallel.hsdp_replicate} does not divide the {world} launched processes"
        )
    return DistContext(
        rank, world, local_rank, device, initialized=True, owns_group=owns_group, strategy=parallel.strategy
    )


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (the Diffusers way: ``enable_gradient_checkpointing``,
    which wraps each block call in ``torch.utils.checkpoint``, non-reentrant); parameter names do not change."""
    model.enable_gradient_checkpointing()


def apply_compile(blocks: list[nn.Module]) -> None:
    """``torch.compile`` each transformer block in place (``nn.Module.compile``: names and state dicts stay)."""
    for block in blocks:
        block.compile()


def build_mesh(parallel: ParallelConfig, ctx: DistContext):
    """The FSDP2 device mesh: 1-D over all ranks, or (replicate, shard) for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = ctx.device.type
    if parallel.hsdp_replicate > 1:
        shards = ctx.world_size // parallel.hsdp_replicate
        return init_device_mesh(
            device_type, (parallel.hsdp_replicate, shards), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device_type, (ctx.world_size,), mesh_dim_names=("shard",))


def apply_fsdp2(
    model: nn.Module, blocks: list[nn.Module], parallel: ParallelConfig, ctx: DistContext
) -> nn.Module:
    """``fully_shard`` each block, then the root, on the mesh; bf16 mixed precision on CUDA."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Flux blocks return views (splits of one tensor); the adapters never modify a model output in place,
    # which is the case this warning is about, so it is noise here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    mesh = build_mesh(parallel, ctx)
    kwargs = {"mesh": mesh}
    if ctx.device.type == "cuda" and parallel.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again right away by the root: keep them gathered
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model


def parallelize(
    model: nn.Module,
    parallel: ParallelConfig,
    ctx: DistContext,
    *,
    blocks: list[nn.Module] | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> nn.Module:
    """Apply activation checkpointing, compile and the strategy to ``model``; return what to call forward on.

    DDP returns a wrapper (save and export the unwrapped ``model``); FSDP2 shards ``model`` in place and
    returns it. ``blocks`` are the repeated transformer blocks (FSDP2 units and compile units).
    """
    blocks = list(blocks or [])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(blocks)
    if parallel.strategy == "fsdp2" and ctx.initialized:
        return apply_fsdp2(model, blocks, parallel, ctx)
    if parallel.strategy == "ddp" and ctx.initialized:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


def shutdown(ctx: DistContext) -> None:
    """End the process group this context started."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
