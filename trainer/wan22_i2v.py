"""Adapter between cached Wan 2.2 I2V A14B streams and the two unmodified ``WanTransformer3DModel`` experts of
Wan2.2-I2V-A14B.

``WanImageToVideoPipeline`` (``boundary_ratio`` 0.9, no ``expand_timesteps``) calls each expert as Wan 2.1 I2V's
transformer (``latentmill.trainer.wan21_i2v``): the noisy latents, the 4-channel first-frame mask and the cached
``condition_latents`` stacked on channels (36), ``t = 1000 * sigma`` per sample, the UMT5 ``prompt_embeds``; but
with no image embedding (``encoder_hidden_states_image`` None: the experts' ``image_dim`` is null). The high-noise
``transformer`` serves sigma >= 0.9, the low-noise ``transformer_2`` below it (``WanAdapter.experts``, read from
``model_index.json``), trained one per run or both in one (``trainer.expert``, ``latentmill.trainer.experts``).
"""

from __future__ import annotations

from latentmill.trainer.wan21_i2v import WanI2VAdapter


class WanI2VA14BAdapter(WanI2VAdapter):
    """Wan2.2-I2V-A14B: two ``WanTransformer3DModel`` experts without image cross-attention,
    ``WanImageToVideoPipeline``."""

    family = "wan2.2-i2v"
    streams = ("latents", "condition_latents", "prompt_embeds")
