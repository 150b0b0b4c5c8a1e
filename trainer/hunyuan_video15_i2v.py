"""Adapter between cached HunyuanVideo 1.5 image-to-video streams and an unmodified
``HunyuanVideo15Transformer3DModel`` of HunyuanVideo-1.5-480p_i2v / 720p_i2v.

The transformer sees what ``HunyuanVideo15ImageToVideoPipeline.__call__`` (diffusers 0.42) gives it: the
text-to-video call (``latentmill.trainer.hunyuan_video15``), except that

* the condition channels of ``hidden_states`` hold the cached ``image_latents`` (the first frame alone through the
  VAE) on latent frame 0 and zeros after, and the mask channel is ones on frame 0
  (``prepare_cond_latents_and_mask``);
* ``image_embeds`` are the first frame's cached SigLIP tokens, all attended to.

Every latent frame is noised and learned, frame 0 too: the image conditions through the extra channels and the
image tokens, not by a clean frame, as in the pipeline's denoising loop.

Shape legend: as ``latentmill.trainer.hunyuan_video15``, and S image tokens (729 for SigLIP so400m at 384 px), E
their width (1152).
"""

from __future__ import annotations

from typing import Any

import torch
from latentmill.trainer.hunyuan_video15 import HunyuanVideo15Adapter, hunyuan_video15_forward, trim_tokens
from torch import nn


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    """HunyuanVideo 1.5 image-to-video: ``HunyuanVideo15Transformer3DModel``, ``HunyuanVideo15ImageToVideoPipeline``."""

    family = "hunyuanvideo1.5-i2v"
    pipeline_class = "HunyuanVideo15ImageToVideoPipeline"
    streams = ("latents", "image_latents", "image_embeds", "prompt_embeds", "prompt_embeds_2")
    validates_from_prompts = False  # its pipeline samples from an image (check_validation)

    def check_batch(self, transformer: nn.Module, batch: dict[str, Any]) -> None:
        latents, image, embeds = batch["latents"], batch["image_latents"], batch["image_embeds"]
        problems = []
        if latents.ndim == 5 and (image.ndim != 5 or image.shape[2] != 1 or image.shape[:2] != latents.shape[:2]
                                  or image.shape[3:] != latents.shape[3:]):
            problems.append(f"image_latents have shape {tuple(image.shape)}, expected one latent frame of the "
                            f"latents' {tuple(latents.shape)}: [B, C, 1, H, W]")
        if embeds.shape[-1] != transformer.config.image_embed_dim:
            problems.append(f"image_embeds width is {embeds.shape[-1]}, the transformer takes "
                            f"{transformer.config.image_embed_dim} (image_embed_dim)")
        if problems:
            raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))
        super().check_batch(transformer, batch)

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        text, mask = trim_tokens(batch["prompt_embeds"], batch["prompt_embeds_mask"])
        glyph, glyph_mask = trim_tokens(batch["prompt_embeds_2"], batch["prompt_embeds_2_mask"])
        return hunyuan_video15_forward(model, noisy, sigmas_B, text, mask, glyph, glyph_mask,
                                       image_latents_BC1HW=batch["image_latents"], image_embeds_BSE=batch["image_embeds"])

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        raise ValueError(f"trainer.validate_every: the {self.family} family samples from an image (see "
                         "latentmill.trainer.adapters.check_validation)")
