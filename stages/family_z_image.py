"""Z-Image (``ZImagePipeline``: Z-Image-Turbo, Z-Image): ``AutoencoderKL`` latents normalised
``(z - shift) * scale`` (the FLUX.1 VAE); Qwen3 sequence embeddings of the real tokens only, computed exactly as
``ZImagePipeline._encode_prompt``: the caption in Qwen3's chat template (a user turn, the assistant prefix,
``enable_thinking=True``), tokenized to ``max_sequence_length`` with the attention mask, the text encoder's
second-to-last hidden state (``hidden_states[-2]``), then the masked-in tokens of each prompt.

The pipeline hands the transformer a list of per-prompt tensors of different lengths; the cache stores each
caption's real tokens (a ``mask`` stream: trimmed by ``cache.trim_text: auto``), the loader zero-pads them to
``text.pad_to`` with a ``prompt_embeds_mask`` column, and the trainer's adapter (``latentmill.trainer.zimage``)
turns the two back into that list.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Stream
from latentmill.stages.family_flux import KLVaeEncoders

from latentmill.models import ModelConfig


def chat_prompt(tokenizer: Any, caption: str) -> str:
    """``caption`` in the text encoder's chat template, as ``ZImagePipeline._encode_prompt`` writes it."""
    return tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)


class ZImageEncoders(KLVaeEncoders):
    """AutoencoderKL + Qwen3 (second-to-last hidden state, real tokens only), as ZImagePipeline uses them."""

    name = "z-image"
    PIPELINES = ("ZImagePipeline",)
    COMPONENTS = ("vae", "text_encoder")
    STREAMS = (
        Stream("latents", "vae", "[C, H/8, W/8]", "(z - shift_factor) * scaling_factor"),
        # the pipeline keeps each prompt's real tokens (a list of [n_i, D]); the transformer pads them itself
        Stream("prompt_embeds", "text", "[L, D]", pad="mask"),
    )
    CLASS_IMPORTS = (("diffusers", "AutoencoderKL"), ("transformers", "AutoModel"),
                     ("transformers", "AutoTokenizer"))

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from transformers import AutoModel

        self._load_vae()
        # Qwen3Model as the pipeline's model_index names it (AutoModel: the base model of any Qwen3 checkpoint)
        self.text_encoder = self._load(AutoModel, "text_encoder")
        self.tokenizer = self._tokenizer("text_encoder")

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        return {"latents": cls.latent_shape(config("vae"), bucket),
                "prompt_embeds": (max_sequence_length, int(config("text_encoder").get("hidden_size", 2560)))}

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """Qwen3 ``prompt_embeds`` [B, L, D]: row i holds caption i's real tokens first, zeros after them."""
        inputs = self.tokenizer([chat_prompt(self.tokenizer, c) for c in captions], padding="max_length",
                                max_length=max_sequence_length, truncation=True, return_tensors="pt")
        mask_BL = inputs.attention_mask.bool()
        with self.lock:
            hidden_BLD = self.text_encoder(input_ids=inputs.input_ids.to(self.device),
                                           attention_mask=mask_BL.to(self.device),
                                           output_hidden_states=True).hidden_states[-2]
        hidden_BLD = hidden_BLD.float().cpu()
        embeds = torch.zeros_like(hidden_BLD)
        lengths = mask_BL.sum(1).tolist()
        for i, n in enumerate(lengths):
            embeds[i, :n] = hidden_BLD[i][mask_BL[i]]  # the pipeline's prompt_embeds[i][prompt_masks[i]]
        return {"prompt_embeds": embeds, "lengths": lengths}
