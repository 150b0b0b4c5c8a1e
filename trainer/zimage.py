"""Adapter between cached latents and an unmodified Diffusers ``ZImageTransformer2DModel`` (Z-Image, Z-Image-Turbo).

The transformer sees what ``ZImagePipeline.__call__`` gives it at inference time:

* ``x``: a list of per-sample latents ``[C, 1, H, W]`` (the pipeline's ``latents.unsqueeze(2).unbind(0)``); the
  model patchifies 2x2 (``patch_size=2``, ``f_patch_size=1``), pads each sequence to a multiple of 32 and builds
  its own RoPE position ids (caption tokens along the first axis, the image after them);
* ``t``: ``(1000 - timestep) / 1000`` for the scheduler's ``timestep = 1000 * sigma``, i.e. ``1 - sigma``: Z-Image's
  time runs from 0 (noise) to 1 (data), the model multiplies it by ``t_scale`` (1000) itself;
* ``cap_feats``: a list of per-prompt Qwen3 embeddings of the real tokens only, ``[n_i, D]``. The loader gives
  ``prompt_embeds`` zero-padded to ``text.pad_to`` with ``prompt_embeds_mask`` (True on real tokens); the
  adapter selects the masked-in rows, as the pipeline's ``prompt_embeds[i][prompt_masks[i]]``.

The model's output is the negated velocity: the pipeline steps the flow-matching scheduler with
``noise_pred = -output``. ``forward`` returns ``-output``, the flow velocity ``noise - x0`` the objective trains
(the same target as Flux and Wan).

The shift: Z-Image-Turbo's scheduler has a static ``shift: 3.0`` (``use_dynamic_shifting: false``; the ``mu`` the
pipeline computes is then unused): recipes train with ``trainer.shift_mode: fixed``, ``trainer.shift: 3.0``.
``shift_mode: resolution`` uses the pipeline's ``calculate_shift`` (Flux's linear rule, the inherited default),
what a scheduler with dynamic shifting would apply.

Shape legend: B batch, C latent channels (16), H/W latent height/width (pixels / 8), L text tokens (padded),
D text width (Qwen3 hidden size, ``cap_feat_dim``).
"""

from __future__ import annotations

import torch
from latentmill.trainer.adapter import ModelAdapter, mask_problems
from torch import nn

# What community Z-Image LoRAs train (musubi-tuner's networks.lora_zimage, ai-toolkit): the attention projections
# and the SwiGLU feed-forward of the 30 main layers, not the noise / context refiner blocks, the embedders or the
# adaLN modulation (diffusers names; trainer.lora_target_modules as one "re:" regex on the full module name).
LORA_REGEX = r"layers\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.(w1|w2|w3))"
LORA_TARGETS = ("re:" + LORA_REGEX,)


def caption_list(prompt_embeds_BLD: torch.Tensor, mask_BL: torch.Tensor) -> list[torch.Tensor]:
    """The per-sample real-token embeddings ``[n_i, D]`` of zero-padded ``prompt_embeds`` and their mask: views of
    each row's first ``n_i`` tokens (the loader pads after the real tokens), no copy."""
    lengths = mask_BL.sum(1).tolist()
    return [embeds_LD[:n] for embeds_LD, n in zip(prompt_embeds_BLD, lengths)]


def zimage_forward(transformer: nn.Module, noisy_BCHW: torch.Tensor, sigmas_B: torch.Tensor,
                   prompt_embeds_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
    """Predict the flow velocity [B, C, H, W], calling the transformer exactly like ``ZImagePipeline``.
    ``transformer`` may be wrapped in DDP."""
    device, dtype = noisy_BCHW.device, noisy_BCHW.dtype
    # the pipeline's (1000 - timestep) / 1000 with timestep = 1000 * sigma, in its float32 rounding
    t_B = (1000.0 - sigmas_B.to(device=device, dtype=torch.float32) * 1000.0) / 1000.0
    x = list(noisy_BCHW.unsqueeze(2).unbind(0))  # per sample [C, 1, H, W]
    caps = caption_list(prompt_embeds_BLD.to(dtype), mask_BL)
    out = transformer(x, t_B, caps, return_dict=False)[0]  # per sample [C, 1, H, W]
    return -torch.stack(out).squeeze(2)  # the pipeline steps the scheduler with -output


def check_zimage_batch_fits(transformer: nn.Module, latents_BCHW: torch.Tensor, prompt_embeds_BLD: torch.Tensor,
                            mask_BL: torch.Tensor | None) -> None:
    """Raise ``ValueError`` saying what differs when cached tensors do not fit a ``ZImageTransformer2DModel``."""
    cfg = transformer.config
    problems = []
    patch = int(cfg.all_patch_size[0])
    if latents_BCHW.ndim != 4:
        problems.append(f"latents have shape {tuple(latents_BCHW.shape)}, expected [B, C, H, W] (images)")
    else:
        if latents_BCHW.shape[1] != cfg.in_channels:
            problems.append(f"latents have {latents_BCHW.shape[1]} channels, transformer in_channels is "
                            f"{cfg.in_channels}")
        if latents_BCHW.shape[2] % patch or latents_BCHW.shape[3] % patch:
            problems.append(f"latent size {tuple(latents_BCHW.shape[2:])} is not a multiple of the "
                            f"{patch}x{patch} patches")
    if prompt_embeds_BLD.shape[-1] != cfg.cap_feat_dim:
        problems.append(f"prompt_embeds width is {prompt_embeds_BLD.shape[-1]}, transformer cap_feat_dim is "
                        f"{cfg.cap_feat_dim}")
    if mask_BL is None:
        problems.append("no prompt_embeds_mask column: the cache manifest does not declare prompt_embeds as a "
                        "'mask' stream (a z-image cache made by `latentmill prep` does)")
    else:
        problems += mask_problems(prompt_embeds_BLD, mask_BL, "ZImagePipeline's chat template alone gives several")
    if problems:
        raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))


class ZImageAdapter(ModelAdapter):
    """Z-Image-class models (Z-Image-Turbo, Z-Image): ``ZImageTransformer2DModel``, ``ZImagePipeline``."""

    family = "z-image"
    transformer_class = "ZImageTransformer2DModel"
    pipeline_class = "ZImagePipeline"
    streams = ("latents", "prompt_embeds")  # and the loader's prompt_embeds_mask (a "mask" stream)
    latent_ndim = 3
    lora_targets = LORA_TARGETS
    # its sandwich RMSNorms (four per block) take float32 inputs and its RoPE rotates queries and keys in float32:
    # 32 bytes per token and unit of D a block saves beyond the bf16 count (MemTracker, bench/actplan.py)
    float32_activations = (0, 32)

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        # forward order: the noise refiner (image tokens), the context refiner (caption tokens), the main layers
        return [*transformer.noise_refiner, *transformer.context_refiner, *transformer.layers]

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        check_zimage_batch_fits(transformer, batch["latents"], batch["prompt_embeds"],
                                batch.get("prompt_embeds_mask"))

    def seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)  # 2x2 patches

    def block_widths(self, config: dict) -> tuple[int, int]:
        hidden = int(config["dim"])
        # its SwiGLU feed-forward (8/3 x hidden) keeps both projections' outputs, the gate's activation and their
        # product: as many tensors per token as a GELU one twice as wide (MemTracker, bench/actplan.py: -22% with
        # its own width)
        return hidden, 2 * int(hidden / 3 * 8)

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        return zimage_forward(model, noisy, sigmas_B, batch["prompt_embeds"], batch["prompt_embeds_mask"])

    def pipeline_prompt_kwargs(self, prompts, pad_to):
        return {"prompt_embeds": [p["prompt_embeds"] for p in prompts]}  # a list of each prompt's real tokens

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        width, height = size[0], size[1]
        out = pipe(**text, **negative, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance_scale,
                   max_sequence_length=max_sequence_length, generator=generator)
        return [[image] for image in out.images]
