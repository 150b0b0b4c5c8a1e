"""Adapter between cached HunyuanVideo 1.5 streams and an unmodified ``HunyuanVideo15Transformer3DModel``.

The transformer sees what ``HunyuanVideo15Pipeline.__call__`` (text-to-video, diffusers 0.42) gives it:

* ``hidden_states``: [B, 2C + 1, F, H, W], the noisy latents, then the condition latents and a 1-channel mask,
  both zeros for text-to-video (``prepare_cond_latents_and_mask``), stacked on channels;
* ``timestep``: ``t = 1000 * sigma`` per sample, in the latents' dtype (the pipeline passes the
  ``FlowMatchEulerDiscreteScheduler``'s timesteps, ``t.expand(B).to(latent_model_input.dtype)``);
* ``encoder_hidden_states`` / ``encoder_attention_mask``: the Qwen2.5-VL ``prompt_embeds`` and their mask;
  ``encoder_hidden_states_2`` / ``encoder_attention_mask_2``: the ByT5 glyph ``prompt_embeds_2`` and theirs
  (all false for a caption without quoted text);
* ``image_embeds``: zeros, the pipeline's ``[B, 729, image_embed_dim]`` for text-to-video.

The transformer moves each stream's real tokens ahead of its padding, zeroes the padding and masks it out of
every attention; all-zero ``image_embeds`` are masked out whole. So the amount of padding does not change the
prediction (a sum over masked keys adds exact zeros): the adapter trims a batch's text to its longest real
caption of each stream and passes one zero image token for the pipeline's 729, which leaves the latent tokens'
prediction that of the pipeline's call (``tests/test_hunyuan_video15.py`` checks it against a recorded pipeline
call). Without that, a tiny clip's 48 latent tokens would sit beside ~2,000 padding tokens.

The target is the flow velocity ``noise - x0``: the pipeline's ``FlowMatchEulerDiscreteScheduler`` steps
``x + (sigma_next - sigma) * prediction``. Its ``shift`` (5.0 for the 480p models, 9.0 for 720p text-to-video)
is the recipe's ``trainer.shift``.

Shape legend: B batch, C latent channels (32), F latent frames ((frames - 1) / 4 + 1), H/W latent height/width
(pixels / 16), L Qwen text tokens, D its width (3584), L2 glyph tokens (at most 256), D2 ByT5's width (1472).
"""

from __future__ import annotations

from typing import Any

import torch
from latentmill.trainer.adapter import VALIDATION_FRAMES, ModelAdapter, mask_problems, padded
from torch import nn

# the zero image tokens that stand for the pipeline's 729 (vision_num_semantic_tokens) in text-to-video
T2V_IMAGE_TOKENS = 1


def trim_tokens(embeds_BLD: torch.Tensor, mask_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``embeds_BLD`` and ``mask_BL`` cut to the batch's longest real row (real tokens come first); one masked
    column is kept for a batch without any real token (ByT5 on captions without quoted text)."""
    keep = max(1, int(mask_BL.sum(1).max()))
    return embeds_BLD[:, :keep], mask_BL[:, :keep]


def hunyuan_video15_forward(
    transformer: nn.Module, noisy_BCFHW: torch.Tensor, sigmas_B: torch.Tensor, prompt_embeds_BLD: torch.Tensor,
    mask_BL: torch.Tensor, glyph_BLD: torch.Tensor, glyph_mask_BL: torch.Tensor,
    image_tokens: int = T2V_IMAGE_TOKENS, image_latents_BC1HW: torch.Tensor | None = None,
    image_embeds_BSE: torch.Tensor | None = None,
) -> torch.Tensor:
    """Predict the flow velocity [B, C, F, H, W], calling the transformer like ``HunyuanVideo15Pipeline``
    (text-to-video: zero condition latents, mask and ``image_tokens`` zero image embeddings) or, given the first
    frame's ``image_latents_BC1HW`` and ``image_embeds_BSE``, like ``HunyuanVideo15ImageToVideoPipeline``: the
    image latents on latent frame 0 and zeros after, a mask of ones on frame 0, the image embeddings."""
    batch, _, frames, height, width = noisy_BCFHW.shape
    dtype, device = noisy_BCFHW.dtype, noisy_BCFHW.device
    condition = torch.zeros_like(noisy_BCFHW)
    mask = noisy_BCFHW.new_zeros(batch, 1, frames, height, width)
    if image_latents_BC1HW is None:
        image_embeds = torch.zeros(batch, image_tokens, transformer.config.image_embed_dim, dtype=dtype, device=device)
    else:
        condition[:, :, :1] = image_latents_BC1HW.to(device=device, dtype=dtype)
        mask[:, :, 0] = 1
        image_embeds = image_embeds_BSE.to(device=device, dtype=dtype)
    return transformer(
        hidden_states=torch.cat([noisy_BCFHW, condition, mask], dim=1),
        image_embeds=image_embeds,
        timestep=(sigmas_B.to(device=device, dtype=torch.float32) * 1000.0).to(dtype),
        encoder_hidden_states=prompt_embeds_BLD.to(device=device, dtype=dtype),
        encoder_attention_mask=mask_BL.to(device),
        encoder_hidden_states_2=glyph_BLD.to(device=device, dtype=dtype),
        encoder_attention_mask_2=glyph_mask_BL.to(device),
        return_dict=False,
    )[0]


class HunyuanVideo15Adapter(ModelAdapter):
    """HunyuanVideo 1.5 text-to-video (480p / 720p T2V): ``HunyuanVideo15Transformer3DModel``,
    ``HunyuanVideo15Pipeline``."""

    family = "hunyuanvideo1.5"
    transformer_class = "HunyuanVideo15Transformer3DModel"
    pipeline_class = "HunyuanVideo15Pipeline"
    streams = ("latents", "prompt_embeds", "prompt_embeds_2")
    latent_ndim = 4
    # each block's attention builds a boolean [S, S] mask over its whole sequence and SDPA saves it for backward as a
    # bf16 additive mask: 2 bytes per token pair and block (measured on the real class, tests/test_plan_activations.py)
    attention_mask_bytes = 2

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def text_tokens(self, shapes: dict[str, tuple[int, ...]]) -> int:
        # the glyph tokens and the image tokens join the Qwen tokens in every block's sequence
        image = shapes.get("image_embeds", (T2V_IMAGE_TOKENS,))[0]
        return int(shapes["prompt_embeds"][0] + shapes["prompt_embeds_2"][0] + image)

    def unused_modules(self, transformer: nn.Module) -> list[nn.Module]:
        """The last block's text-stream attention output and MLP: only the video stream is read after it."""
        last = transformer.transformer_blocks[-1]
        return [last.attn.to_add_out, last.ff_context]

    def check_batch(self, transformer: nn.Module, batch: dict[str, Any]) -> None:
        cfg, latents = transformer.config, batch["latents"]
        problems = []
        if latents.ndim != 5:
            problems.append(f"latents have shape {tuple(latents.shape)}, expected [B, C, F, H, W] (videos)")
        elif 2 * latents.shape[1] + 1 != cfg.in_channels or latents.shape[1] != cfg.out_channels:
            problems.append(f"latents have {latents.shape[1]} channels, the transformer takes {cfg.in_channels} in "
                            f"(2 x C + 1) and gives {cfg.out_channels}")
        for name, width in (("prompt_embeds", cfg.text_embed_dim), ("prompt_embeds_2", cfg.text_embed_2_dim)):
            if batch[name].shape[-1] != width:
                problems.append(f"{name} width is {batch[name].shape[-1]}, the transformer takes {width}")
        if not problems:
            problems = mask_problems(batch["prompt_embeds"], batch["prompt_embeds_mask"],
                                     "the chat template's assistant header alone gives tokens")
        if problems:
            raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))

    def seq_len(self, latents: torch.Tensor) -> int:
        _, _, frames, height, width = latents.shape
        return frames * height * width  # 1 x 1 x 1 patches

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        text, mask = trim_tokens(batch["prompt_embeds"], batch["prompt_embeds_mask"])
        glyph, glyph_mask = trim_tokens(batch["prompt_embeds_2"], batch["prompt_embeds_2_mask"])
        return hunyuan_video15_forward(model, noisy, sigmas_B, text, mask, glyph, glyph_mask)

    def pipeline_prompt_kwargs(self, prompts, pad_to):
        # both streams padded to the pipeline's tokenizer lengths, each with its mask
        embeds_BLD, mask_BL = padded([p["prompt_embeds"] for p in prompts], pad_to["prompt_embeds"])
        glyph_BLD, glyph_mask_BL = padded([p["prompt_embeds_2"] for p in prompts], pad_to["prompt_embeds_2"])
        return {"prompt_embeds": embeds_BLD, "prompt_embeds_mask": mask_BL, "prompt_embeds_2": glyph_BLD,
                "prompt_embeds_mask_2": glyph_mask_BL}

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        from PIL import Image

        width, height = size[0], size[1]
        frames = size[2] if len(size) > 2 else VALIDATION_FRAMES
        rows = []
        count = len(next(iter(text.values())))
        for i in range(count):  # one at a time: the VAE's decoder takes no batch (diffusers 0.42)
            one = {k: v[i:i + 1] for k, v in {**text, **negative}.items()}
            video = pipe(**one, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                         generator=generator, output_type="np").frames[0]  # [F, H, W, 3] in [0, 1]
            rows.append([Image.fromarray((frame * 255).round().astype("uint8")) for frame in video])  # every frame
        return rows
