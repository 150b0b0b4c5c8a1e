"""Wan 2.1 I2V (Wan2.1-I2V-14B-480P/720P): Wan 2.1's latents and UMT5 text, plus the first frame's conditioning
as ``WanImageToVideoPipeline`` computes it from the conditioning image.

The pipeline conditions a clip on its first frame twice: ``condition_latents``, the VAE's mode (``argmax``) of
the first frame followed by zero frames, normalised like the latents; and ``image_embeds``, the first frame's
CLIP vision features (``hidden_states[-2]``). Both depend on the pixels alone, so they are stored in the VAE
member and the VAE component's key covers the image encoder and its processor (``PIXEL_COMPONENTS``). The
first-frame mask beside the condition is fixed and built at train time (``latentmill.trainer.wan21_i2v``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Stream
from latentmill.stages.family_wan import WanEncoders

from latentmill.models import ModelConfig, component_source

# the first frame's conditioning of WanImageToVideoPipeline without expand_timesteps (Wan 2.1 I2V, Wan 2.2 I2V A14B)
CONDITION_LATENTS = Stream("condition_latents", "vae", "[C, 1 + (F - 1)/4, H/8, W/8]",
                           "(mode(first frame, then F - 1 zero frames) - latents_mean) / latents_std")


@torch.no_grad()
def condition_latents(encoders: WanEncoders, pixels_BCFHW: torch.Tensor) -> torch.Tensor:
    """``condition_latents`` [B, C, F', H/8, W/8] of clips in [-1, 1], as ``WanImageToVideoPipeline.prepare_latents``
    computes them from the first frame: that frame followed by zero frames, the VAE's mode, normalised."""
    condition = torch.cat([pixels_BCFHW[:, :, :1], torch.zeros_like(pixels_BCFHW[:, :, 1:])], dim=2)
    return encoders.encode_pixels(condition)[0]  # a diagonal Gaussian's mode is its mean


class WanI2VEncoders(WanEncoders):
    """AutoencoderKLWan + UMT5 + the CLIP image encoder, as WanImageToVideoPipeline uses them."""

    name = "wan2.1-i2v"
    PIPELINES = ("WanImageToVideoPipeline",)
    COMPONENTS = ("vae", "text_encoder", "image_encoder")
    PIXEL_COMPONENTS = ("vae", "image_encoder")  # (the image encoder's fingerprint covers its image_processor)
    STREAMS = (
        WanEncoders.STREAMS[0],
        CONDITION_LATENTS,
        Stream("image_embeds", "vae", "[(S/P)^2 + 1, D]", "CLIPVisionModel(first frame).hidden_states[-2]"),
        WanEncoders.STREAMS[1],
    )
    CLASS_IMPORTS = WanEncoders.CLASS_IMPORTS + (("transformers", "CLIPVisionModel"),
                                                 ("transformers", "CLIPImageProcessor"))

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        shapes = super().sample_shapes(config, bucket, max_sequence_length)
        clip = config("image_encoder")
        tokens = (int(clip.get("image_size", 224)) // int(clip.get("patch_size", 14))) ** 2 + 1
        return {**shapes, "condition_latents": shapes["latents"],
                "image_embeds": (tokens, int(clip.get("hidden_size", 1280)))}

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from transformers import CLIPImageProcessor, CLIPVisionModel

        self.image_encoder = self._load(CLIPVisionModel, "image_encoder")
        src = component_source(model, "image_processor")
        self.image_processor = CLIPImageProcessor.from_pretrained(src.path, **src.kwargs())

    @torch.no_grad()
    def encode_conditions(self, pixels_BCFHW: torch.Tensor) -> dict[str, torch.Tensor]:
        """``condition_latents`` [B, C, F', H/8, W/8] and ``image_embeds`` [B, S, D] of clips in [-1, 1], as
        ``WanImageToVideoPipeline.prepare_latents`` and ``encode_image`` compute them from the first frame."""
        first_BC1HW = pixels_BCFHW[:, :, :1]
        # the first frame as the 8-bit RGB image it was decoded from (the user's image at the clip's size)
        images = list(((first_BC1HW[:, :, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
                      .permute(0, 2, 3, 1).numpy())
        inputs = self.image_processor(images=images, return_tensors="pt").to(self.device)
        with self.lock:
            hidden = self.image_encoder(pixel_values=inputs.pixel_values.to(self.compute_dtype),
                                        output_hidden_states=True).hidden_states[-2]
        return {"condition_latents": condition_latents(self, pixels_BCFHW), "image_embeds": hidden.float().cpu()}
