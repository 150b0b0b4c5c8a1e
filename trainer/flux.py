"""Adapter between cached latents and an unmodified Diffusers ``FluxTransformer2DModel``.

The transformer sees what ``FluxPipeline`` gives it at inference time: 2x2-packed latent tokens, position
ids for image and text tokens, ``timestep = sigma`` and (for guidance-distilled models) the guidance scale.
Packing and ids reproduce ``FluxPipeline._pack_latents`` / ``_unpack_latents`` /
``_prepare_latent_image_ids`` so that a model trained here samples correctly in the stock pipeline.
``FluxAdapter`` is what the training loop uses (see ``latentmill.trainer.adapter``); ``load_flux_transformer`` and
``export_flux`` load the model for training and write the Diffusers artefact.

Shape legend: B batch, C latent channels (16), H/W latent height/width (pixels / 8), N = (H/2)*(W/2) image
tokens, L text tokens, D text feature width.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from latentmill.trainer.adapter import EXPORT_MARKERS, ModelAdapter  # noqa: F401  (EXPORT_MARKERS: public name)
from torch import nn


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


@functools.lru_cache(maxsize=64)
def latent_image_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Position ids [(H/2)*(W/2), 3] = (0, row, col) per packed token, for a latent of ``height`` x ``width``.

    Built on ``device`` once per (shape, device, dtype) and shared: a bucket's training steps reuse one tensor
    (callers must not change it in place).
    """
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 3).to(dtype)


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


def load_flux_transformer(pretrained: str, **kwargs) -> nn.Module:
    """``FluxTransformer2DModel.from_pretrained(pretrained, subfolder="transformer")``, made trainable.

    ``full``: every parameter trains, in float32. ``lora``: the base is frozen (bfloat16 on CUDA, float32
    on CPU) and a PEFT LoRA adapter (float32) is added with ``transformer.add_adapter``. Keyword arguments:
    ``mode``, ``device``, ``lora_rank``, ``lora_alpha``, ``lora_target_modules``, ``base_dtype``.
    """
    return FluxAdapter().load(pretrained, **kwargs)


def export_flux(transformer: nn.Module, *, mode: str, pretrained: str, export_dir: str | Path) -> Path:
    """Write a Diffusers artefact: full -> complete ``FluxPipeline`` folder; lora -> LoRA weights folder.

    The full export loads with ``DiffusionPipeline.from_pretrained(export_dir)``; the LoRA export with
    ``FluxPipeline.from_pretrained(pretrained).load_lora_weights(export_dir)``. Written to
    ``<export_dir>.tmp`` and renamed, so a half-written export is never left under the final name.
    """
    return FluxAdapter().export(transformer, mode=mode, pretrained=pretrained, export_dir=export_dir)


class FluxAdapter(ModelAdapter):
    """Flux-class image models (FLUX.1-dev/schnell and fine-tunes): ``FluxTransformer2DModel``, ``FluxPipeline``."""

    family = "flux"
    transformer_class = "FluxTransformer2DModel"
    pipeline_class = "FluxPipeline"
    streams = ("latents", "prompt_embeds", "pooled_prompt_embeds")
    latent_ndim = 3

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        check_batch_fits(transformer, batch["latents"], batch["prompt_embeds"], batch["pooled_prompt_embeds"])

    def seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)  # packed 2x2 tokens

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        return flux_forward(
            model, noisy, sigmas_B, batch["prompt_embeds"], batch["pooled_prompt_embeds"], cfg.guidance_scale
        )

    def pipeline_prompt_kwargs(self, prompts, pad_to):
        return {"prompt_embeds": torch.stack([p["prompt_embeds"] for p in prompts]),  # stored padded (keep)
                "pooled_prompt_embeds": torch.stack([p["pooled_prompt_embeds"] for p in prompts])}

    def validation_images(
        self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale
    ):
        width, height = size[0], size[1]
        out = pipe(  # guidance is embedded (FLUX.1-dev): no negative prompt
            **text,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            max_sequence_length=max_sequence_length,
            generator=generator,
        )
        return [[image] for image in out.images]
