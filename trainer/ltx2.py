"""Adapter between cached LTX-2 streams and an unmodified ``LTX2VideoTransformer3DModel`` (video with audio).

The transformer denoises a clip's video and its sound in one call, as ``LTX2Pipeline.__call__`` makes it:

* ``hidden_states`` / ``audio_hidden_states``: the noisy latents packed into tokens (``_pack_latents``: patch
  1 x 1 x 1, so one token per latent voxel; ``_pack_audio_latents``: one token per audio latent frame, its
  channels x mel bins as features);
* ``timestep`` and ``sigma``: ``1000 * sigma`` per sample, one noise level shared by the video and the audio
  (the pipeline steps both with the same schedule); ``use_cross_timestep`` as the pipeline's default (True);
* ``encoder_hidden_states`` / ``audio_encoder_hidden_states`` / both masks: the connectors' cached outputs;
* ``video_coords`` / ``audio_coords``: the positions the pipeline builds (``prepare_video_coords`` at the clip's
  frame rate, in seconds; ``prepare_audio_coords``).

The loss is the one LTX-2 was trained with: flow matching on both modalities at the sample's noise level, the
audio term weighted by ``trainer.audio_loss_weight`` (the loop noises ``audio_latents`` with the video:
``ModelAdapter.noised_streams``).

Shape legend: B batch, C latent channels (128), F latent frames ((frames - 1) / 8 + 1), H/W latent height/width
(pixels / 32), C_a audio latent channels, L audio latent frames, M latent mel bins, T text tokens, D text width.
"""

from __future__ import annotations

from typing import Any

import torch
from latentmill.trainer.adapter import VALIDATION_FRAMES, ModelAdapter
from torch import nn


def ltx2_forward(transformer: nn.Module, noisy_BCFHW: torch.Tensor, noisy_audio_BCLM: torch.Tensor,
                 sigmas_B: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The flow velocities of the video [B, C, F, H, W] and the audio [B, C_a, L, M], calling the transformer
    exactly like ``LTX2Pipeline`` (one noise level per sample for both)."""
    from diffusers import LTX2Pipeline

    cfg = transformer.config
    batch_size, _, frames, height, width = noisy_BCFHW.shape
    _, _, audio_frames, mel_bins = noisy_audio_BCLM.shape
    device, dtype = noisy_BCFHW.device, noisy_BCFHW.dtype
    hidden = LTX2Pipeline._pack_latents(noisy_BCFHW, cfg.patch_size, cfg.patch_size_t)
    audio_hidden = LTX2Pipeline._pack_audio_latents(noisy_audio_BCLM.to(dtype))
    # positions in seconds at each clip's own rate (the pipeline passes one frame_rate for its batch)
    video_coords = transformer.rope.prepare_video_coords(batch_size, frames, height, width, device, fps=1.0)
    video_coords[:, 0] = video_coords[:, 0] / batch["frame_rate"].to(device, video_coords.dtype).view(-1, 1, 1)
    audio_coords = transformer.audio_rope.prepare_audio_coords(batch_size, audio_frames, device)
    timestep = sigmas_B.to(device=device, dtype=torch.float32) * 1000.0
    mask = batch["prompt_attention_mask"].to(device)
    video, audio = transformer(
        hidden_states=hidden,
        audio_hidden_states=audio_hidden,
        encoder_hidden_states=batch["prompt_embeds"].to(dtype),
        audio_encoder_hidden_states=batch["audio_prompt_embeds"].to(dtype),
        timestep=timestep,
        sigma=timestep,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        audio_num_frames=audio_frames,
        video_coords=video_coords,
        audio_coords=audio_coords,
        use_cross_timestep=True,
        return_dict=False,
    )
    return (LTX2Pipeline._unpack_latents(video, frames, height, width, cfg.patch_size, cfg.patch_size_t),
            LTX2Pipeline._unpack_audio_latents(audio, audio_frames, num_mel_bins=mel_bins))


class LTX2Adapter(ModelAdapter):
    """LTX-2 (Lightricks/LTX-2): ``LTX2VideoTransformer3DModel``, ``LTX2Pipeline``; video and audio denoised
    together."""

    family = "ltx2"
    transformer_class = "LTX2VideoTransformer3DModel"
    pipeline_class = "LTX2Pipeline"
    streams = ("latents", "audio_latents", "frame_rate", "prompt_embeds", "audio_prompt_embeds",
               "prompt_attention_mask")
    noised_streams = ("audio_latents",)
    latent_ndim = 4
    text_in_blocks = False  # the text feeds each block's cross-attention
    # its RoPE rotates queries and keys in float32 (apply_interleaved_rotary_emb), in self-attention and in the
    # audio-video cross-attention, and backward keeps those float32 copies: 64 bytes per token and unit of D a block
    # saves beyond the bf16 count (MemTracker, bench/actplan.py: -52% without)
    float32_activations = (0, 64)

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def side_streams(self, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, int, int]]:
        # the audio tokens (one per audio latent frame: patch 1) run through every block at the audio widths
        hidden = int(config.get("audio_num_attention_heads", 32)) * int(config.get("audio_attention_head_dim", 64))
        return [(shapes["audio_latents"][1], hidden, 4 * hidden)]

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        cfg, problems = transformer.config, []
        latents, audio = batch["latents"], batch["audio_latents"]
        if latents.ndim != 5 or latents.shape[1] != cfg.in_channels:
            problems.append(f"latents have shape {tuple(latents.shape)}, expected [B, {cfg.in_channels}, F, H, W]")
        if audio.ndim != 4 or audio.shape[1] * audio.shape[3] != cfg.audio_in_channels:
            problems.append(f"audio_latents have shape {tuple(audio.shape)}: channels x mel bins must be the "
                            f"transformer's audio_in_channels ({cfg.audio_in_channels})")
        if batch["prompt_embeds"].shape[-1] != cfg.caption_channels:
            problems.append(f"prompt_embeds width is {batch['prompt_embeds'].shape[-1]}, transformer "
                            f"caption_channels is {cfg.caption_channels}")
        if problems:
            raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))

    def seq_len(self, latents: torch.Tensor) -> int:
        _, _, frames, height, width = latents.shape
        return frames * height * width  # patch 1 x 1 x 1

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> tuple[torch.Tensor, dict]:
        video, audio = ltx2_forward(model, noisy, batch["audio_latents"], sigmas_B, batch)
        return video, {"audio_latents": audio}

    # its pipeline takes the Gemma hidden states before the connectors, which the cache does not keep (it stores
    # the connectors' outputs): validation loads the text encoder and encodes the prompts itself
    prompts_from_cache = False

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        from PIL import Image

        width, height = size[0], size[1]
        frames = size[2] if len(size) > 2 else VALIDATION_FRAMES
        video, _ = pipe(**text, **negative, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                        guidance_scale=guidance_scale, max_sequence_length=max_sequence_length, generator=generator,
                        output_type="np", return_dict=False)
        rows = []
        for clip in video:
            rows.append([Image.fromarray((frame * 255).round().astype("uint8")) for frame in clip])  # every frame
        return rows
