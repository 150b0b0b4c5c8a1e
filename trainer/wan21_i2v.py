"""Adapter between cached Wan 2.1 I2V streams and an unmodified ``WanTransformer3DModel`` of Wan2.1-I2V-14B.

The transformer sees what ``WanImageToVideoPipeline.__call__`` (Wan 2.1: no ``expand_timesteps``) gives it:

* ``hidden_states``: [B, 2C + 4, F, H, W], the noisy latents, the first-frame mask (4 channels: ones on latent
  frame 0, the pipeline's mask of 4 pixel frames per latent frame) and the cached ``condition_latents`` (the
  first frame followed by zeros, VAE-encoded), stacked on channels;
* ``timestep``: ``t = 1000 * sigma`` per sample, as Wan 2.1 text-to-video;
* ``encoder_hidden_states``: the UMT5 ``prompt_embeds``; ``encoder_hidden_states_image``: the cached CLIP
  ``image_embeds`` of the first frame.

Every latent frame is noised and learned, frame 0 too: the image conditions through the extra channels, not by
a clean frame (Wan 2.2 TI2V's way, ``latentmill.trainer.wan22_ti2v``).

Shape legend: B batch, C latent channels (16), F latent frames, H/W latent height/width (pixels / 8), L text
tokens, D text width, S image tokens (257 for CLIP ViT-H/14 at 224 px), E image width (1280).
"""

from __future__ import annotations

from typing import Any

import torch
from latentmill.trainer.wan import WanAdapter
from torch import nn


def first_frame_channels(latents_BCFHW: torch.Tensor) -> torch.Tensor:
    """The pipeline's mask [B, 4, F, H, W]: ones on latent frame 0 (the conditioning image), zeros after."""
    batch, _, frames, height, width = latents_BCFHW.shape
    mask = latents_BCFHW.new_zeros(batch, 4, frames, height, width)
    mask[:, :, 0] = 1
    return mask


def i2v_forward(
    transformer: nn.Module, noisy_BCFHW: torch.Tensor, sigmas_B: torch.Tensor, prompt_embeds_BLD: torch.Tensor,
    condition_BCFHW: torch.Tensor, image_embeds_BSE: torch.Tensor | None,
) -> torch.Tensor:
    """Predict the flow velocity [B, C, F, H, W], calling the transformer exactly like WanImageToVideoPipeline
    (``image_embeds_BSE`` None: Wan 2.2 I2V A14B, whose transformers take no image embedding)."""
    dtype = noisy_BCFHW.dtype
    hidden = torch.cat([noisy_BCFHW, first_frame_channels(noisy_BCFHW), condition_BCFHW.to(dtype)], dim=1)
    return transformer(
        hidden_states=hidden,
        timestep=sigmas_B.to(device=noisy_BCFHW.device, dtype=torch.float32) * 1000.0,
        encoder_hidden_states=prompt_embeds_BLD.to(dtype),
        encoder_hidden_states_image=None if image_embeds_BSE is None else image_embeds_BSE.to(dtype),
        return_dict=False,
    )[0]


def wan_prompt_embeds(pipe: Any, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
    """``prompt_embeds`` of ``prompts`` through ``pipe``'s UMT5, as WanPipeline computes them: the I2V class's own
    prompt cleaning calls ftfy, which it does not check is installed."""
    from diffusers import WanPipeline

    return WanPipeline._get_t5_prompt_embeds(pipe, prompts, max_sequence_length=max_sequence_length,
                                             device=pipe._execution_device)


class WanI2VAdapter(WanAdapter):
    """Wan2.1-I2V-14B-480P/720P: ``WanTransformer3DModel`` with CLIP image conditioning, ``WanImageToVideoPipeline``."""

    family = "wan2.1-i2v"
    pipeline_class = "WanImageToVideoPipeline"
    streams = ("latents", "condition_latents", "image_embeds", "prompt_embeds")

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        cfg, latents = transformer.config, batch["latents"]
        condition, image = batch["condition_latents"], batch.get("image_embeds")
        problems = []
        if latents.ndim != 5 or condition.shape != latents.shape:
            problems.append(f"latents {tuple(latents.shape)} and condition_latents {tuple(condition.shape)} must "
                            "both be [B, C, F, H, W]")
        elif 2 * latents.shape[1] + 4 != cfg.in_channels:
            problems.append(f"latents have {latents.shape[1]} channels, transformer in_channels is "
                            f"{cfg.in_channels} (expected 2 x {latents.shape[1]} + 4)")
        if image is None and cfg.image_dim is not None:
            problems.append(f"the transformer takes an image embedding (image_dim {cfg.image_dim}), the {self.family} "
                            "cache has none (a Wan 2.1 I2V model: model.family wan2.1-i2v)")
        elif image is not None and (cfg.image_dim is None or image.shape[-1] != cfg.image_dim):
            problems.append(f"image_embeds width is {image.shape[-1]}, transformer image_dim is {cfg.image_dim}")
        if batch["prompt_embeds"].shape[-1] != cfg.text_dim:
            problems.append(f"prompt_embeds width is {batch['prompt_embeds'].shape[-1]}, transformer text_dim is "
                            f"{cfg.text_dim}")
        if problems:
            raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        return i2v_forward(model, noisy, sigmas_B, batch["prompt_embeds"], batch["condition_latents"],
                           batch.get("image_embeds"))

    validates_from_prompts = False  # its pipeline samples from an image (check_validation)

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        raise ValueError(f"trainer.validate_every: the {self.family} family samples from an image (see "
                         "latentmill.trainer.adapters.check_validation)")
