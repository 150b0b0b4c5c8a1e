"""HunyuanVideo 1.5 image-to-video (HunyuanVideo-1.5-480p_i2v / 720p_i2v): HunyuanVideo 1.5's latents and two
text streams (:mod:`latentmill.stages.family_hunyuanvideo1_5`), plus the first frame's conditioning as
``HunyuanVideo15ImageToVideoPipeline`` computes it from the conditioning image (diffusers 0.42):

* ``image_latents``: the first frame alone through the VAE (``_get_image_latents``: its mode, ``argmax``, times
  ``scaling_factor``), one latent frame; the pipeline repeats it over the clip's latent frames and zeroes all but
  the first (``prepare_cond_latents_and_mask``), which the adapter does at train time with the fixed mask;
* ``image_embeds``: the first frame's SigLIP ``last_hidden_state`` (``_get_image_embeds``: the
  ``feature_extractor`` resizes it to the encoder's size), 729 tokens of 1152 for the published model.

Both are computed by the pipeline's own static methods, one clip at a time as the pipeline encodes its one image,
from the first frame as the 8-bit RGB image it was decoded from (the user's image at the clip's bucket size). They
depend on the pixels alone, so they live in the VAE member, keyed by the VAE and the image encoder (with its
``feature_extractor``) (``PIXEL_COMPONENTS``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Stream
from latentmill.stages.family_hunyuanvideo1_5 import HunyuanVideo15Encoders

from latentmill.models import ModelConfig, tokenizer_source


def first_frame_images(pixels_BCFHW: torch.Tensor) -> list:
    """Each clip's first frame as the PIL RGB image it was decoded from (pixels in [-1, 1] on the 8-bit grid)."""
    from PIL import Image

    frames_BHWC = ((pixels_BCFHW[:, :, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return [Image.fromarray(frame.numpy()) for frame in frames_BHWC]


class HunyuanVideo15I2VEncoders(HunyuanVideo15Encoders):
    """HunyuanVideo 1.5's encoders plus the SigLIP image encoder, as HunyuanVideo15ImageToVideoPipeline uses them."""

    name = "hunyuanvideo1.5-i2v"
    PIPELINES = ("HunyuanVideo15ImageToVideoPipeline",)
    COMPONENTS = HunyuanVideo15Encoders.COMPONENTS + ("image_encoder",)
    PIXEL_COMPONENTS = ("vae", "image_encoder")  # (the image encoder's fingerprint covers its feature_extractor)
    STREAMS = (
        HunyuanVideo15Encoders.STREAMS[0],
        Stream("image_latents", "vae", "[C, 1, H/16, W/16]", "mode(first frame alone) * scaling_factor"),
        Stream("image_embeds", "vae", "[(S/P)^2, D]", "SiglipVisionModel(first frame).last_hidden_state"),
        *HunyuanVideo15Encoders.STREAMS[1:],
    )
    CLASS_IMPORTS = HunyuanVideo15Encoders.CLASS_IMPORTS + (("transformers", "SiglipVisionModel"),
                                                            ("transformers", "SiglipImageProcessor"))

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        shapes = super().sample_shapes(config, bucket, max_sequence_length)
        siglip = config("image_encoder")
        tokens = (int(siglip.get("image_size", 384)) // int(siglip.get("patch_size", 14))) ** 2
        return {**shapes, "image_latents": (shapes["latents"][0], 1, *shapes["latents"][2:]),
                "image_embeds": (tokens, int(siglip.get("hidden_size", 1152)))}

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
        from transformers import SiglipImageProcessor, SiglipVisionModel

        self.image_encoder = self._load(SiglipVisionModel, "image_encoder")
        src = tokenizer_source(model, "image_encoder")  # the pipeline's feature_extractor/
        self.feature_extractor = SiglipImageProcessor.from_pretrained(src.path, **src.kwargs())
        # the pipeline's video_processor: the image is already at its size, only converted to [-1, 1]
        self.video_processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16, do_resize=False, do_convert_rgb=True)

    @torch.no_grad()
    def encode_conditions(self, pixels_BCFHW: torch.Tensor) -> dict[str, torch.Tensor]:
        """``image_latents`` [B, C, 1, H/16, W/16] and ``image_embeds`` [B, S, D] of clips in [-1, 1], through
        ``HunyuanVideo15ImageToVideoPipeline._get_image_latents`` and ``_get_image_embeds`` of each first frame."""
        from diffusers import HunyuanVideo15ImageToVideoPipeline as Pipe

        height, width = pixels_BCFHW.shape[-2:]
        latents, embeds = [], []
        for image in first_frame_images(pixels_BCFHW):
            with self.lock:
                latents.append(Pipe._get_image_latents(self.vae, self.video_processor, image, height, width,
                                                       self.device).float().cpu())
                embeds.append(Pipe._get_image_embeds(self.image_encoder, self.feature_extractor, image,
                                                     self.device).float().cpu())
        return {"image_latents": torch.cat(latents), "image_embeds": torch.cat(embeds)}
