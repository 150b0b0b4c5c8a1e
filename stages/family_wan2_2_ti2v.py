"""Wan 2.2 TI2V-5B: the 48-channel Wan 2.2 ``AutoencoderKLWan`` (16x spatial: a 2 x 2 patchify before an 8x
encoder) and UMT5 text, cached exactly as for Wan 2.1 (:mod:`latentmill.stages.family_wan`).

Image-to-video needs no stream of its own. ``WanImageToVideoPipeline`` (``expand_timesteps``) encodes the
conditioning image alone as a 1-frame clip and puts its normalised mean at latent frame 0; the causal VAE encodes
a clip's first frame alone too (its first chunk is that one frame), so the clip's own first latent frame is that
image latent: equal up to float rounding (measured 9e-8 on the tiny VAE, from the final 1x1x1 conv running over
a longer clip), checked by tests/test_wan22_ti2v.py. The trainer takes it from the cached ``latents``.
"""

from __future__ import annotations

from typing import Any, Callable

from latentmill.stages.encoders import Stream
from latentmill.stages.family_wan import WanEncoders


class WanTI2VEncoders(WanEncoders):
    """The Wan 2.2 VAE (48 channels, 16x spatial) + UMT5, as WanPipeline / WanImageToVideoPipeline use them."""

    name = "wan2.2-ti2v"
    # Wan2.2-TI2V-5B-Diffusers is a WanPipeline (as Wan 2.1) with expand_timesteps; its I2V class the same
    PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
    PIPELINE_CONFIG = {"expand_timesteps": True}
    PIXEL_MULTIPLE = 32  # 16x VAE x 2 x 2 patches
    STREAMS = (
        Stream("latents", "vae", "[C, 1 + (F - 1)/4, H/16, W/16]", "(z - latents_mean) / latents_std"),
        Stream("prompt_embeds", "text", "[L, D]", pad="zeros"),
    )

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        vae = config("vae")
        shapes = super().sample_shapes(config, bucket, max_sequence_length)
        spatial = int(vae.get("scale_factor_spatial", 16))
        channels = int(vae.get("z_dim", 48))
        shapes["latents"] = (channels, shapes["latents"][1], int(bucket[1]) // spatial, int(bucket[0]) // spatial)
        return shapes
