"""FLUX.1 (Flux-class image models): ``AutoencoderKL`` latents normalised ``(z - shift) * scale``; CLIP pooled
embedding + T5 sequence embeddings, computed exactly as ``FluxPipeline.encode_prompt``."""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Encoders, Stream

from latentmill.models import ModelConfig


class KLVaeEncoders(Encoders):
    """The VAE side of the families whose pipelines take ``AutoencoderKL`` latents normalised
    ``(z - shift_factor) * scaling_factor`` (FLUX.1, Z-Image); a subclass adds its text side."""

    def _load_vae(self) -> None:
        from diffusers import AutoencoderKL

        self.vae = self._load(AutoencoderKL, "vae")
        if self.device.type == "cuda":
            # encode() then runs one image at a time: peak memory of one 1024² image, not of a batch of 16
            self.vae.enable_slicing()
        self.scaling_factor = float(self.vae.config.scaling_factor)
        self.shift_factor = float(self.vae.config.shift_factor or 0.0)

    @classmethod
    def describe_vae(cls, vae_config: dict[str, Any]) -> dict[str, Any]:
        return {"scaling_factor": float(vae_config.get("scaling_factor", 1.0)),
                "shift_factor": float(vae_config.get("shift_factor") or 0.0)}

    @staticmethod
    def latent_shape(vae_config: dict[str, Any], bucket: list[int]) -> tuple[int, int, int]:
        """[C, H/8, W/8] of one image of ``bucket`` (the real VAE's defaults when its config is not here)."""
        channels = int(vae_config.get("latent_channels", 16))
        spatial = 2 ** (len(vae_config.get("block_out_channels", [1, 2, 3, 4])) - 1)
        return channels, int(bucket[1]) // spatial, int(bucket[0]) // spatial

    @torch.no_grad()
    def encode_pixels(self, pixels_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the normalised latent distribution of images in [-1, 1]."""
        with self.lock:
            dist = self.vae.encode(pixels_BCHW.to(self.device, self.compute_dtype)).latent_dist
        mean = (dist.mean.float() - self.shift_factor) * self.scaling_factor
        return mean.cpu(), (dist.std.float() * self.scaling_factor).cpu()


class FluxEncoders(KLVaeEncoders):
    """AutoencoderKL + CLIP (pooled) + T5 (sequence), as FluxPipeline uses them."""

    name = "flux"
    PIPELINES = ("FluxPipeline",)
    COMPONENTS = ("vae", "text_encoder", "text_encoder_2")
    STREAMS = (
        Stream("latents", "vae", "[C, H/8, W/8]", "(z - shift_factor) * scaling_factor"),
        # FluxPipeline runs T5 without an attention mask: the transformer sees every padded position
        Stream("prompt_embeds", "text", "[L, D]", pad="keep"),
        Stream("pooled_prompt_embeds", "text", "[D]"),
    )
    CLASS_IMPORTS = (("diffusers", "AutoencoderKL"), ("transformers", "CLIPTextModel"),
                     ("transformers", "T5EncoderModel"), ("transformers", "AutoTokenizer"))

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from transformers import CLIPTextModel, T5EncoderModel

        self._load_vae()
        self.text_encoder = self._load(CLIPTextModel, "text_encoder")
        self.text_encoder_2 = self._load(T5EncoderModel, "text_encoder_2")
        self.tokenizer = self._tokenizer("text_encoder")
        self.tokenizer_2 = self._tokenizer("text_encoder_2")

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        return {"latents": cls.latent_shape(config("vae"), bucket),
                "prompt_embeds": (max_sequence_length, int(config("text_encoder_2").get("d_model", 4096))),
                "pooled_prompt_embeds": (int(config("text_encoder").get("hidden_size", 768)),)}

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """T5 ``prompt_embeds`` [B, L, D] with real lengths, CLIP ``pooled_prompt_embeds`` [B, D]."""
        clip_ids = self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        t5 = self.tokenizer_2(captions, padding="max_length", max_length=max_sequence_length,
                              truncation=True, return_tensors="pt")
        with self.lock:
            pooled_BD = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
            # FluxPipeline runs T5 without an attention mask: every position sees the padding.
            embeds_BLD = self.text_encoder_2(t5.input_ids.to(self.device), output_hidden_states=False)[0]
        return {"prompt_embeds": embeds_BLD.float().cpu(), "lengths": t5.attention_mask.sum(1).tolist(),
                "pooled_prompt_embeds": pooled_BD.float().cpu()}
