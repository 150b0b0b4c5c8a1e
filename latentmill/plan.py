"""``latentmill plan``: per-rank memory of a real-size run, from its config files alone.

    latentmill plan configs/flux-dev-full.yaml --nproc 8 --nnodes 1 --gpu-memory 80 --json plan.json

The recipe's transformer is built on the meta device from ``model_index.json`` and
``transformer/config.json`` (:func:`latentmill.trainer.model_load.meta_transformer`: no weights, no bytes),
made trainable by the recipe's own LoRA code, and then given to the recipe's own ``parallelize`` under a
*fake* process group of the run's world size (``torch.testing._internal.distributed.fake_pg``: collectives
return at once, nothing is sent). FSDP2 then shards the meta parameters exactly as it does on the GPUs, and
the plan reads rank 0's local shards (``DTensor.to_local()``), so the numbers come from the sharding code
path, not from a formula. Rank 0 holds the largest shards (FSDP2 pads dim 0 to the shard count).

What is counted per rank: parameters (local shards; DDP and none: the full replica), gradients (trainable
local shards in float32, kept sharded across accumulation micro-batches; DDP adds its bucket buffers),
AdamW state (read from a real ``torch.optim.AdamW`` stepped once over the meta parameters), the transient
gathered parameters of FSDP2 (the root unit plus two block units, current and prefetched, in the compute
dtype), and host RAM at load and at export. On top of that static part: the activations of the recipe's largest
bucket with and without activation checkpointing, divided by cp (:mod:`latentmill.activations`), AdamW's foreach
temporaries, FSDP2's reduce-scatter buffers and a CUDA/NCCL context allowance; ``fits`` is judged on the peak
(:func:`total_bytes`), and :func:`suggest` names the smallest cp and checkpointing setting that fit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from latentmill.activations import COMPUTE_BYTES, ActivationShape, activation_bytes, activation_shape
from latentmill.core.config import ConfigError
from latentmill.recipe import Recipe, load_recipe

GIB = 1024**3
# what a rank holds outside PyTorch's allocator: the CUDA context with cuBLAS/cuDNN workspaces (~0.5 GiB on an
# H100) and NCCL's communicator buffers (~1 GiB for the default, shard, replicate and cp groups of a node)
CONTEXT_BYTES = int(1.5 * GIB)
GPUS_PER_NODE = 8  # the default --nproc: recipes describe nodes of 8 GPUs (H100/H200/A100 nodes)

# Hub ids whose published config files ship with latentmill (configs/models/<folder>), with the dtype of
# the published transformer weights (the host bytes of loading them). FLUX.1-dev is published in bfloat16;
# the Wan2.1 Diffusers transformers in float32 (the 1.3B file is 5.68 GB = 1.42B x 4 bytes).
SHIPPED_CONFIGS: dict[str, tuple[str, torch.dtype]] = {
    "black-forest-labs/FLUX.1-dev": ("FLUX.1-dev", torch.bfloat16),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": ("Wan2.1-T2V-14B-Diffusers", torch.float32),
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("Wan2.1-T2V-1.3B-Diffusers", torch.float32),
    # two experts of Wan2.1-14B's architecture (transformer: high noise, transformer_2: low), boundary_ratio 0.875
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": ("Wan2.2-T2V-A14B-Diffusers", torch.bfloat16),
    # its image-to-video pair: the same experts with 36 input channels (latents, mask, condition), boundary_ratio 0.9
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": ("Wan2.2-I2V-A14B-Diffusers", torch.bfloat16),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": ("Wan2.2-TI2V-5B-Diffusers", torch.float32),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": ("Wan2.1-I2V-14B-480P-Diffusers", torch.float32),
    "Tongyi-MAI/Z-Image-Turbo": ("Z-Image-Turbo", torch.bfloat16),
    "Qwen/Qwen-Image": ("Qwen-Image", torch.bfloat16),
    # Qwen-Image-Edit: the same 20B transformer fine-tuned for editing; its transformer and scheduler configs are
    # Qwen-Image's, its pipeline adds the Qwen2VLProcessor its text encoder reads the source image through
    "Qwen/Qwen-Image-Edit": ("Qwen-Image-Edit", torch.bfloat16),
    # FLUX.2, published in bfloat16. The transformer configs are Flux2Transformer2DModel's defaults (written for
    # FLUX.2 [dev]: 8 double + 48 single blocks, 48 heads x 128, joint_attention_dim 15360 = 3 x Mistral Small's
    # 5120) with klein's sizes: 4B 5 + 20 blocks, 24 heads, 7680 = 3 x Qwen3-4B's 2560; 9B 8 + 24 blocks, 32 heads,
    # 12288 = 3 x Qwen3-8B's 4096; no guidance embedding. On meta: 32.2B, 3.88B and 9.08B parameters, the published
    # sizes (tests/test_plan.py). The step-distilled klein repos share the architecture of the base ones (their
    # model_index.json says is_distilled: true); training starts from the base models.
    "black-forest-labs/FLUX.2-dev": ("FLUX.2-dev", torch.bfloat16),
    "black-forest-labs/FLUX.2-klein-base-4B": ("FLUX.2-klein-base-4B", torch.bfloat16),
    "black-forest-labs/FLUX.2-klein-base-9B": ("FLUX.2-klein-base-9B", torch.bfloat16),
    "black-forest-labs/FLUX.2-klein-4B": ("FLUX.2-klein-base-4B", torch.bfloat16),
    "black-forest-labs/FLUX.2-klein-9B": ("FLUX.2-klein-base-9B", torch.bfloat16),
    # HunyuanVideo 1.5 (480p text-to-video): the class defaults of diffusers 0.42 with task_type t2v, 54 blocks of
    # 16 heads x 128, 8.33B parameters on meta (the published "8.3B")
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v": ("HunyuanVideo-1.5-480p_t2v", torch.bfloat16),
    # HunyuanVideo 1.5 (480p image-to-video): the same transformer with task_type i2v, plus the SigLIP so400m image
    # encoder (27 layers, 1152 wide, 729 tokens at 384 px) and its feature_extractor
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v": ("HunyuanVideo-1.5-480p_i2v", torch.bfloat16),
    # LTX-2 (19B: the 48 blocks' 4096-wide video stream and 2048-wide audio stream), published in bfloat16; the
    # transformer config is LTX2VideoTransformer3DModel's defaults (diffusers 0.42 writes them for LTX-2)
    "Lightricks/LTX-2": ("LTX-2", torch.bfloat16),
}
# safetensors header dtype names
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass
class ModelSource:
    """Where the config files come from, and the dtype of the checkpoint's transformer weights."""

    path: Path
    note: str  # a line for the output: which folder, and whether shipped configs stood in for the hub
    shipped: bool
    checkpoint_dtype: torch.dtype
    dtype_note: str


@dataclass
class Layout:
    """The process layout of the planned run."""

    nproc: int
    nnodes: int
    note: str
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


def shipped_models_dir() -> Path:
    """``configs/models`` of the checkout, or ``latentmill/configs/models`` of a wheel."""
    from latentmill.resources import resource_root

    return resource_root() / "configs" / "models"


def _header_dtype(folder: Path) -> torch.dtype | None:
    """The floating dtype of the first tensor in ``folder``'s first safetensors file (header only)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    with open(files[0], "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    for key, entry in header.items():
        if key != "__metadata__" and entry.get("dtype") in _ST_DTYPES:
            return _ST_DTYPES[entry["dtype"]]
    return None


def _architecture(config_file: Path) -> dict[str, Any]:
    """A transformer ``config.json`` without its bookkeeping keys (``_class_name``, ``_diffusers_version``...)."""
    return {k: v for k, v in json.loads(config_file.read_text()).items() if not k.startswith("_")}


def _published_dtype(folder: Path) -> tuple[torch.dtype, str] | None:
    """The published weights' dtype of the shipped entry whose transformer config ``folder`` has (a config-only
    folder: a shipped entry, a copy of one, or the JSON files of a hub repo), None when none matches."""
    config = _architecture(folder / "transformer" / "config.json")
    for hub_id, (entry, dtype) in SHIPPED_CONFIGS.items():
        if _architecture(shipped_models_dir() / entry / "transformer" / "config.json") == config:
            return dtype, f"the published weights of {hub_id} (its transformer config)"
    return None


def _checkpoint_dtype(folder: Path, pretrained: str) -> tuple[torch.dtype, str]:
    """The transformer weights' dtype: from the safetensors headers when the weights are there, else the
    config's ``torch_dtype``, else the published dtype of a known hub id or of the shipped entry with the same
    transformer config, else bfloat16 (the hub default of 12-14B diffusion transformers)."""
    found = _header_dtype(folder / "transformer")
    if found is not None:
        return found, "read from the safetensors headers"
    config = json.loads((folder / "transformer" / "config.json").read_text())
    if isinstance(config.get("torch_dtype"), str) and hasattr(torch, config["torch_dtype"]):
        return getattr(torch, config["torch_dtype"]), "transformer/config.json torch_dtype"
    if pretrained in SHIPPED_CONFIGS:
        return SHIPPED_CONFIGS[pretrained][1], f"the published weights of {pretrained}"
    return _published_dtype(folder) or (torch.bfloat16, "assumed (no weights, no torch_dtype in the config, "
                                        "and not the transformer config of a shipped model)")


def resolve_model(pretrained: str) -> ModelSource:
    """The folder holding ``model_index.json`` and ``transformer/config.json`` for ``model.pretrained``.

    A local folder (configs alone are enough); else the local Hugging Face cache; else, for the hub ids of
    :data:`SHIPPED_CONFIGS`, the published configs shipped with latentmill. Nothing is downloaded.
    """
    path = Path(pretrained).expanduser()
    if path.is_dir():
        if not (path / "transformer" / "config.json").is_file():
            raise ConfigError(f"model.pretrained: {pretrained} has no transformer/config.json (plan needs "
                              "model_index.json and transformer/config.json; weights are not needed)")
        return ModelSource(path, f"configs from {path}", False, *_checkpoint_dtype(path, pretrained))
    if path.exists():
        raise ConfigError(f"model.pretrained: {pretrained} is a file; name a Diffusers pipeline folder or a hub id")
    from latentmill.preflight import HUB_ID

    if pretrained.startswith((".", "/", "~")) or not HUB_ID.match(pretrained):
        hint = " (a tiny-model recipe builds it on the first prep or run)" if "tiny" in pretrained else ""
        raise ConfigError(f"model.pretrained: {pretrained} does not exist, and is not a Hugging Face id{hint}")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = [try_to_load_from_cache(pretrained, name) for name in ("model_index.json", "transformer/config.json")]
    except Exception:  # not a valid repo id, or no cache: fall through to the shipped configs
        cached = [None, None]
    if all(isinstance(c, str) for c in cached):
        root = Path(cached[0]).parent
        return ModelSource(root, f"configs of {pretrained} from the local Hugging Face cache", False,
                           *_checkpoint_dtype(root, pretrained))
    if pretrained in SHIPPED_CONFIGS:
        root = shipped_models_dir() / SHIPPED_CONFIGS[pretrained][0]
        return ModelSource(root, f"{pretrained} is not available locally: used the published configs shipped "
                           f"with latentmill ({root})", True, *_checkpoint_dtype(root, pretrained))
    raise ConfigError(f"model.pretrained: {pretrained} is neither a local folder nor in the local Hugging Face "
                      f"cache, and plan ships configs only for {', '.join(SHIPPED_CONFIGS)}; give a folder "
                      "with model_index.json and transformer/config.json")


def _family(recipe: Recipe, folder: Path) -> str:
    if recipe.model.family != "auto":
        return recipe.model.family
    from latentmill.stages.families import FAMILIES, index_family

    index = json.loads((folder / "model_index.json").read_text())
    family = index_family(index)
    if family is None:
        raise ConfigError(f"model.family: cannot tell the family of a {index.get('_class_name') or 'unknown'} "
                          f"pipeline; set model.family to one of {', '.join(sorted(FAMILIES))}")
    return family


def layout(recipe: Recipe, nproc: int | None, nnodes: int | None) -> Layout:
    """The run's process layout: ``--nproc``/``--nnodes``, else the recipe's.

    A recipe states its layout through ``parallel``: ``strategy: none`` is one process; ``ddp``/``fsdp2``
    run on nodes of 8 GPUs, ``parallel.nnodes`` of them; without that key, an HSDP recipe's ``hsdp_replicate``
    is its number of nodes (shard within a node, replicate across nodes), any other one node.
    """
    parallel = recipe.parallel
    if parallel.strategy == "none":
        note = "parallel.strategy none: one process"
        nproc, nnodes = nproc or 1, nnodes or 1
    else:
        hsdp = parallel.strategy == "fsdp2" and parallel.hsdp_replicate > 1
        if nnodes:
            nodes = f"--nnodes {nnodes}"
        elif parallel.nnodes:
            nnodes, nodes = parallel.nnodes, f"{parallel.nnodes} nodes (parallel.nnodes)"
        elif hsdp:
            nnodes, nodes = parallel.hsdp_replicate, f"{parallel.hsdp_replicate} nodes (= parallel.hsdp_replicate)"
        else:
            nnodes, nodes = 1, "1 node (default)"
        note = (f"--nproc {nproc}" if nproc else f"{GPUS_PER_NODE} GPUs per node (default)") + ", " + nodes
        nproc = nproc or GPUS_PER_NODE
    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"--nproc and --nnodes: must be >= 1, got {nproc} and {nnodes}")
    world = nproc * nnodes
    if parallel.strategy == "none" and world > 1:
        raise ConfigError(f"parallel.strategy: 'none' but {world} processes were asked for; use 'ddp' or 'fsdp2'")
    if parallel.strategy == "fsdp2" and world % parallel.hsdp_replicate:
        raise ConfigError(f"parallel.hsdp_replicate: {parallel.hsdp_replicate} does not divide the {world} "
                          "processes of the plan")
    if (world // parallel.hsdp_replicate) % parallel.cp_size:
        raise ConfigError(f"parallel.cp_size: {parallel.cp_size} does not divide the {world // parallel.hsdp_replicate} "
                          "ranks of a shard group (processes of the plan / parallel.hsdp_replicate)")
    return Layout(nproc, nnodes, note)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of a DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Unit:
    """One FSDP2 unit as ``fully_shard`` built it: what one all-gather brings to the GPU."""

    name: str
    gathered_bytes: int  # full parameters in the unit's compute dtype (mixed precision: its param_dtype)
    block: int | None  # the transformer block it belongs to; None: a root-level unit
    grad_numel: int = 0  # elements of its trainable parameters: the gradients one reduce-scatter sends


def fsdp_units(model: nn.Module, blocks: list[nn.Module]) -> list[Unit]:
    """The FSDP2 units of a sharded ``model``, read from FSDP2's own parameter groups (modules sharded
    together with ``fully_shard([a, b])`` share one group, hence one all-gather), with their gathered size."""
    from torch.distributed.fsdp import FSDPModule

    block_of = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    units: dict[int, Unit] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        if id(state) in units or group is None:
            continue
        dtype = group.mp_policy.param_dtype
        gathered = sum(fp._orig_size.numel() * (dtype or fp.sharded_param.dtype).itemsize
                       for fp in group.fsdp_params)
        grads = sum(fp._orig_size.numel() for fp in group.fsdp_params if fp.sharded_param.requires_grad)
        units[id(state)] = Unit(name, gathered, block_of.get(id(module)), grads)
    return list(units.values())


def _optimizer_state_bytes(trainable: list[nn.Parameter], recipe: Recipe) -> int:
    """Bytes of AdamW state per rank, from a real ``torch.optim.AdamW`` stepped once over the meta
    parameters (its state tensors are then meta DTensor shards too): ``exp_avg`` and ``exp_avg_sq``. The
    0-dim ``step`` counters live on the host and are left out."""
    cfg = recipe.trainer
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay, foreach=False)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    total = sum(_nbytes(_local(v)) for state in optimizer.state.values() for v in state.values()
                if torch.is_tensor(v) and v.dim() > 0)
    for p in trainable:
        p.grad = None
    return total


def _ddp_bucket_bytes(trainable: list[nn.Parameter]) -> tuple[int, int]:
    """``(buckets, bytes)`` of DDP's gradient buckets: torch's own bucket assignment (first bucket 1 MiB,
    then 25 MiB), each bucket a flat buffer of its parameters' gradients. ``DistributedDataParallel`` itself
    cannot be built on meta tensors (it verifies shapes across ranks with ``.item()``)."""
    import torch.distributed as dist

    if not trainable:
        return 0, 0
    buckets, _ = dist._compute_bucket_assignment_by_size(
        trainable, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024], [False] * len(trainable))
    return len(buckets), sum(_nbytes(trainable[i]) for bucket in buckets for i in bucket)


def _is_lora(name: str) -> bool:
    return "lora_" in name


def plan(recipe: Recipe, *, nproc: int | None = None, nnodes: int | None = None,
         gpu_memory_gib: float = 80.0) -> dict[str, Any]:
    """Per-rank memory of ``recipe`` at ``nproc`` x ``nnodes`` processes, from the real sharding path on
    the meta device under a fake process group. Returns the JSON-shaped plan (see the module docstring)."""
    if recipe.trainer.expert == "both":
        return _plan_both(recipe, nproc=nproc, nnodes=nnodes, gpu_memory_gib=gpu_memory_gib)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from latentmill.trainer.adapter import choose_experts
    from latentmill.trainer.adapters import get_adapter
    from latentmill.trainer.context import check_context_parallel, check_heads
    from latentmill.trainer.export import export_peak_bytes
    from latentmill.trainer.model_load import meta_transformer
    from latentmill.trainer.parallel import DistContext, build_mesh, parallelize

    cfg, parallel = recipe.trainer, recipe.parallel
    lay = layout(recipe, nproc, nnodes)
    source = resolve_model(recipe.model.pretrained)
    family = _family(recipe, source.path)
    try:
        adapter = get_adapter(family)
    except ValueError as err:
        raise ConfigError(f"model.family: {err}") from None
    parallel.validate()
    check_context_parallel(parallel, adapter, torch.device("cuda"))  # the plan is of a CUDA run
    # a two-expert pipeline (Wan 2.2 A14B): the expert the run trains; the other is not loaded
    (expert,) = choose_experts(adapter.experts(str(source.path)), cfg.expert, recipe.model.pretrained)
    world = lay.world_size
    sharded = parallel.strategy == "fsdp2"
    # what the trainer loads on CUDA (latentmill.trainer.model_load.load_for_training): float32 masters in a
    # full fine-tune; a bfloat16 frozen base under LoRA, sharded (FSDP2) or not
    base_dtype = torch.bfloat16 if cfg.mode == "lora" else torch.float32
    notes: list[str] = []
    if cfg.compile:
        notes.append("trainer.compile: not applied on meta (torch.compile does not change parameter memory)")
    if parallel.cp_size > 1:
        notes.append(f"parallel.cp_size {parallel.cp_size} ({parallel.cp_kind}): each sample's tokens are split "
                     f"over {parallel.cp_size} ranks, so a rank's sequence activations are 1/{parallel.cp_size}; "
                     f"{world // parallel.cp_size} data-parallel ranks read different samples")

    model = meta_transformer(adapter, str(source.path), mode=cfg.mode, lora_rank=cfg.lora_rank,
                             lora_alpha=cfg.lora_alpha, lora_target_modules=cfg.lora_target_modules,
                             base_dtype=base_dtype, component=expert.component)
    if expert.name != "all":
        notes.append(f"trainer.expert {expert.name}: {expert.component} only (one expert per run; the other "
                     "expert is neither loaded nor trained)")
    check_heads(model, parallel)
    heads = int(getattr(model.config, "num_attention_heads", None) or getattr(model.config, "n_heads", 0))
    cp_options = [1]
    try:
        if sharded:
            check_context_parallel(dataclasses.replace(parallel, cp_size=2), adapter, torch.device("cuda"))
            shard_group = world // parallel.hsdp_replicate
            cp_options = [n for n in range(1, shard_group + 1) if shard_group % n == 0
                          and (parallel.cp_kind != "ulysses" or not heads or heads % n == 0)]
    except ConfigError:  # the family has no context-parallel plan in this diffusers: cp 1 only
        pass
    shape = activation_shape(adapter, family, source.path, dict(model.config), recipe, len(adapter.blocks(model)))
    total_params = sum(p.numel() for p in model.parameters())
    trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    largest_fp32 = max(p.numel() for p in model.parameters()) * 4
    base_params = sum(p.numel() for n, p in model.named_parameters() if not _is_lora(n))
    lora_bytes = sum(_nbytes(p) for n, p in model.named_parameters() if _is_lora(n))

    started = False
    if sharded or (parallel.strategy == "ddp" and world > 1):  # as init_distributed starts a group
        if dist.is_initialized():
            raise RuntimeError("latentmill plan needs its own (fake) process group; one is already running")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        started = True
    try:
        ctx = DistContext(0, world, 0, torch.device("cpu"), initialized=started, owns_group=started,
                          strategy=parallel.strategy, cp_size=parallel.cp_size)
        blocks = adapter.blocks(model)
        mesh_shape = [world]
        if sharded:
            # the units and dtypes of a CUDA run: bf16 compute where mixed precision applies, float32 where
            # the model class keeps modules in float32
            model = parallelize(model, parallel, ctx, blocks=blocks,
                                activation_checkpointing=cfg.activation_checkpointing, compile=False,
                                mixed_precision=parallel.mixed_precision)
            mesh_shape = list(build_mesh(parallel, ctx).shape)
        else:  # DDP cannot wrap meta tensors (see _ddp_bucket_bytes): the rest of parallelize, ungrouped
            parallelize(model, parallel, DistContext(), blocks=blocks,
                        activation_checkpointing=cfg.activation_checkpointing, compile=False)
        named = list(model.named_parameters())  # after fully_shard: DTensor parameters, the same names
        params = [p for _, p in named]
        trainable = [p for p in params if p.requires_grad]
        params_bytes = sum(_nbytes(_local(p)) for p in params)
        buffers_bytes = sum(_nbytes(b) for b in model.buffers())
        # FSDP2 reduce-scatters into float32 sharded gradients (reduce_dtype) that stay sharded across the
        # accumulation micro-batches; unsharded runs keep one gradient per trainable parameter (its dtype)
        grads_bytes = sum(_local(p).numel() * 4 for p in trainable)
        if parallel.strategy == "ddp" and started:
            buckets, bucket_bytes = _ddp_bucket_bytes(trainable)
            grads_bytes += bucket_bytes
            notes.append(f"DDP: full replica per rank; gradients = .grad ({_gib(grads_bytes - bucket_bytes)}) "
                         f"+ {buckets} reducer buckets ({_gib(bucket_bytes)}, torch's bucket assignment)")
        optimizer_bytes = _optimizer_state_bytes(trainable, recipe)
        # AdamW's foreach step (torch's default on CUDA) makes one new tensor list per device and dtype group:
        # sqrt(exp_avg_sq), as large as the group's parameters
        groups: dict[torch.dtype, int] = {}
        for p in trainable:
            groups[p.dtype] = groups.get(p.dtype, 0) + _nbytes(_local(p))
        optimizer_temp_bytes = max(groups.values(), default=0)
        if sharded:
            # root-level units stay gathered through the step; blocks are gathered one at a time, the
            # next one prefetched while the current one computes
            units = fsdp_units(model, blocks)
            root = sum(u.gathered_bytes for u in units if u.block is None)
            per_block: dict[int, int] = {}
            for u in units:
                if u.block is not None:
                    per_block[u.block] = per_block.get(u.block, 0) + u.gathered_bytes
            largest_block = max(per_block.values(), default=0)
            gathered_bytes = root + 2 * largest_block
            notes.append(f"gathered: {len(units)} FSDP2 units; root-level {_gib(root)} + 2 x the largest block "
                         f"{_gib(largest_block)} (current + prefetch), in each unit's compute dtype")
            # a block's backward holds its unsharded gradients in the compute dtype until FSDP2 copies them
            # into the reduce-scatter input in the reduce dtype (float32)
            block_grads: dict[int | None, int] = {}
            for u in units:
                block_grads[u.block] = block_grads.get(u.block, 0) + u.grad_numel
            grad_elements = max(block_grads.values(), default=0)
            comm_bytes = grad_elements * (COMPUTE_BYTES + 4)
            notes.append(f"communication buffers: the largest unit's {grad_elements:,} gradients, unsharded in "
                         "bf16 and as the float32 reduce-scatter input")
        else:
            gathered_bytes = 0
            comm_bytes = 0  # DDP's buckets are counted with the gradients
            if lay.nproc > 1:
                notes.append(f"host RAM at load is per rank: {lay.nproc} ranks on a node load "
                             f"{_gib(lay.nproc * (base_params * torch.finfo(base_dtype).bits // 8 + lora_bytes))}")
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()

    # host RAM at load: a sharded load reads each rank's own rows of each tensor from the safetensors files
    # (worst case: the whole local shard in the file's dtype at once); unsharded: the whole model on the
    # host in the dtype the trainer loads it in before moving it to the GPU
    ck_bytes = torch.finfo(source.checkpoint_dtype).bits // 8
    if sharded:
        local_base = sum(_local(p).numel() for n, p in named if not _is_lora(n))
        host_load = local_base * ck_bytes
        notes.append("host RAM at load: the worst case, rank 0's whole shard in the checkpoint dtype (the "
                     "sharded loader reads one tensor's rows at a time)")
    else:
        host_load = base_params * torch.finfo(base_dtype).bits // 8 + lora_bytes
    # host RAM at export, rank 0: tensor by tensor, cast to export_dtype, two weight files at most (export.py)
    export_dtype_name = str(getattr(cfg, "export_dtype", "bfloat16"))
    export_dtype = getattr(torch, export_dtype_name, torch.bfloat16)
    if cfg.mode == "lora":
        host_export = lora_bytes
    else:
        model_export = total_params * torch.finfo(export_dtype).bits // 8
        host_export = export_peak_bytes(model_export, largest_fp32)
    static = params_bytes + buffers_bytes + grads_bytes + optimizer_bytes + gathered_bytes
    act = {ac: activation_bytes(shape, checkpointing=ac, cp=parallel.cp_size) for ac in (True, False)}
    activations = act[cfg.activation_checkpointing]
    notes.append(f"activations: bucket {'x'.join(map(str, shape.bucket))}, {shape.latent_tokens:,} latent + "
                 f"{shape.text_tokens:,} text tokens ({'joined to' if shape.text_in_blocks else 'cross-attention of'} "
                 f"the blocks' sequence), batch {shape.batch}, {shape.blocks} blocks of {shape.hidden} x "
                 f"{shape.ffn}, in bf16"
                 + (f", and a dense attention mask of {shape.mask_bytes} bytes per token pair in each block"
                    if shape.mask_bytes else "") + " (latentmill.activations)")
    gpu_bytes = int(gpu_memory_gib * GIB)
    per_rank = {
        "params_bytes": params_bytes,
        "buffers_bytes": buffers_bytes,
        "grads_bytes": grads_bytes,
        "optimizer_bytes": optimizer_bytes,
        "gathered_bytes": gathered_bytes,
        "static_bytes": static,
        "activation_bytes": activations,
        "activation_bytes_checkpointing": act[True],
        "activation_bytes_no_checkpointing": act[False],
        "optimizer_temp_bytes": optimizer_temp_bytes,
        "comm_buffer_bytes": comm_bytes,
        "context_bytes": CONTEXT_BYTES,
        "host_load_peak_bytes": host_load,
        "host_export_peak_bytes": host_export,
    }
    per_rank["total_bytes"] = total_bytes(per_rank)
    return {
        "config": {"pretrained": recipe.model.pretrained, "family": family, "mode": cfg.mode, "expert": cfg.expert,
                   "strategy": parallel.strategy, "hsdp_replicate": parallel.hsdp_replicate,
                   "cp_size": parallel.cp_size, "cp_kind": parallel.cp_kind,
                   "mixed_precision": parallel.mixed_precision, "grad_accum_steps": cfg.grad_accum_steps,
                   "batch_size": cfg.batch_size, "configs_from": str(source.path),
                   "shipped_configs": source.shipped},
        "total_params": total_params,
        "trainable_params": trainable_params,
        "world_size": world,
        "nproc": lay.nproc,
        "nnodes": lay.nnodes,
        "mesh": mesh_shape if started else [1],
        "checkpoint_dtype": str(source.checkpoint_dtype).removeprefix("torch."),
        "activations": {"bucket": list(shape.bucket), "latent_tokens": shape.latent_tokens,
                        "text_tokens": shape.text_tokens, "text_in_blocks": shape.text_in_blocks,
                        "tokens_per_rank": math.ceil(shape.tokens / parallel.cp_size), "batch_size": shape.batch,
                        "blocks": shape.blocks, "hidden": shape.hidden, "ffn": shape.ffn, "heads": heads,
                        "checkpointing": cfg.activation_checkpointing,
                        "float32_extra": list(shape.float32_extra), "side_streams": [list(t) for t in shape.side_streams],
                        "mask_bytes": shape.mask_bytes,
                        "cp_options": cp_options},
        "per_rank": per_rank,
        "gpu_memory_bytes": gpu_bytes,
        "fits": per_rank["total_bytes"] <= gpu_bytes,
        "margin_bytes": gpu_bytes - per_rank["total_bytes"],
        "notes": [source.note, f"layout: {lay.note}",
                  f"checkpoint dtype {str(source.checkpoint_dtype).removeprefix('torch.')}: {source.dtype_note}",
                  *notes],
        **ddp_lora_cost(cfg.mode, parallel.strategy, base_params * torch.finfo(base_dtype).bits // 8, host_load,
                        lay.nproc, world),
    }


def total_bytes(per_rank: dict[str, int]) -> int:
    """A rank's peak GPU bytes: the static part and the CUDA/NCCL context, plus the larger of the two phases
    that never overlap: forward/backward (activations and communication buffers) and AdamW's step (its
    temporaries; the activations are freed by then)."""
    return (per_rank["static_bytes"] + per_rank["context_bytes"]
            + max(per_rank["activation_bytes"] + per_rank["comm_buffer_bytes"], per_rank["optimizer_temp_bytes"]))


def suggest(result: dict[str, Any]) -> dict[str, Any]:
    """The smallest ``parallel.cp_size`` (of those dividing the shard group and the heads) and the activation
    checkpointing setting (off first: it is faster) whose peak fits ``result``'s GPU memory; with
    ``line``, one sentence saying it, or what would fit when nothing does."""
    a, r = result["activations"], result["per_rank"]
    shape = ActivationShape(tuple(a["bucket"]), a["latent_tokens"], a["text_tokens"], a["text_in_blocks"],
                            tuple(a["float32_extra"]), a["hidden"], a["ffn"], a["blocks"], a["batch_size"],
                            tuple(map(tuple, a["side_streams"])), a["mask_bytes"])
    gpu = result["gpu_memory_bytes"]
    tried = []
    for cp in a["cp_options"]:
        for ac in (False, True):
            peak = total_bytes({**r, "activation_bytes": activation_bytes(shape, checkpointing=ac, cp=cp)})
            tried.append((peak, cp, ac))
            if peak <= gpu:
                return {"cp_size": cp, "activation_checkpointing": ac, "total_bytes": peak,
                        "line": f"parallel.cp_size={cp} trainer.activation_checkpointing={str(ac).lower()} "
                                f"(peak {_gib(peak)} of {gpu / GIB:g} GiB)"}
    peak, cp, ac = min(tried)
    static_left = gpu - total_bytes({**r, "activation_bytes": 0, "optimizer_temp_bytes": 0, "comm_buffer_bytes": 0})
    more = ("more ranks to shard the static part" if static_left <= 0 else
            f"a GPU of {math.ceil(peak / GIB)} GiB, more ranks to shard the static {_gib(r['static_bytes'])}, or a "
            "smaller bucket or batch")
    return {"cp_size": None, "activation_checkpointing": None, "total_bytes": peak,
            "line": f"nothing fits {gpu / GIB:g} GiB: the least is cp_size {cp} with activation checkpointing "
                    f"{'on' if ac else 'off'} at {_gib(peak)} (cp options {a['cp_options']}); {more} would fit"}


def ddp_lora_cost(mode: str, strategy: str, base_bytes: int, host_load: int, nproc: int, world: int) -> dict:
    """``{"ddp_lora": ...}`` for a LoRA recipe on DDP: every rank holds the whole frozen base (``base_bytes``) on
    its GPU and loads it through host RAM (``host_load``), where FSDP2 would hold 1/``world`` of it; {} otherwise."""
    if mode != "lora" or strategy != "ddp" or world < 2:
        return {}
    return {"ddp_lora": {"gpu_base_bytes": base_bytes, "host_load_bytes": host_load,
                         "node_host_load_bytes": nproc * host_load, "fsdp2_gpu_base_bytes": -(-base_bytes // world)}}


def _plan_both(recipe: Recipe, **kwargs: Any) -> dict[str, Any]:
    """``trainer.expert: both``: each expert planned on its own, as the trainer builds and shards it, and added up
    the way a run holds them: parameters, buffers and AdamW state of every expert stay resident; gradients and
    gathered units are one expert's at a time (an expert drops its gradients before the other trains); host
    RAM peaks are one expert's (they load and export one after the other)."""
    from latentmill.trainer.adapter import choose_experts
    from latentmill.trainer.adapters import get_adapter

    source = resolve_model(recipe.model.pretrained)
    adapter = get_adapter(_family(recipe, source.path))
    experts = choose_experts(adapter.experts(str(source.path)), "both", recipe.model.pretrained)
    plans = [plan(dataclasses.replace(recipe, trainer=dataclasses.replace(recipe.trainer, expert=e.name)), **kwargs)
             for e in experts]
    combined = {**plans[0], "config": {**plans[0]["config"], "expert": "both"}}
    for key in ("total_params", "trainable_params"):
        combined[key] = sum(p[key] for p in plans)
    ranks = [p["per_rank"] for p in plans]
    per_rank = {key: sum(r[key] for r in ranks) for key in ("params_bytes", "buffers_bytes", "optimizer_bytes")}
    per_rank.update({key: max(r[key] for r in ranks) for key in (
        "grads_bytes", "gathered_bytes", "activation_bytes", "activation_bytes_checkpointing",
        "activation_bytes_no_checkpointing", "optimizer_temp_bytes", "comm_buffer_bytes", "context_bytes",
        "host_load_peak_bytes", "host_export_peak_bytes")})
    per_rank["static_bytes"] = sum(per_rank[key] for key in ("params_bytes", "buffers_bytes", "grads_bytes",
                                                            "optimizer_bytes", "gathered_bytes"))
    per_rank["total_bytes"] = total_bytes(per_rank)
    combined["per_rank"] = per_rank
    combined["fits"] = per_rank["total_bytes"] <= combined["gpu_memory_bytes"]
    combined["margin_bytes"] = combined["gpu_memory_bytes"] - per_rank["total_bytes"]
    combined["notes"] = [n for n in plans[0]["notes"] if not n.startswith("trainer.expert")] + [
        f"trainer.expert both: {' + '.join(e.component for e in experts)}, each sharded on its own; parameters, "
        "buffers and AdamW state of both resident, gradients and gathered units of one at a time (an expert "
        "drops its gradients before the other trains)"]
    return combined


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(result: dict[str, Any]) -> str:
    """The plan as text: one table for rank 0 (the largest shards), the fits line, then the notes."""
    c, r = result["config"], result["per_rank"]
    cp = c.get("cp_size", 1)
    readers = result["world_size"] // cp  # the ranks of a cp group read the same samples
    global_batch = c["batch_size"] * c["grad_accum_steps"] * readers
    context = f", context parallel {cp} ({c['cp_kind']})" if cp > 1 else ""
    lines = [
        f"plan: {c['pretrained']} ({c['family']}), {c['mode']} fine-tune, {c['strategy']} on "
        f"{result['nnodes']} x {result['nproc']} = {result['world_size']} ranks (mesh {result['mesh']}{context}), "
        f"global batch {c['batch_size']} x {c['grad_accum_steps']} accum x {readers}"
        f"{' data-parallel ranks' if cp > 1 else ''} = {global_batch}",
        f"parameters: {result['total_params']:,} total, {result['trainable_params']:,} trainable",
        "",
        f"{'per rank (rank 0: the largest shards)' if c['strategy'] == 'fsdp2' else 'per rank':<51}GiB",
    ]
    rows = [("parameters (local shards)" if c["strategy"] == "fsdp2" else "parameters (full replica)",
             r["params_bytes"]), ("buffers", r["buffers_bytes"]),
            (f"gradients (float32, {c['grad_accum_steps']} accum steps)", r["grads_bytes"]),
            ("AdamW state (exp_avg + exp_avg_sq)", r["optimizer_bytes"]),
            ("gathered FSDP units (transient)", r["gathered_bytes"])]
    a = result["activations"]
    act_label = (f"activations, checkpointing {'on' if a['checkpointing'] else 'off'} "
                 f"({a['tokens_per_rank']:,} x {a['batch_size']})")
    lines += [f"  {name:<46} {value / GIB:>8.2f}" for name, value in rows]
    lines += [f"  {'static GPU total':<46} {r['static_bytes'] / GIB:>8.2f}",
              f"  {act_label:<46} {r['activation_bytes'] / GIB:>8.2f}",
              f"  {'  with / without checkpointing':<46} {r['activation_bytes_checkpointing'] / GIB:>8.2f} / "
              f"{r['activation_bytes_no_checkpointing'] / GIB:.2f}",
              f"  {'communication buffers (reduce-scatter)':<46} {r['comm_buffer_bytes'] / GIB:>8.2f}",
              f"  {'AdamW foreach temporaries (at the step)':<46} {r['optimizer_temp_bytes'] / GIB:>8.2f}",
              f"  {'CUDA/NCCL context (allowance)':<46} {r['context_bytes'] / GIB:>8.2f}",
              f"  {'peak GPU total':<46} {r['total_bytes'] / GIB:>8.2f}",
              f"  {'host RAM peak at load':<46} {r['host_load_peak_bytes'] / GIB:>8.2f}",
              f"  {'host RAM peak at export (rank 0)':<46} {r['host_export_peak_bytes'] / GIB:>8.2f}", ""]
    gpu = result["gpu_memory_bytes"] / GIB
    margin = result["margin_bytes"] / GIB
    if result["fits"]:
        lines.append(f"fits: yes, the peak fits {gpu:g} GiB with {margin:.2f} GiB left")
    else:
        lines.append(f"fits: NO, the peak exceeds {gpu:g} GiB by {-margin:.2f} GiB")
    if "suggest" in result:
        lines.append(f"suggest: {result['suggest']['line']}")
    if "ddp_lora" in result:
        d = result["ddp_lora"]
        lines.append(f"DDP LoRA: each rank holds the whole frozen base, {_gib(d['gpu_base_bytes'])} of GPU memory and "
                     f"{_gib(d['host_load_bytes'])} of host RAM at load ({_gib(d['node_host_load_bytes'])} per node); "
                     f"parallel.strategy: fsdp2 holds {_gib(d['fsdp2_gpu_base_bytes'])} of it per rank")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def plan_config(config: str | Path, overrides: list[str] | None = None, *, nproc: int | None = None,
                nnodes: int | None = None, gpu_memory_gib: float | None = None,
                with_suggestion: bool = False) -> dict[str, Any]:
    """:func:`plan` of a recipe file (or shipped recipe name) with dotted overrides; ``gpu_memory_gib`` None:
    80. ``with_suggestion`` adds :func:`suggest` (it needs the GPU memory stated)."""
    if with_suggestion and gpu_memory_gib is None:
        raise ConfigError("--suggest: needs --gpu-memory GiB, the memory of the GPU to fit (e.g. --gpu-memory 80)")
    gpu_memory_gib = 80.0 if gpu_memory_gib is None else gpu_memory_gib
    if not math.isfinite(gpu_memory_gib) or gpu_memory_gib <= 0:
        raise ConfigError(f"--gpu-memory: must be a positive number of GiB, got {gpu_memory_gib}")
    result = plan(load_recipe(config, overrides), nproc=nproc, nnodes=nnodes, gpu_memory_gib=gpu_memory_gib)
    if with_suggestion:
        result["suggest"] = suggest(result)
    return result
