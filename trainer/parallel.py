"""Process-level parallelism, activation checkpointing and compile, applied from outside to an unmodified model.

``strategy: none`` is one process. ``strategy: ddp`` is PyTorch DistributedDataParallel over the processes
that ``torchrun --nproc-per-node N`` starts (NCCL on CUDA, gloo on CPU): every rank holds the full model,
reads its own slice of each global batch (``LatentLoader(rank=, world_size=)``) and draws its samples' noise;
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

import datetime
import gc
import logging
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from latentmill.trainer.config import ParallelConfig
from torch import nn

from latentmill.core.config import ConfigError

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
    cp_size: int = 1  # consecutive ranks that split each sample's sequence (``parallel.cp_size``)

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks: the ranks of one cp group read the same samples."""
        return self.rank // self.cp_size

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples (world size / cp size)."""
        return self.world_size // self.cp_size

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
        # imported before the group exists: torch.distributed.nn.functional (which FSDP2 imports) takes
        # group.WORLD as default arguments, which, evaluated after init, would keep the group alive past its end
        from torch.distributed import nn as dist_nn  # noqa: F401

        backend = "nccl" if cuda else "gloo"
        timeout = datetime.timedelta(minutes=parallel.timeout_minutes)  # not NCCL's default 10 minutes
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    if parallel.strategy == "fsdp2" and world % parallel.hsdp_replicate:
        raise ConfigError(
            f"parallel.hsdp_replicate: {parallel.hsdp_replicate} does not divide the {world} launched processes"
        )
    if (world // parallel.hsdp_replicate) % parallel.cp_size:
        raise ConfigError(f"parallel.cp_size: {parallel.cp_size} does not divide the {world // parallel.hsdp_replicate} "
                          "ranks of a shard group (launched processes / parallel.hsdp_replicate)")
    return DistContext(rank, world, local_rank, device, initialized=True, owns_group=owns_group,
                       strategy=parallel.strategy, cp_size=parallel.cp_size)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (the Diffusers way: ``enable_gradient_checkpointing``,
    which wraps each block call in ``torch.utils.checkpoint``, non-reentrant); parameter names do not change."""
    model.enable_gradient_checkpointing()


def apply_compile(blocks: list[nn.Module]) -> None:
    """``torch.compile`` each transformer block in place (``nn.Module.compile``: names and state dicts stay)."""
    for block in blocks:
        block.compile()


def build_mesh(parallel: ParallelConfig, ctx: DistContext, shape: tuple[int, ...] | None = None,
               names: tuple[str, ...] | None = None):
    """The FSDP2 device mesh: 1-D over all ranks, or (replicate, shard) for HSDP (or the mesh ``shape`` with
    dims ``names``); every group of it waits ``parallel.timeout_minutes`` for its collectives.

    With context parallelism the cp ranks are consecutive, so each cp group lies inside a shard group:
    FSDP2 shards over the cp ranks too (``latentmill.trainer.context``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if shape is None:
        replicate = parallel.hsdp_replicate
        shape, names = ((replicate, ctx.world_size // replicate), ("replicate", "shard")) if replicate > 1 \
            else ((ctx.world_size,), ("shard",))
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    # the mesh's subgroups start with the backend's default timeout, and every collective on them runs there
    timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
    for name in mesh.mesh_dim_names:
        group = mesh.get_group(name)
        if dist.get_backend(group) != "fake":  # latentmill plan's fake group never waits (and has no timeout)
            group.set_timeout(timeout)
    return mesh


@dataclass
class FSDPUnit:
    """One ``fully_shard`` call: its module, or modules grouped into one all-gather, and its compute dtype."""

    name: str  # dotted path in the model ("" = the root; a group: its paths joined by ",")
    modules: list[nn.Module]
    param_dtype: torch.dtype | None  # the gathered parameters' dtype (None: as stored, no mixed precision)
    reshard_after_forward: bool | None = None  # None: FSDP2's default (True; the root False)


def _keep_in_fp32(model: nn.Module) -> tuple[str, ...]:
    """The model class's ``_keep_in_fp32_modules`` (Wan: rope, time_embedder, scale_shift_table, norm1-3)."""
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


def _kept_modules(owner: nn.Module, keep: tuple[str, ...], skip: set[int]) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``owner`` that Diffusers keeps in float32, with their paths in ``owner``.

    Diffusers' rule (``load_model_dict_into_meta``): a name is kept when one of its dot-separated components
    is in ``keep``; walking down, the first such component names the kept module. Subtrees of the modules in
    ``skip`` (the blocks, when ``owner`` is the root) are their own scopes.
    """
    found: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if id(child) in skip:
                continue
            if name in keep:
                found.append((path, child))
            else:
                walk(child, path)

    walk(owner, "")
    return found


def fsdp_units(model: nn.Module, blocks: list[nn.Module], mixed_precision: bool) -> list[FSDPUnit]:
    """The FSDP2 units of ``model`` in the order ``fully_shard`` needs (bottom-up, the root last).

    Without mixed precision: one unit per block, then the root. With it, units compute in bfloat16 except
    what the model class keeps in float32 (``_keep_in_fp32_modules``), as its Diffusers pipeline does:

    * a kept module that owns parameters (Wan's ``condition_embedder.time_embedder``) is a float32 unit;
    * a kept *parameter* held directly by a block or the root (Wan's ``scale_shift_table``) cannot be a unit
      of its own, and an FSDP2 unit has one compute dtype. So its owner becomes the float32 unit (holding
      the kept parameter and the owner's kept children, e.g. a block's ``norm2``), and the owner's other
      children with parameters (``attn1``, ``attn2``, ``ffn``) are one bfloat16 unit, grouped with
      ``fully_shard([attn1, attn2, ffn])``: the bulk of a block is still one bf16 all-gather, the float32
      one is a few kB. (The alternatives: a bf16 ``scale_shift_table`` rounds every block's modulation;
      ``ignored_params`` would leave its gradient unreduced; a float32 block doubles the all-gather.)
    * a kept module without parameters (Wan's ``rope``, float64 buffers) needs nothing: FSDP2 leaves buffers
      alone, and with ``cast_forward_inputs=False`` its output reaches the blocks as computed.
    """
    bf16 = torch.bfloat16 if mixed_precision else None
    keep = _keep_in_fp32(model) if mixed_precision else ()
    assigned: set[int] = set()  # ids of the parameters already in a unit
    units: list[FSDPUnit] = []

    def unassigned(module: nn.Module) -> bool:
        return any(id(p) not in assigned for p in module.parameters())

    def add(name: str, modules: list[nn.Module], dtype: torch.dtype | None, reshard: bool | None) -> None:
        units.append(FSDPUnit(name, modules, dtype, reshard))
        assigned.update(id(p) for m in modules for p in m.parameters())

    def scope(owner: nn.Module, prefix: str, reshard: bool | None, skip: set[int]) -> None:
        def path(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        owns_kept = any(n in keep for n, _ in owner.named_parameters(recurse=False))
        for name, module in _kept_modules(owner, keep, skip):
            if unassigned(module) and not (owns_kept and "." not in name):  # a direct child joins the owner
                add(path(name), [module], torch.float32, reshard)
        if owns_kept:
            rest = [(n, m) for n, m in owner.named_children()
                    if id(m) not in skip and n not in keep and unassigned(m)]
            if rest:  # gathered with the owner (root: for the whole step, as FSDP2 keeps the root)
                add(",".join(path(n) for n, _ in rest), [m for _, m in rest], bf16,
                    False if reshard is None else reshard)
            add(prefix, [owner], torch.float32, reshard)
        else:
            add(prefix, [owner], bf16, reshard)

    names = {id(m): n for n, m in model.named_modules()}
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again right away by the root: keep them gathered
        scope(block, names.get(id(block), f"blocks[{i}]"), i < len(blocks) - 1, set())
    scope(model, "", None, {id(b) for b in blocks})
    return units


def apply_fsdp2(
    model: nn.Module,
    blocks: list[nn.Module],
    parallel: ParallelConfig,
    ctx: DistContext,
    *,
    mixed_precision: bool | None = None,
) -> nn.Module:
    """``fully_shard`` the units of ``fsdp_units`` (each block, then the root) on the mesh.

    ``mixed_precision``: None = ``parallel.mixed_precision`` on CUDA only (CPU trains in float32); True
    forces it (the CPU tests). Mixed precision gathers parameters in bfloat16 and reduce-scatters gradients
    in float32, and does not cast forward inputs (``cast_forward_inputs=False``): the training loop's bf16
    autocast decides what computes in bf16, exactly as under DDP, so what a Diffusers model keeps in float32
    (Flux's and Wan's rotary embeddings, Wan's timestep 949.7 on its way to ``time_embedder``, which a cast
    makes 948.0) stays float32. It therefore needs autocast around the forward, as on CUDA.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Flux blocks return views (splits of one tensor); the adapters never modify a model output in place,
    # which is the case this warning is about, so it is noise here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    if mixed_precision is None:
        mixed_precision = parallel.mixed_precision and ctx.device.type == "cuda"
    mesh = build_mesh(parallel, ctx)
    for unit in fsdp_units(model, blocks, mixed_precision):
        kwargs = {}
        if unit.param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=unit.param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
        if unit.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = unit.reshard_after_forward
        fully_shard(unit.modules if len(unit.modules) > 1 else unit.modules[0], mesh=mesh, **kwargs)
    return model


def parallelize(
    model: nn.Module,
    parallel: ParallelConfig,
    ctx: DistContext,
    *,
    blocks: list[nn.Module] | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    mixed_precision: bool | None = None,
) -> nn.Module:
    """Apply activation checkpointing, compile and the strategy to ``model``; return what to call forward on.

    DDP returns a wrapper (save and export the unwrapped ``model``); FSDP2 shards ``model`` in place and
    returns it. ``blocks`` are the repeated transformer blocks (FSDP2 units and compile units).
    ``mixed_precision`` (FSDP2): None = bf16 on CUDA when ``parallel.mixed_precision``; True/False force it
    (see ``apply_fsdp2``).
    """
    blocks = list(blocks or [])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(blocks)
    if parallel.strategy == "fsdp2" and ctx.initialized:
        return apply_fsdp2(model, blocks, parallel, ctx, mixed_precision=mixed_precision)
    if parallel.strategy == "ddp" and ctx.initialized:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


def shutdown(ctx: DistContext, *, synchronize: bool = True) -> None:
    """End the process group this context started (:func:`end_process_group`)."""
    if ctx.owns_group and dist.is_initialized():
        end_process_group(synchronize=synchronize)


def end_process_group(*, synchronize: bool = True) -> None:
    """End this process's process groups; drop the models and optimizers first.

    ``synchronize`` (a run that ended normally, or stopped at the same point, on every rank): every rank first passes a barrier, so no rank
    tears its communicator down under a slower peer's last collective and nothing is left in flight. Then the
    groups lose their last references and the backend joins its threads here: a group still referenced (every
    ``DeviceMesh`` holds its groups, and DTensor's caches keep meshes after their model is gone) would keep
    gloo's threads running into interpreter finalization, where one that needs the GIL is ended by a
    destructor ("terminate called without an active exception", SIGABRT).

    After an error pass ``synchronize=False``: a failed peer may never arrive and a collective may still be in
    flight, so there is no barrier and no clean-up: the groups are destroyed as they are (what still holds
    them keeps their threads), and the launcher ends the other ranks.
    """
    if synchronize:
        if dist.get_world_size() > 1:
            dist.barrier()
        if "torch.distributed.device_mesh" in sys.modules:
            from torch.distributed.device_mesh import DeviceMesh

            gc.collect()  # dropped models' reference cycles
            for obj in gc.get_objects():  # the meshes that caches still hold, wherever they are
                if isinstance(obj, DeviceMesh):
                    getattr(obj, "_pg_registry", {}).clear()
    dist.destroy_process_group()
