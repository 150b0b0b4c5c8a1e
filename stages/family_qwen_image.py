"""Qwen-Image (``QwenImagePipeline``): ``AutoencoderKLQwenImage`` latents of one-frame images normalised
``(z - latents_mean) / latents_std`` per channel; Qwen2.5-VL last-layer hidden states of the pipeline's chat
template with its fixed prefix dropped, the real tokens only (a ``mask`` stream), as
``QwenImagePipeline.encode_prompt`` computes them (diffusers 0.42).

``QwenImageEncoders`` is subclassed by the Qwen-Image-Edit family (``stages/family_qwen_image_edit.py``): the
template, the number of its leading tokens to drop, the cap on the kept tokens and the text-encoder call are
class attributes / methods (``PROMPT_TEMPLATE``, ``TEMPLATE_START_IDX``, ``TOKENIZER_MAX_LENGTH``,
:meth:`_hidden_states`), and the one-frame VAE path (:meth:`encode_latents`) encodes its reference images too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Encoders, Stream

from latentmill.models import ModelConfig

# QwenImagePipeline.prompt_template_encode / prompt_template_encode_start_idx / tokenizer_max_length
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_START_IDX = 34
TOKENIZER_MAX_LENGTH = 1024


class QwenImageEncoders(Encoders):
    """AutoencoderKLQwenImage + Qwen2.5-VL (chat template, last hidden layer, masked), as QwenImagePipeline."""

    name = "qwen-image"
    PIPELINES = ("QwenImagePipeline",)
    COMPONENTS = ("vae", "text_encoder")
    STREAMS = (
        # one-frame images: the VAE's frame axis (1) is dropped; the pipeline packs [B, 1, C, H, W] the same way
        Stream("latents", "vae", "[C, H/8, W/8]", "(z - latents_mean) / latents_std"),
        # the real tokens after the template prefix; the transformer takes encoder_hidden_states_mask
        Stream("prompt_embeds", "text", "[L, D]", pad="mask"),
    )
    CLASS_IMPORTS = (("diffusers", "AutoencoderKLQwenImage"),
                     ("transformers", "Qwen2_5_VLForConditionalGeneration"), ("transformers", "AutoTokenizer"))
    VAE_FLOAT32 = True  # the Wan-style causal 3-D convs, as for Wan
    PROMPT_TEMPLATE = PROMPT_TEMPLATE
    TEMPLATE_START_IDX = TEMPLATE_START_IDX
    TOKENIZER_MAX_LENGTH: int | None = TOKENIZER_MAX_LENGTH  # the pipeline's cap on the kept tokens (None: none)

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen2_5_VLForConditionalGeneration

        self.vae = self._load(AutoencoderKLQwenImage, "vae", self.compute_dtypes(device)["vae"])
        if device.type == "cuda":
            self.vae.enable_slicing()  # one image at a time through the encoder: the peak of one image
        self.text_encoder = self._load(Qwen2_5_VLForConditionalGeneration, "text_encoder")
        self.tokenizer = self._tokenizer("text_encoder")
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1)

    @classmethod
    def describe_vae(cls, vae_config: dict[str, Any]) -> dict[str, Any]:
        return {"latents_mean": list(vae_config["latents_mean"]), "latents_std": list(vae_config["latents_std"])}

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        vae = config("vae")
        channels = int(vae.get("z_dim", 16))
        spatial = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
        text = config("text_encoder")
        width = int((text.get("text_config") or {}).get("hidden_size") or text.get("hidden_size") or 3584)
        return {"latents": (channels, int(bucket[1]) // spatial, int(bucket[0]) // spatial),
                "prompt_embeds": (min(max_sequence_length, cls.TOKENIZER_MAX_LENGTH or max_sequence_length), width)}

    @torch.no_grad()
    def encode_latents(self, pixels_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) [B, C, H/8, W/8] of the normalised latent distribution of images in [-1, 1], encoded
        as one-frame clips [B, 3, 1, H, W] in one VAE call, as the pipelines' ``_encode_vae_image`` does
        (``(z - latents_mean) / latents_std``); on a GPU the VAE's slicing takes one image at a time."""
        clips = pixels_BCHW[:, :, None].to(self.device, self.compute_dtypes(self.device)["vae"])
        with self.lock:
            dist = self.vae.encode(clips).latent_dist
        mean = (dist.mean[:, :, 0].float().cpu() - self.latents_mean) / self.latents_std
        return mean, dist.std[:, :, 0].float().cpu() / self.latents_std

    def encode_pixels(self, pixels_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode_latents(pixels_BCHW)

    def _hidden_states(self, captions: list[str], max_tokens: int,
                       images: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The text encoder's last hidden layer [B, T, D] over the templated captions and their attention
        mask [B, T]: ``QwenImagePipeline._get_qwen_prompt_embeds``'s call. Tokens past ``max_tokens`` are cut
        before the encoder: the model is causal, so the kept tokens' states do not depend on them.
        ``images``: unused here; an Edit family's override feeds them to the processor with its template."""
        inputs = self.tokenizer([self.PROMPT_TEMPLATE.format(c) for c in captions], max_length=max_tokens,
                                padding=True, truncation=True, return_tensors="pt")
        with self.lock:
            out = self.text_encoder(input_ids=inputs.input_ids.to(self.device),
                                    attention_mask=inputs.attention_mask.to(self.device), output_hidden_states=True)
        return out.hidden_states[-1], inputs.attention_mask

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int, images: list | None = None) -> dict[str, Any]:
        """``prompt_embeds`` [B, max_sequence_length, D]: each caption's real tokens after the template's
        first ``TEMPLATE_START_IDX`` tokens, at most ``max_sequence_length`` of them, zero beyond; ``lengths``.

        The pipeline tokenizes at most ``tokenizer_max_length + drop`` tokens, keeps the attended ones, drops
        the prefix and cuts to ``max_sequence_length`` (``encode_prompt``): the same tokens as here.
        ``images`` is for a family whose text encoder sees the edit's source image (``TEXT_SEES_REFERENCE``:
        Qwen-Image-Edit); Qwen-Image's does not.
        """
        limit = min(max_sequence_length, self.TOKENIZER_MAX_LENGTH or max_sequence_length)
        hidden_BTD, mask_BT = self._hidden_states(captions, limit + self.TEMPLATE_START_IDX, images)
        hidden_BTD = hidden_BTD.float().cpu()
        embeds = hidden_BTD.new_zeros(len(captions), max_sequence_length, hidden_BTD.shape[-1])
        lengths = []
        for i, row in enumerate(hidden_BTD[:, :, :]):
            real = row[mask_BT[i].bool()][self.TEMPLATE_START_IDX:][:limit]
            embeds[i, : len(real)] = real
            lengths.append(len(real))
        return {"prompt_embeds": embeds, "lengths": lengths}
