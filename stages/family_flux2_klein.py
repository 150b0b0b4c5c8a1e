"""FLUX.2 [klein] 4B / 9B (``flux2-klein``): the FLUX.2 VAE side (:class:`~latentmill.stages.family_flux2.Flux2VaeEncoders`)
with a ``Qwen3ForCausalLM`` text encoder, computed exactly as ``Flux2KleinPipeline.encode_prompt``: one user turn
through the tokenizer's chat template (``add_generation_prompt=True, enable_thinking=False``), padded to
``max_sequence_length``, hidden layers (9, 18, 27) side by side; the transformer sees every position (pad ``keep``)."""

from __future__ import annotations

from typing import Any

import torch
from latentmill.stages.family_flux2 import Flux2VaeEncoders

from latentmill.models import ModelConfig


class Flux2KleinEncoders(Flux2VaeEncoders):
    """FLUX.2 [klein]: ``Qwen3ForCausalLM``, one user turn through the chat template, layers (9, 18, 27)."""

    name = "flux2-klein"
    PIPELINES = ("Flux2KleinPipeline",)
    OUT_LAYERS = (9, 18, 27)
    DEFAULT_TEXT_WIDTH = 2560  # Qwen3-4B (klein 4B); Qwen3-8B (klein 9B): 4096
    CLASS_IMPORTS = (("diffusers", "AutoencoderKLFlux2"), ("transformers", "Qwen3ForCausalLM"),
                     ("transformers", "AutoTokenizer"))

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from transformers import Qwen3ForCausalLM

        self.text_encoder = self._load(Qwen3ForCausalLM, "text_encoder")
        self.tokenizer = self._tokenizer("text_encoder")

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``prompt_embeds`` [B, L, 3D] as ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` computes them."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=False)
                 for c in captions]
        inputs = self.tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                                max_length=max_sequence_length)
        return self._encode(inputs["input_ids"], inputs["attention_mask"])
