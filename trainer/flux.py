"""Adapter between cached latents and an unmodified Diffusers ``FluxTransformer2DModel``.

The transformer sees what ``FluxPipeline`` gives it at inference time: 2x2-packed latent tokens, position
ids for image and text tokens, ``timestep = sigma`` and (for guidance-distilled models) the guidance scale.
Packing and ids reproduce ``FluxPipeline._pack_latents`` / ``_unpack_latents`` /
``_prepare_latent_image_ids`` so that a model trained here samples correctly in the stock pipeline.
``load_flux_transformer`` and ``export_flux`` load the model for training and write the Diffusers artefact.

Shape legend: B batch, C latent channels (16), H/W latent height/width (pixels / 8), N = (H/2)*(W/2) image
tokens, L text tokens, D text feature width.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

# Files that mark a folder as an earlier export (safe to replace).
EXPORT_MARKERS = ("model_index.json", "pytorch_lora_weights.safetensors")


def pack_latents(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)*(W/2), C*4], each token one 2x2 patch (as ``FluxPipeline._pack_latents``)."""
    B, C, H, W = latents_BCHW.shape
    if H % 2 or W % 2:
        raise ValueError(f"Flux packs 2x2 latent patches: latent height and width must be even, got {H}x{W}")
    x = latents_BCHW.reshape(B, C, H // 2, 2, W // 2, 2)
    x = x.permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_latents(tokens_BNK: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of ``pack_latents``: [B, (H/2)*(W/2), C*4] -> [B, C, H, W] for latent size ``height`` x ``width``."""
    B, N, K = tokens_BNK.shape
    if N != (height // 2) * (width // 2):
        raise ValueError(f"{N} tokens do not tile a {height}x{width} latent in 2x2 patches")
    x = tokens_BNK.reshape(B, height // 2, width // 2, K // 4, 2, 2)
    x = x.permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, K // 4, height, width)


def latent_image_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Position ids [(H/2)*(W/2), 3] = (0, row, col) per packed token, for a latent of ``height`` x ``width``."""
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


def text_ids(seq_len: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Position ids [L, 3] for text tokens: all zeros, as in ``FluxPipeline.encode_prompt``."""
    return torch.zeros(seq_len, 3, device=device, dtype=dtype)


def check_batch_fits(transformer: nn.Module, latents_BCHW, prompt_embeds_BLD, pooled_BD) -> None:
    """Raise ``ValueError`` saying what differs when cached tensors do not fit the transformer's config."""
    cfg = transformer.config
    problems = []
    if latents_BCHW.ndim != 4:
        problems.append(f"latents have shape {tuple(latents_BCHW.shape)}, expected [B, C, H, W] (images)")
    elif latents_BCHW.shape[1] * 4 != cfg.in_channels:
        problems.append(
            f"latents have {latents_BCHW.shape[1]} channels -> {latents_BCHW.shape[1] * 4} packed features, "
            f"transformer in_channels is {cfg.in_channels}"
        )
    if prompt_embeds_BLD.shape[-1] != cfg.joint_attention_dim:
        problems.append(
            f"prompt_embeds width is {prompt_embeds_BLD.shape[-1]}, "
            f"transformer joint_attention_dim is {cfg.joint_attention_dim}"
        )
    if pooled_BD.shape[-1] != cfg.pooled_projection_dim:
        problems.append(
            f"pooled_prompt_embeds width is {pooled_BD.shape[-1]}, "
            f"transformer pooled_projection_dim is {cfg.pooled_projection_dim}"
        )
    if problems:
        raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))


def flux_forward(
    transformer: nn.Module,
    noisy_latents_BCHW: torch.Tensor,
    sigmas_B: torch.Tensor,
    prompt_embeds_BLD: torch.Tensor,
    pooled_BD: torch.Tensor,
    guidance_scale: float = 3.5,
) -> torch.Tensor:
    """Predict the flow velocity [B, C, H, W] for noisy latents at noise levels ``sigmas_B``.

    Calls the transformer exactly like ``FluxPipeline.__call__``; ``guidance`` is passed only when the model
    has a guidance embedding (``config.guidance_embeds``). ``transformer`` may be wrapped in DDP.
    """
    B, _, H, W = noisy_latents_BCHW.shape
    device, dtype = noisy_latents_BCHW.device, noisy_latents_BCHW.dtype
    config = getattr(transformer, "module", transformer).config  # DDP wraps the model in .module
    guidance = None
    if getattr(config, "guidance_embeds", False):
        guidance = torch.full((B,), float(guidance_scale), device=device, dtype=torch.float32)
    pred_BNK = transformer(
        hidden_states=pack_latents(noisy_latents_BCHW),
        encoder_hidden_states=prompt_embeds_BLD,
        pooled_projections=pooled_BD,
        timestep=sigmas_B.to(device=device, dtype=dtype),
        img_ids=latent_image_ids(H, W, device=device, dtype=dtype),
        txt_ids=text_ids(prompt_embeds_BLD.shape[1], device=device, dtype=dtype),
        guidance=guidance,
        return_dict=False,
    )[0]
    return unpack_latents(pred_BNK, H, W)


def load_flux_transformer(
    pretrained: str,
    *,
    mode: str = "full",
    device: torch.device | str = "cpu",
    lora_rank: int = 16,
    lora_alpha: float = 16.0,
    lora_target_modules: list[str] | None = None,
) -> nn.Module:
    """``FluxTransformer2DModel.from_pretrained(pretrained, subfolder="transformer")``, made trainable.

    ``full``: every parameter trains, in float32. ``lora``: the base is frozen (bfloat16 on CUDA, float32
    on CPU) and a PEFT LoRA adapter (float32) is added with ``transformer.add_adapter``.
    """
    from diffusers import FluxTransformer2DModel

    device = torch.device(device)
    base_dtype = torch.bfloat16 if (mode == "lora" and device.type == "cuda") else torch.float32
    transformer = FluxTransformer2DModel.from_pretrained(
        pretrained, subfolder="transformer", torch_dtype=base_dtype
    )
    if mode == "lora":
        from peft import LoraConfig

        transformer.requires_grad_(False)
        transformer.add_adapter(
            LoraConfig(
                r=lora_rank,
                lora_alpha=lora_alpha,
                init_lora_weights="gaussian",
                target_modules=list(lora_target_modules or ["to_k", "to_q", "to_v", "to_out.0"]),
            )
        )
        for param in transformer.parameters():
            if param.requires_grad:
                param.data = param.data.float()  # trainable weights stay float32 even on a bf16 base
    elif mode == "full":
        transformer.requires_grad_(True)
    else:
        raise ValueError(f"unknown trainer mode {mode!r}")
    return transformer.to(device).train()


def export_flux(transformer: nn.Module, *, mode: str, pretrained: str, export_dir: str | Path) -> Path:
    """Write a Diffusers artefact: full -> complete ``FluxPipeline`` folder; lora -> LoRA weights folder.

    The full export loads with ``DiffusionPipeline.from_pretrained(export_dir)``; the LoRA export with
    ``FluxPipeline.from_pretrained(pretrained).load_lora_weights(export_dir)``. Written to
    ``<export_dir>.tmp`` and renamed, so a half-written export is never left under the final name.
    """
    from diffusers import FluxPipeline

    export_dir = Path(export_dir)
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if mode == "full":
        pipe = FluxPipeline.from_pretrained(pretrained, transformer=transformer)
        pipe.save_pretrained(tmp)
    elif mode == "lora":
        from peft.utils import get_peft_model_state_dict

        FluxPipeline.save_lora_weights(
            tmp,
            transformer_lora_layers=get_peft_model_state_dict(transformer),
            transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
        )
    else:
        raise ValueError(f"unknown trainer mode {mode!r}")
    if export_dir.exists():
        if not any((export_dir / marker).exists() for marker in EXPORT_MARKERS):
            raise FileExistsError(f"{export_dir} exists and is not a previous export; refusing to replace it")
        shutil.rmtree(export_dir)
    os.replace(tmp, export_dir)
    return export_dir
