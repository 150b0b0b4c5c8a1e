"""Building the transformer without its weights: the meta device, from the config files alone.

``meta_transformer`` is the model a 12-14B run starts from on every rank: the unmodified Diffusers class,
built from ``<pretrained>/transformer/config.json`` on the meta device (no bytes held), made trainable by
the same ``make_trainable`` as a loaded model, so parameter names, LoRA layers and ``requires_grad`` are
those of the real run. ``latentmill plan`` shards it under a fake process group to count bytes per rank;
training shards it on the real mesh and then fills each rank's shards.
"""

from __future__ import annotations

from typing import Any

import torch
from latentmill.trainer.adapter import ModelAdapter, make_trainable
from torch import nn


def transformer_config(adapter: ModelAdapter, pretrained: str) -> dict[str, Any]:
    """``<pretrained>/transformer/config.json`` (a local folder of config files is enough, no weights)."""
    cls = adapter.diffusers_class(adapter.transformer_class)
    return dict(cls.load_config(pretrained, subfolder="transformer"))


def meta_transformer(
    adapter: ModelAdapter,
    pretrained: str,
    *,
    mode: str = "full",
    lora_rank: int = 16,
    lora_alpha: float = 16.0,
    lora_target_modules: list[str] | None = None,
    base_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The adapter's transformer class on the meta device, in ``base_dtype``, made trainable like a loaded one.

    Every parameter and buffer is on ``meta``: shapes and dtypes only. LoRA layers (mode ``lora``) are float32
    on a ``base_dtype`` frozen base; in ``full`` mode every parameter is float32 (the masters).
    """
    cls = adapter.diffusers_class(adapter.transformer_class)
    config = transformer_config(adapter, pretrained)
    with torch.device("meta"):
        transformer = cls.from_config(config)
    if mode == "lora" and base_dtype != torch.float32:
        cast_keeping_fp32_modules(transformer, base_dtype)
    with torch.device("meta"):
        return make_trainable(
            transformer, mode=mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
            lora_target_modules=lora_target_modules,
        )


def cast_keeping_fp32_modules(transformer: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to ``dtype`` except in the class's ``_keep_in_fp32_modules``.

    What ``from_pretrained(..., torch_dtype=dtype)`` does (Wan keeps its rotary embedding, time embedder and
    norms in float32); a plain ``.to(dtype)`` would cast those too.
    """
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, module in transformer.named_modules():
        if keep & set(name.split(".")):
            continue
        for key, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if tensor is not None and tensor.is_floating_point():
                if isinstance(tensor, nn.Parameter):
                    tensor.data = tensor.data.to(dtype)
                else:
                    setattr(module, key, tensor.to(dtype))
    return transformer
