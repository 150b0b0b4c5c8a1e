"""Adapter between cached Wan 2.2 VAE latents and an unmodified ``WanTransformer3DModel`` of Wan2.2-TI2V-5B.

The transformer is Wan 2.1's class with 48 channels; what differs is how ``WanPipeline`` and
``WanImageToVideoPipeline`` call it with ``expand_timesteps``: ``timestep`` is [B, seq], one value per token
(``mask[:, 0, :, ::2, ::2] * t`` flattened, the patch grid of the latents), so that

* text-to-video: every token gets ``t = 1000 * sigma`` (the same as Wan 2.1's per-sample timestep);
* image-to-video: latent frame 0 is the image's latent, kept clean, and its tokens get timestep 0; only the
  other frames are denoised (trained: ``trainer.i2v_probability``, ``latentmill.trainer.objective``).

Shape legend: B batch, C latent channels (48), F latent frames ((frames - 1) / 4 + 1), H/W latent
height/width (pixels / 16), L text tokens, D text width (UMT5 d_model).
"""

from __future__ import annotations

import torch
from latentmill.trainer.wan import WanAdapter
from torch import nn


def ti2v_timesteps(
    transformer: nn.Module, sigmas_B: torch.Tensor, shape: torch.Size, first_frame_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-token timesteps [B, seq] of latents of ``shape`` [B, C, F, H, W], as the pipelines build them:
    ``1000 * sigma`` on every token, 0 where ``first_frame_mask`` [B, 1, F, H, W] is 0."""
    _, ph, pw = transformer.config.patch_size
    t_B = sigmas_B.to(torch.float32) * 1000.0
    if first_frame_mask is None:
        first_frame_mask = torch.ones(shape[0], 1, *shape[2:], dtype=torch.float32, device=sigmas_B.device)
    return (first_frame_mask[:, 0, :, ::ph, ::pw].float() * t_B.view(-1, 1, 1, 1)).flatten(1)


def ti2v_forward(
    transformer: nn.Module, noisy_BCFHW: torch.Tensor, sigmas_B: torch.Tensor, prompt_embeds_BLD: torch.Tensor,
    first_frame_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Predict the flow velocity [B, C, F, H, W], calling the transformer exactly like the TI2V pipelines."""
    return transformer(
        hidden_states=noisy_BCFHW,
        timestep=ti2v_timesteps(transformer, sigmas_B.to(noisy_BCFHW.device), noisy_BCFHW.shape, first_frame_mask),
        encoder_hidden_states=prompt_embeds_BLD.to(noisy_BCFHW.dtype),
        return_dict=False,
    )[0]


class WanTI2VAdapter(WanAdapter):
    """Wan2.2-TI2V-5B: text-to-video (``WanPipeline``) and image-to-video (``WanImageToVideoPipeline``) with
    ``expand_timesteps``; one export serves both pipelines."""

    family = "wan2.2-ti2v"
    first_frame_conditioning = True

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        return ti2v_forward(model, noisy, sigmas_B, batch["prompt_embeds"], batch.get("first_frame_mask"))
