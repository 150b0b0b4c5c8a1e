"""HunyuanVideo 1.5 (``HunyuanVideo15Pipeline``): ``AutoencoderKLHunyuanVideo15`` latents (16x spatial, 4x temporal)
scaled ``z * scaling_factor``; two masked text streams, as ``HunyuanVideo15Pipeline.encode_prompt`` computes them
(diffusers 0.42):

* ``prompt_embeds``: Qwen2.5-VL's third-to-last hidden layer (``num_hidden_layers_to_skip=2``) over the pipeline's
  chat template (its system message, then the caption), with the template's first ``crop_start = 108`` tokens
  dropped; the real tokens only, at most ``min(cache.max_sequence_length, 1000)`` of them;
* ``prompt_embeds_2``: the ByT5 glyph encoder over the caption's quoted text (``"..."`` or ``“...”``, written
  ``Text "a". Text "b". ``); a caption without quoted text has no glyph token (the pipeline feeds zeros with an
  all-false mask, which the transformer drops), stored as zero tokens. At most 256 tokens (the pipeline's
  ``tokenizer_2_max_length``), whatever ``max_sequence_length``.

Both encoders are called through the pipeline's own static methods (``_get_mllm_prompt_embeds``,
``_get_byt5_prompt_embeds``), so the cached tokens are the pipeline's; the loader pads each stream to its
length with a ``<name>_mask`` column, which the transformer takes as ``encoder_attention_mask(_2)``: it moves the
real tokens of both streams ahead of the padding and masks the padding out, so the amount of padding does not
change the prediction.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Encoders, Stream

from latentmill.models import ModelConfig

# HunyuanVideo15Pipeline.prompt_template_encode_start_idx / tokenizer_max_length / tokenizer_2_max_length
CROP_START = 108
TOKENIZER_MAX_LENGTH = 1000
GLYPH_MAX_LENGTH = 256


class HunyuanVideo15Encoders(Encoders):
    """AutoencoderKLHunyuanVideo15 + Qwen2.5-VL (chat template, hidden_states[-3], cropped) + ByT5 (glyph text)."""

    name = "hunyuanvideo1.5"
    PIPELINES = ("HunyuanVideo15Pipeline",)
    COMPONENTS = ("vae", "text_encoder", "text_encoder_2")
    STREAMS = (
        Stream("latents", "vae", "[C, 1 + (F - 1)/4, H/16, W/16]", "z * scaling_factor"),
        # the transformer takes encoder_attention_mask: the real tokens are stored, the loader adds the mask
        Stream("prompt_embeds", "text", "[L, D]", pad="mask"),
        Stream("prompt_embeds_2", "text", "[L2, D2]", pad="mask", pad_to=GLYPH_MAX_LENGTH),
    )
    CLASS_IMPORTS = (("diffusers", "AutoencoderKLHunyuanVideo15"), ("transformers", "Qwen2_5_VLTextModel"),
                     ("transformers", "T5EncoderModel"), ("transformers", "AutoTokenizer"))
    VAE_FLOAT32 = True  # causal 3-D convs, as Wan's
    PIXEL_MULTIPLE = 16  # 16x VAE, 1 x 1 patches
    FRAME_STEP = 4  # 4k+1 frames

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers import AutoencoderKLHunyuanVideo15
        from transformers import Qwen2_5_VLTextModel, T5EncoderModel

        self.vae = self._load(AutoencoderKLHunyuanVideo15, "vae", self.compute_dtypes(device)["vae"])
        self.text_encoder = self._load(Qwen2_5_VLTextModel, "text_encoder")
        self.text_encoder_2 = self._load(T5EncoderModel, "text_encoder_2")
        self.tokenizer = self._tokenizer("text_encoder")
        self.tokenizer_2 = self._tokenizer("text_encoder_2")
        self.scaling_factor = float(self.vae.config.scaling_factor)

    @classmethod
    def describe_vae(cls, vae_config: dict[str, Any]) -> dict[str, Any]:
        return {"scaling_factor": float(vae_config.get("scaling_factor", 1.03682))}

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        vae = config("vae")
        spatial = int(vae.get("spatial_compression_ratio", 16))
        temporal = int(vae.get("temporal_compression_ratio", 4))
        frames = (int(bucket[2]) - 1) // temporal + 1 if len(bucket) > 2 else 1
        text = config("text_encoder")
        return {"latents": (int(vae.get("latent_channels", 32)), frames, int(bucket[1]) // spatial,
                            int(bucket[0]) // spatial),
                "prompt_embeds": (min(max_sequence_length, TOKENIZER_MAX_LENGTH), int(text.get("hidden_size", 3584))),
                "prompt_embeds_2": (GLYPH_MAX_LENGTH, int(config("text_encoder_2").get("d_model", 1472)))}

    @torch.no_grad()
    def encode_pixels(self, pixels_BCFHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the scaled latent distribution of clips in [-1, 1], one clip at a time (the VAE's
        mid-block attention cannot take a batch in diffusers 0.42, and one clip bounds the peak memory)."""
        means, stds = [], []
        for clip_1CFHW in pixels_BCFHW.split(1):
            with self.lock:
                dist = self.vae.encode(clip_1CFHW.to(self.device, self.compute_dtypes(self.device)["vae"])).latent_dist
            means.append(dist.mean.float().cpu())
            stds.append(dist.std.float().cpu())
            del dist
        return torch.cat(means) * self.scaling_factor, torch.cat(stds) * self.scaling_factor

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int, images: list | None = None) -> dict[str, Any]:
        """``prompt_embeds`` [B, L, D] (Qwen2.5-VL) and ``prompt_embeds_2`` [B, 256, D2] (ByT5 glyphs), zero past
        each stream's real tokens; ``lengths`` (Qwen) and ``prompt_embeds_2_lengths`` (ByT5, 0 without quoted
        text)."""
        from diffusers import HunyuanVideo15Pipeline as Pipe

        with self.lock:
            embeds, mask = Pipe._get_mllm_prompt_embeds(
                self.text_encoder, self.tokenizer, captions, self.device,
                tokenizer_max_length=min(max_sequence_length, TOKENIZER_MAX_LENGTH), crop_start=CROP_START)
            glyph, glyph_mask = Pipe._get_byt5_prompt_embeds(self.tokenizer_2, self.text_encoder_2, captions,
                                                             self.device, tokenizer_max_length=GLYPH_MAX_LENGTH)
        out: dict[str, Any] = {}
        for name, tensor, real in (("prompt_embeds", embeds, mask), ("prompt_embeds_2", glyph, glyph_mask)):
            tensor = tensor.float().cpu() * real.cpu().bool()[..., None]  # both tokenizers pad on the right
            out[name] = tensor
            out[f"{name}_lengths"] = real.bool().sum(1).tolist()
        out["lengths"] = out.pop("prompt_embeds_lengths")
        return out
