"""FLUX.2 [dev] (``flux2``), and the VAE side both FLUX.2 families share: ``AutoencoderKLFlux2`` latents,
2x2-patchified and normalised by the VAE's batch-norm running statistics; one wide text embedding of three stacked
hidden layers of a decoder LLM, computed exactly as ``Flux2Pipeline`` / ``Flux2KleinPipeline.encode_prompt``.

The two families share :class:`Flux2VaeEncoders` (here) and differ in the text side (FLUX.2 [klein]:
:mod:`latentmill.stages.family_flux2_klein`):

- ``flux2``: ``Mistral3ForConditionalGeneration`` (Mistral Small 3) with its ``PixtralProcessor``; the prompt is a
  system turn (``SYSTEM_MESSAGE``) + a user turn through the processor's chat template, padded to
  ``max_sequence_length``; hidden layers (10, 20, 30).
- ``flux2-klein``: ``Qwen3ForCausalLM`` with its tokenizer; the prompt is one user turn through the chat template
  with ``add_generation_prompt=True, enable_thinking=False``, padded to ``max_sequence_length``; hidden layers
  (9, 18, 27).

Both run the text encoder with the attention mask, then hand the transformer every position, padding included
(the pipelines pass no mask to the transformer): the text stream's pad rule is ``keep``.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from latentmill.stages.encoders import Encoders, Stream

from latentmill.models import ModelConfig, tokenizer_source

LATENT_NORMALISATION = "(patchify_2x2(z) - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps)"


def patchify(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2], each 2x2 patch into channels (``Flux2Pipeline._patchify_latents``)."""
    B, C, H, W = latents_BCHW.shape
    x = latents_BCHW.reshape(B, C, H // 2, 2, W // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(B, C * 4, H // 2, W // 2)


def stack_layers(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """[B, L, len(layers) * D]: the chosen hidden layers side by side per token, as the pipelines stack them."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)  # [B, n, L, D]
    B, n, L, D = out.shape
    return out.permute(0, 2, 1, 3).reshape(B, L, n * D)


class Flux2VaeEncoders(Encoders):
    """What both FLUX.2 variants share: ``AutoencoderKLFlux2``, 2x2 patches, batch-norm statistics; the text
    encoder's class and how it is prompted are the subclass's."""

    COMPONENTS = ("vae", "text_encoder")
    STREAMS = (
        Stream("latents", "vae", "[4C, H/16, W/16]", LATENT_NORMALISATION),
        # the pipelines pad to max_sequence_length and the transformer sees every position (no mask)
        Stream("prompt_embeds", "text", "[L, 3D]", pad="keep"),
    )
    OUT_LAYERS: ClassVar[tuple[int, ...]]  # the hidden layers the pipeline stacks (text_encoder_out_layers)
    DEFAULT_TEXT_WIDTH: ClassVar[int]  # hidden size of the real text encoder (sample_shapes without its config)

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers import AutoencoderKLFlux2

        self.vae = self._load(AutoencoderKLFlux2, "vae")
        if device.type == "cuda":
            self.vae.enable_slicing()  # one image at a time through the encoder: the peak of one image
        bn = self.vae.bn
        self.bn_mean = bn.running_mean.detach().float().cpu().view(1, -1, 1, 1)
        self.bn_std = torch.sqrt(bn.running_var.detach().float().cpu().view(1, -1, 1, 1)
                                 + float(self.vae.config.batch_norm_eps))

    @classmethod
    def describe_vae(cls, vae_config: dict[str, Any]) -> dict[str, Any]:
        # the running statistics are weights (vae.bn), covered by the VAE's fingerprint
        return {"batch_norm_eps": float(vae_config.get("batch_norm_eps", 1e-4)),
                "patch_size": list(vae_config.get("patch_size", [2, 2]))}

    @classmethod
    def text_width(cls, config: dict[str, Any]) -> int:
        return int(config.get("hidden_size", cls.DEFAULT_TEXT_WIDTH))

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        vae = config("vae")
        channels = int(vae.get("latent_channels", 32)) * 4
        spatial = 2 ** (len(vae.get("block_out_channels", [1, 2, 3, 4])) - 1) * 2
        width = len(cls.OUT_LAYERS) * cls.text_width(config("text_encoder"))
        return {"latents": (channels, int(bucket[1]) // spatial, int(bucket[0]) // spatial),
                "prompt_embeds": (max_sequence_length, width)}

    @torch.no_grad()
    def encode_pixels(self, pixels_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the patchified, normalised latent distribution of images in [-1, 1]. The mean is what
        ``Flux2Pipeline._encode_vae_image`` gives (the posterior's mode, patchified, normalised)."""
        with self.lock:
            dist = self.vae.encode(pixels_BCHW.to(self.device, self.compute_dtype)).latent_dist
        mean = (patchify(dist.mean.float().cpu()) - self.bn_mean) / self.bn_std
        return mean, patchify(dist.std.float().cpu()) / self.bn_std

    def _encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
        with self.lock:
            output = self.text_encoder(input_ids=input_ids.to(self.device),
                                       attention_mask=attention_mask.to(self.device), output_hidden_states=True,
                                       use_cache=False)
        embeds = stack_layers(output.hidden_states, self.OUT_LAYERS)
        return {"prompt_embeds": embeds.float().cpu(), "lengths": attention_mask.sum(1).tolist()}


class Flux2Encoders(Flux2VaeEncoders):
    """FLUX.2 [dev]: ``Mistral3ForConditionalGeneration`` through its processor's chat template (system message +
    user turn), layers (10, 20, 30)."""

    name = "flux2"
    PIPELINES = ("Flux2Pipeline",)
    OUT_LAYERS = (10, 20, 30)
    DEFAULT_TEXT_WIDTH = 5120  # Mistral Small 3.x
    CLASS_IMPORTS = (("diffusers", "AutoencoderKLFlux2"), ("transformers", "Mistral3ForConditionalGeneration"),
                     ("transformers", "AutoProcessor"))

    @classmethod
    def text_width(cls, config: dict[str, Any]) -> int:
        return int((config.get("text_config") or {}).get("hidden_size", cls.DEFAULT_TEXT_WIDTH))

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from transformers import AutoProcessor, Mistral3ForConditionalGeneration

        self.text_encoder = self._load(Mistral3ForConditionalGeneration, "text_encoder")
        src = tokenizer_source(model, "text_encoder")
        self.tokenizer = AutoProcessor.from_pretrained(src.path, **src.kwargs())

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``prompt_embeds`` [B, L, 3D] as ``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` computes them."""
        from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

        inputs = self.tokenizer.apply_chat_template(
            format_input(prompts=list(captions), system_message=SYSTEM_MESSAGE), add_generation_prompt=False,
            tokenize=True, return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
            max_length=max_sequence_length)
        return self._encode(inputs["input_ids"], inputs["attention_mask"])
