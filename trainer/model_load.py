"""Building the transformer without its weights: the meta device, from the config files alone.

``meta_transformer`` is the model a 12-14B run starts from on every rank: the unmodified Diffusers class,
built from ``<pretrained>/transformer/config.json`` on the meta device (no bytes held), made trainable by
the same ``make_trainable`` as a loaded model, so parameter names, LoRA layers and ``requires_grad`` are
those of the real run. ``latentmill plan`` shards it under a fake process group to count bytes per rank;
training shards it on the real mesh and then fills each rank's shards.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from latentmill.trainer.adapter import ModelAdapter, make_trainable
from torch import nn


def transformer_config(adapter: ModelAdapter, pretrained: str, component: str = "transformer") -> dict[str, Any]:
    """``<pretrained>/<component>/config.json`` (a local folder of config files is enough, no weights)."""
    cls = adapter.diffusers_class(adapter.transformer_class)
    return dict(cls.load_config(pretrained, subfolder=component))


def meta_transformer(
    adapter: ModelAdapter,
    pretrained: str,
    *,
    mode: str = "full",
    lora_rank: int = 16,
    lora_alpha: float = 16.0,
    lora_target_modules: list[str] | None = None,
    base_dtype: torch.dtype = torch.float32,
    component: str = "transformer",
) -> nn.Module:
    """The adapter's transformer class on the meta device, in ``base_dtype``, made trainable like a loaded one.

    Every parameter and buffer is on ``meta``: shapes and dtypes only. LoRA layers (mode ``lora``) are float32
    on a ``base_dtype`` frozen base; in ``full`` mode every parameter is float32 (the masters). The model
    training builds (``trainable_skeleton``), without the initial values it fills in.
    """
    return trainable_skeleton(adapter, pretrained, mode=mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
                              lora_target_modules=lora_target_modules, base_dtype=base_dtype,
                              component=component)[0]


def keeps_fp32(transformer: nn.Module, name: str) -> bool:
    """Whether parameter or buffer ``name`` stays float32 under a lower ``torch_dtype``: a component of its
    dotted name is in the class's ``_keep_in_fp32_modules`` (diffusers' rule; Wan's ``scale_shift_table``
    parameters match by their own name)."""
    keep = getattr(transformer, "_keep_in_fp32_modules", None) or ()
    return any(part in keep for part in name.split("."))


# ---------------------------------------------------------------------------------------------------------
# Loading for training: sharded on the meta device, then each rank fills only its own rows
# ---------------------------------------------------------------------------------------------------------


def load_for_training(
    adapter: ModelAdapter,
    pretrained: str,
    *,
    cfg: Any,
    parallel: Any,
    ctx: Any,
    init_seed: int,
    base_dtype: torch.dtype | None = None,
    component: str = "transformer",
) -> tuple[nn.Module, nn.Module]:
    """The trainable transformer of ``pretrained`` (its folder ``component``), parallelised: ``(transformer, model)``.

    ``model`` is what forward runs on, ``transformer`` what save and export use (the same module under
    FSDP2). ``cfg`` is the ``TrainerConfig`` (mode, lora_*, activation_checkpointing, compile); ``init_seed``
    seeds the global RNG that LoRA's gaussian init draws from. ``base_dtype`` is the frozen base's dtype in
    LoRA mode (default as ``load_transformer``: bfloat16 on CUDA, float32 on CPU).

    Not sharded (``none``/``ddp``): ``adapter.load`` on the device, then ``parallelize``; every rank holds the
    model. FSDP2 (``ctx.sharded``): no rank ever builds the whole model. The transformer is built with its
    parameters on the meta device (buffers real, computed on CPU as ``from_pretrained`` computes them),
    sharded by ``parallelize`` on meta, materialised shard by shard on ``ctx.device`` and filled: each rank
    reads only its own rows of each tensor from the checkpoint's safetensors files (host memory: one slice
    at a time). Weights that are not safetensors are read once by rank 0 and broadcast.
    """
    from latentmill.trainer.context import apply_context_parallel, check_heads
    from latentmill.trainer.parallel import parallelize

    device = ctx.device
    if base_dtype is None:
        base_dtype = torch.bfloat16 if (cfg.mode == "lora" and device.type == "cuda") else torch.float32
    lora = {"lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_target_modules": cfg.lora_target_modules}
    torch.manual_seed(init_seed)  # LoRA init draws from the global RNG: the same on every rank
    if not ctx.sharded:
        transformer = adapter.load(
            pretrained, mode=cfg.mode, device=device, base_dtype=base_dtype if cfg.mode == "lora" else None,
            component=component, **lora,
        )
        model = parallelize(
            transformer, parallel, ctx, blocks=adapter.blocks(transformer),
            activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
        )
        return transformer, model

    transformer, initial = trainable_skeleton(adapter, pretrained, mode=cfg.mode, base_dtype=base_dtype,
                                              component=component, **lora)
    model = parallelize(
        transformer, parallel, ctx, blocks=adapter.blocks(transformer),
        activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
    )
    check_heads(transformer, parallel)
    apply_context_parallel(transformer, parallel, ctx)
    transformer.to_empty(device=device)  # this rank's shards only (FSDP2 re-pads them), uninitialised
    reader = SafetensorsReader.of(transformer_folder(pretrained, component))
    if reader is None:  # e.g. .bin weights: no ranged reads; rank 0 reads them all, once
        _broadcast_from_rank0(transformer, adapter, pretrained, ctx, mode=cfg.mode, base_dtype=base_dtype,
                              init_seed=init_seed, component=component, **lora)
    fill_local(transformer, initial, reader)
    return transformer, model


def transformer_folder(pretrained: str, component: str = "transformer") -> Path:
    """The local ``component`` folder of ``pretrained`` (a pipeline folder, or a hub id's snapshot)."""
    if Path(pretrained).is_dir():
        return Path(pretrained) / component
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(pretrained, allow_patterns=[f"{component}/*"])) / component


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def trainable_skeleton(
    adapter: ModelAdapter,
    pretrained: str,
    *,
    mode: str = "full",
    lora_rank: int = 16,
    lora_alpha: float = 16.0,
    lora_target_modules: list[str] | None = None,
    base_dtype: torch.dtype = torch.float32,
    component: str = "transformer",
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The trainable transformer with every parameter on meta, and the values that are not in the checkpoint.

    Built the way ``from_pretrained`` builds before it reads weights (diffusers' ``no_init_weights`` and
    ``accelerate.init_empty_weights``, default dtype ``base_dtype`` when it is not float32), so the global
    RNG advances exactly as in ``load_transformer`` and the non-persistent buffers (Wan's rotary tables)
    are computed on CPU with the same values and dtypes. In LoRA mode ``make_trainable`` runs on a frame of
    that model whose base parameters are one-element CPU tensors expanded to their shapes: PEFT creates and
    draws the adapter weights (and rounds them through the base dtype) exactly as on a loaded model, for
    the few MB they take. Returns ``(model, initial)``: the model with parameters and buffers on meta, and
    ``initial``: full CPU values of every buffer and of every parameter that the checkpoint does not hold
    (the LoRA weights), by name.
    """
    import accelerate
    from diffusers.models.modeling_utils import no_init_weights

    if mode == "full":
        base_dtype = torch.float32
    cls = adapter.diffusers_class(adapter.transformer_class)
    config = transformer_config(adapter, pretrained, component)
    dtype_context = _default_dtype(base_dtype) if base_dtype != torch.float32 else contextlib.nullcontext()
    with dtype_context, no_init_weights(), accelerate.init_empty_weights():
        transformer = cls.from_config(config)
    transformer.register_to_config(_name_or_path=pretrained)  # as from_pretrained does (the export writes it)
    for name, module in transformer.named_modules():
        for key, param in module.named_parameters(recurse=False):
            dtype = torch.float32 if keeps_fp32(transformer, f"{name}.{key}") else base_dtype
            frame = torch.empty((), dtype=dtype).expand(param.shape) if mode == "lora" else param.to(dtype)
            module._parameters[key] = nn.Parameter(frame, requires_grad=param.requires_grad)
    transformer = make_trainable(
        transformer, mode=mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_target_modules=adapter.targets(lora_target_modules),
    )
    initial = {name: b.detach().clone() for name, b in transformer.named_buffers()}
    for name, module in transformer.named_modules():
        for key, param in module.named_parameters(recurse=False):
            if mode == "lora" and param.requires_grad:
                initial[f"{name}.{key}" if name else key] = param.detach().clone()
            module._parameters[key] = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad
            )
        for key, buffer in module.named_buffers(recurse=False):
            if buffer is not None:
                module._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
    return adapter.freeze_unused(transformer), initial


class SafetensorsReader:
    """Reads parts of the tensors of a Diffusers weights folder (one safetensors file or an indexed set).

    Each read opens the file, takes the requested ranges with ``get_slice`` (only their bytes are read) and
    closes it, so no mapping of the file stays resident between reads.
    """

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    @classmethod
    def of(cls, folder: Path) -> SafetensorsReader | None:
        """The reader of ``folder``'s weights, or None when they are not safetensors."""
        from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
        from safetensors import safe_open

        index = folder / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls({key: folder / name for key, name in weight_map.items()})
        single = folder / SAFETENSORS_WEIGHTS_NAME
        if single.is_file():
            with safe_open(single, framework="pt") as f:
                return cls(dict.fromkeys(f.keys(), single))
        return None

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``key``, or only ``index`` of it (one slice per dimension), in its stored dtype, on CPU."""
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            if index is None or not index:
                return f.get_tensor(key)
            return f.get_slice(key)[index]


def checkpoint_key(name: str) -> str:
    """The checkpoint name of parameter ``name`` (PEFT moves a wrapped layer's weights under ``base_layer``)."""
    return name.replace(".base_layer.", ".")


def local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's local tensor of ``param`` and where it sits in the global tensor (one slice per dim).

    For an FSDP2 DTensor: the unpadded local shard (a view into FSDP2's padded storage) and its rows; for a
    plain tensor: itself, whole.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return param, tuple(slice(0, n) for n in param.shape)


@torch.no_grad()
def fill_local(
    transformer: nn.Module, initial: dict[str, torch.Tensor], reader: SafetensorsReader | None
) -> None:
    """Fill this rank's part of every parameter and every buffer of ``transformer`` (materialised, uninitialised).

    Parameters come from ``initial`` (the LoRA weights) or else from ``reader``: only this rank's rows are
    read, converted to the parameter's dtype by the copy. Buffers come from the checkpoint when it holds
    them (persistent ones), else from ``initial`` (computed at build). With ``reader`` None, the checkpoint's
    parameters and persistent buffers were already broadcast from rank 0. A value found nowhere is an error.
    """
    missing = []
    for name, param in transformer.named_parameters():
        local, index = local_part(param)
        if name in initial:
            local.copy_(initial[name][index])
        elif reader is None:
            continue
        elif checkpoint_key(name) in reader:
            if local.numel():  # a rank past the last row of a short tensor holds none of it
                local.copy_(reader.read(checkpoint_key(name), index))
        else:
            missing.append(name)
    if missing:
        raise KeyError(f"{len(missing)} parameters are not in the checkpoint: {missing[:8]}")
    for module_name, module in transformer.named_modules():
        for key, buffer in module.named_buffers(recurse=False):
            name = f"{module_name}.{key}" if module_name else key
            persistent = key not in module._non_persistent_buffers_set
            if reader is not None and name in reader:  # a persistent buffer: the checkpoint's value, as loaded
                buffer.copy_(reader.read(name))
            elif reader is None and persistent:  # broadcast from rank 0 with the parameters
                continue
            elif name in initial:  # computed at build (Wan's rotary tables)
                buffer.copy_(initial[name])
            else:
                raise KeyError(f"buffer {name} has no value (not computed at build, not in the checkpoint)")


def _broadcast_from_rank0(
    transformer: nn.Module,
    adapter: ModelAdapter,
    pretrained: str,
    ctx: Any,
    *,
    mode: str,
    base_dtype: torch.dtype,
    init_seed: int,
    component: str,
    **lora: Any,
) -> None:
    """Weights that are not safetensors: rank 0 loads the model once on CPU (``adapter.load``) and broadcasts
    its full state dict into every rank's shards (``set_model_state_dict(..., broadcast_from_rank0=True)``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, torch.Tensor] = {}
    if ctx.rank == 0:
        with torch.random.fork_rng(devices=[]):  # the global RNG stays where the skeleton left it
            torch.manual_seed(init_seed)
            loaded = adapter.load(pretrained, mode=mode, device="cpu", base_dtype=base_dtype, component=component,
                                  **lora)
        full = loaded.state_dict()
        del loaded
    set_model_state_dict(
        transformer, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
