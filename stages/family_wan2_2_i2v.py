"""Wan 2.2 I2V A14B (Wan2.2-I2V-A14B-Diffusers): Wan 2.1's latents and UMT5 text, plus the first frame's
``condition_latents`` as Wan 2.1 I2V caches them (:mod:`latentmill.stages.family_wan2_1_i2v`), and no image
embedding.

Its ``WanImageToVideoPipeline`` has no CLIP image encoder (``image_encoder`` and ``image_processor`` are null in
``model_index.json``) and its transformers no image cross-attention (``image_dim`` null): ``__call__`` encodes an
image embedding only when ``transformer.config.image_dim`` is set, so the image reaches the model through the
condition channels alone. The two experts (``boundary_ratio`` 0.9) share the VAE and UMT5, so one cache serves both.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.family_wan import WanEncoders
from latentmill.stages.family_wan2_1_i2v import CONDITION_LATENTS, condition_latents


class WanI2VA14BEncoders(WanEncoders):
    """AutoencoderKLWan + UMT5, as Wan 2.2 I2V A14B's WanImageToVideoPipeline uses them (no image encoder)."""

    name = "wan2.2-i2v"
    PIPELINES = ("WanImageToVideoPipeline",)
    # what tells it from Wan 2.1 I2V, the same pipeline class: no CLIP image encoder (saved as [null, null])
    PIPELINE_CONFIG = {"image_encoder": [None, None]}
    STREAMS = (WanEncoders.STREAMS[0], CONDITION_LATENTS, WanEncoders.STREAMS[1])

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        shapes = super().sample_shapes(config, bucket, max_sequence_length)
        return {**shapes, "condition_latents": shapes["latents"]}

    def encode_conditions(self, pixels_BCFHW: torch.Tensor) -> dict[str, torch.Tensor]:
        """``condition_latents`` of clips in [-1, 1] (``family_wan2_1_i2v.condition_latents``)."""
        return {"condition_latents": condition_latents(self, pixels_BCFHW)}
