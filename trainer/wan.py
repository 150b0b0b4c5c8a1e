"""Adapter between cached video latents and an unmodified Diffusers ``WanTransformer3DModel`` (Wan2.1-class).

The transformer sees what ``WanPipeline.__call__`` gives it at inference time:

* ``hidden_states``: the latents themselves, [B, 16, F', H/8, W/8] (the model patchifies (1, 2, 2) inside);
* ``timestep``: ``t = 1000 * sigma`` per sample (the pipeline passes the scheduler's timesteps, which for
  ``UniPCMultistepScheduler(use_flow_sigmas=True)`` are ``sigma * num_train_timesteps``; the pipeline rounds
  them to integers, training keeps the exact float);
* ``encoder_hidden_states``: UMT5 embeddings of the real tokens, zero-padded to ``max_sequence_length`` (the
  loader pads trimmed cache embeddings the same way).

The network predicts the flow velocity ``noise - x0``, the same target as Flux: Wan's scheduler is run with
``prediction_type="flow_prediction"`` and recovers ``x0 = x_sigma - sigma * prediction``.

Shape legend: B batch, C latent channels (16), F latent frames ((frames - 1) / 4 + 1), H/W latent
height/width (pixels / 8), L text tokens, D text width (UMT5 d_model).
"""

from __future__ import annotations

import torch
from latentmill.trainer.adapter import ONE_EXPERT, VALIDATION_FRAMES, Expert, ModelAdapter, pipeline_index
from torch import nn


def wan_forward(
    transformer: nn.Module, noisy_BCFHW: torch.Tensor, sigmas_B: torch.Tensor, prompt_embeds_BLD: torch.Tensor
) -> torch.Tensor:
    """Predict the flow velocity [B, C, F, H, W], calling the transformer exactly like ``WanPipeline``."""
    device, dtype = noisy_BCFHW.device, noisy_BCFHW.dtype
    timestep = sigmas_B.to(device=device, dtype=torch.float32) * 1000.0
    return transformer(
        hidden_states=noisy_BCFHW,
        timestep=timestep,
        encoder_hidden_states=prompt_embeds_BLD.to(dtype),
        return_dict=False,
    )[0]


def check_video_batch_fits(
    transformer: nn.Module, latents: torch.Tensor, prompt_embeds_BLD: torch.Tensor
) -> None:
    """Raise ``ValueError`` saying what differs when cached tensors do not fit a ``WanTransformer3DModel``."""
    cfg = transformer.config
    problems = []
    if latents.ndim != 5:
        problems.append(f"latents have shape {tuple(latents.shape)}, expected [B, C, F, H, W] (videos)")
    else:
        if latents.shape[1] != cfg.in_channels:
            problems.append(
                f"latents have {latents.shape[1]} channels, transformer in_channels is {cfg.in_channels}"
            )
        pt, ph, pw = cfg.patch_size
        if latents.shape[2] % pt or latents.shape[3] % ph or latents.shape[4] % pw:
            problems.append(
                f"latent size {tuple(latents.shape[2:])} (F, H, W) is not a multiple of patch_size {tuple(cfg.patch_size)}"
            )
    if prompt_embeds_BLD.shape[-1] != cfg.text_dim:
        problems.append(
            f"prompt_embeds width is {prompt_embeds_BLD.shape[-1]}, transformer text_dim is {cfg.text_dim}"
        )
    if problems:
        raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))


class WanAdapter(ModelAdapter):
    """Wan-class text-to-video models (Wan2.1-T2V-1.3B/14B, Wan2.2-T2V-A14B's two experts):
    ``WanTransformer3DModel``, ``WanPipeline``."""

    family = "wan"
    transformer_class = "WanTransformer3DModel"
    pipeline_class = "WanPipeline"
    streams = ("latents", "prompt_embeds")
    latent_ndim = 4

    def experts(self, pretrained: str) -> tuple[Expert, ...]:
        """Wan 2.2 A14B (``boundary_ratio`` and ``transformer_2`` in ``model_index.json``): the high-noise
        ``transformer`` for sigma >= boundary_ratio, the low-noise ``transformer_2`` below; Wan 2.1: one."""
        index = pipeline_index(pretrained)
        boundary = index.get("boundary_ratio")
        if boundary is None or not all(index.get("transformer_2") or [None]):
            return ONE_EXPERT
        return (Expert("high", "transformer", float(boundary)), Expert("low", "transformer_2", 0.0, float(boundary)))

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.blocks)

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        check_video_batch_fits(transformer, batch["latents"], batch["prompt_embeds"])

    def seq_len(self, latents: torch.Tensor) -> int:
        _, _, frames, height, width = latents.shape
        return frames * (height // 2) * (width // 2)  # patch (1, 2, 2)

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        return wan_forward(model, noisy, sigmas_B, batch["prompt_embeds"])

    def validation_images(
        self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale
    ):
        from PIL import Image

        width, height = size[0], size[1]
        frames = size[2] if len(size) > 2 else VALIDATION_FRAMES
        out = pipe(
            **text,
            **negative,  # used with classifier-free guidance (guidance_scale > 1)
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            max_sequence_length=max_sequence_length,
            generator=generator,
            output_type="np",
        ).frames  # [B, F, H, W, 3] in [0, 1]
        rows = []
        for video in out:
            rows.append([Image.fromarray((frame * 255).round().astype("uint8")) for frame in video])  # every frame
        return rows
