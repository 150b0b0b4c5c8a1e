"""Wan 2.1 (Wan-class video models): ``AutoencoderKLWan`` latents normalised ``(z - mean) / std`` per channel;
UMT5 sequence embeddings with the attention mask, as ``WanPipeline`` computes them."""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Encoders, Stream

from latentmill.models import ModelConfig


def encode_causal(vae, clip_1CFHW: torch.Tensor, device: torch.device):
    """``vae.encode(clip_1CFHW).latent_dist`` of an untiled ``AutoencoderKLWan``, moved and patchified chunk by chunk.

    Diffusers' ``_encode`` moves and patchifies (Wan 2.2: 2 x 2 pixels per channel) the whole clip before its
    causal chunks (frame 0, then 4 frames at a time), one more copy of the clip's pixels; patchify is per
    frame, so the same loop over chunks moved and patchified on their own gives the same latents bit for bit
    (tests/test_wan22_ti2v.py pins them against ``vae.encode``, so a Diffusers release that changes it fails).
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, patchify
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    feat_cache = [None] * sum(isinstance(m, WanCausalConv3d) for m in vae.encoder.modules())
    chunks = [(0, 1)] + [(1 + 4 * i, 5 + 4 * i) for i in range((clip_1CFHW.shape[2] - 1) // 4)]
    outs = []
    for start, stop in chunks:
        chunk = clip_1CFHW[:, :, start:stop].to(device, torch.float32)
        if vae.config.patch_size is not None:
            chunk = patchify(chunk, patch_size=vae.config.patch_size)
        outs.append(vae.encoder(chunk, feat_cache=feat_cache, feat_idx=[0]))
    return DiagonalGaussianDistribution(vae.quant_conv(torch.cat(outs, 2)))


class WanEncoders(Encoders):
    """AutoencoderKLWan + UMT5, as WanPipeline uses them (masked text encoder, zero padding)."""

    name = "wan"
    PIPELINES = ("WanPipeline",)
    COMPONENTS = ("vae", "text_encoder")
    STREAMS = (
        Stream("latents", "vae", "[C, 1 + (F - 1)/4, H/8, W/8]", "(z - latents_mean) / latents_std"),
        # WanPipeline keeps the real tokens and pads with zeros
        Stream("prompt_embeds", "text", "[L, D]", pad="zeros"),
    )
    CLASS_IMPORTS = (("diffusers", "AutoencoderKLWan"), ("transformers", "UMT5EncoderModel"),
                     ("transformers", "AutoTokenizer"))
    VAE_FLOAT32 = True  # its causal 3-D convs are sensitive to bf16
    FRAME_STEP = 4

    @classmethod
    def describe_vae(cls, vae_config: dict[str, Any]) -> dict[str, Any]:
        return {"latents_mean": list(vae_config["latents_mean"]), "latents_std": list(vae_config["latents_std"])}

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        vae = config("vae")
        channels = int(vae.get("z_dim", 16))
        spatial = 2 ** (len(vae.get("dim_mult", [1, 2, 4, 4])) - 1)
        temporal = 2 ** sum(bool(t) for t in vae.get("temperal_downsample", [False, True, True]))
        frames = (int(bucket[2]) - 1) // temporal + 1 if len(bucket) > 2 else 1
        return {"latents": (channels, frames, int(bucket[1]) // spatial, int(bucket[0]) // spatial),
                "prompt_embeds": (max_sequence_length, int(config("text_encoder").get("d_model", 4096)))}

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers import AutoencoderKLWan
        from transformers import UMT5EncoderModel

        # The Wan VAE runs in float32 even on GPU: its causal 3-D convs are sensitive to bf16. It encodes
        # 4 frames at a time with a feature cache, so a clip's activations do not grow with its length, but
        # they do grow with the batch: ``encode_pixels`` slices by sample.
        # Not tiled: tiles blended at their seams would give other latents than the whole-frame encode.
        self.vae = self._load(AutoencoderKLWan, "vae", self.compute_dtypes(device)["vae"])
        self.text_encoder = self._load(UMT5EncoderModel, "text_encoder")
        self.tokenizer = self._tokenizer("text_encoder")
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def encode_pixels(self, pixels_BCFHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the normalised latent distribution of clips in [-1, 1], encoded one clip at a time.

        Sliced by sample and by the VAE's causal chunks (:func:`encode_causal`): one clip at a time is in the
        encoder, and only its current chunk of frames is on the device (in float32), so the peak memory is
        that of 4 frames of activations, whatever ``cache.batch_size`` and the clip's length. A batch of 4
        81-frame 720p clips in float32 alone is 3.6 GB, and the activations and (on GPU) convolution workspaces
        of a batched encode grow with it. Diffusers' ``enable_slicing()`` also loops over samples, but only
        after the whole batch was moved to the device. Each clip's latents are those of ``vae.encode`` on it
        alone, bit for bit (no tiles, no seams).
        """
        means, stds = [], []
        for clip_1CFHW in pixels_BCFHW.split(1):
            with self.lock:  # per clip: another thread's batch may take turns
                dist = encode_causal(self.vae, clip_1CFHW, self.device)
            means.append(dist.mean.float().cpu())
            stds.append(dist.std.float().cpu())
            del dist  # this clip's device tensors go before the next clip is moved over
        mean = (torch.cat(means) - self.latents_mean) / self.latents_std
        return mean, torch.cat(stds) / self.latents_std

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """UMT5 ``prompt_embeds`` [B, L, D] (zero beyond each real length), as WanPipeline computes them."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(c) for c in captions], padding="max_length",
                                max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        with self.lock:
            hidden = self.text_encoder(inputs.input_ids.to(self.device),
                                       inputs.attention_mask.to(self.device)).last_hidden_state
        lengths = inputs.attention_mask.gt(0).sum(1).tolist()
        embeds = hidden.float().cpu()
        for i, n in enumerate(lengths):
            embeds[i, n:] = 0  # WanPipeline keeps the real tokens and pads with zeros
        return {"prompt_embeds": embeds, "lengths": lengths}
