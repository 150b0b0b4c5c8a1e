"""The tiny Qwen-Image model set (data/tiny-qwen-image.yaml): reproducible byte for byte, the real structure,
a tokenizer whose template prefix is the 34 tokens QwenImagePipeline drops, the VAE's own latent statistics,
and a recipe checked before anything is built."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from latentmill.stages.family_qwen_image import PROMPT_TEMPLATE, TEMPLATE_START_IDX

from latentmill.tiny_qwen_image import (
    DEFAULT_RECIPE_PATH,
    build_tiny_qwen_image,
    ensure_tiny_qwen_image,
    load_recipe,
    measure_latent_stats,
)
from tests.helpers import assert_recipe_refused

pytestmark = pytest.mark.slow  # builds tiny Qwen-Image pipelines


def _hashes(folder: Path, pattern: str = "*.safetensors") -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob(pattern))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-qwen")
    return build_tiny_qwen_image(root / "a", seed=0), build_tiny_qwen_image(root / "b", seed=0), \
        build_tiny_qwen_image(root / "c", seed=1)


def test_same_seed_same_bytes_other_seed_other_weights(built):
    a, b, c = built
    assert len(_hashes(a)) == 3 and _hashes(a) == _hashes(b)
    assert _hashes(a, "*.json") == _hashes(b, "*.json")
    key = "transformer/diffusion_pytorch_model.safetensors"
    assert _hashes(c)[key] != _hashes(a)[key]


def test_structure_and_template_prefix(built):
    from diffusers import DiffusionPipeline, QwenImagePipeline

    pipe = DiffusionPipeline.from_pretrained(built[0])
    assert isinstance(pipe, QwenImagePipeline)
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(pipe.vae).__name__ == "AutoencoderKLQwenImage" and pipe.vae_scale_factor == 8
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.z_dim == 64
    assert pipe.prompt_template_encode == PROMPT_TEMPLATE and pipe.prompt_template_encode_start_idx == TEMPLATE_START_IDX
    tokens = pipe.tokenizer.convert_ids_to_tokens(pipe.tokenizer(PROMPT_TEMPLATE.format("a red square")).input_ids)
    # the real Qwen2.5-VL tokenizer's split: one token per word of the system prompt, ChatML specials
    assert tokens[:4] == ["<|im_start|>", "system", "Ċ", "Describe"] and tokens[33] == "Ċ"
    assert tokens[31:33] == ["<|im_start|>", "user"] and tokens[-5:] == ["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    assert len(pipe.tokenizer) == pipe.text_encoder.config.text_config.vocab_size == 1024
    image = pipe("a red ball", height=32, width=48, num_inference_steps=2, true_cfg_scale=1.0,
                 generator=torch.Generator().manual_seed(0), max_sequence_length=16).images[0]
    assert image.size == (48, 32)


def test_latent_statistics_are_the_vaes_own(built):
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage.from_pretrained(built[0], subfolder="vae")
    mean, std = measure_latent_stats(vae)
    assert [round(m, 4) for m in mean] == vae.config.latents_mean
    assert [round(s, 4) for s in std] == vae.config.latents_std


def test_ensure_builds_once(tmp_path):
    out = ensure_tiny_qwen_image(tmp_path / "q")
    before = (out / "model_index.json").stat().st_mtime_ns
    assert ensure_tiny_qwen_image(out, seed=3) == out and (out / "model_index.json").stat().st_mtime_ns == before


def test_recipe_is_checked_before_building(tmp_path):
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["components"]["transformer"].update(joint_attention_dim=48),
                          "joint_attention_dim: 48 != components.text_encoder.text_config.hidden_size")
    assert not list(tmp_path.glob("*/model_index.json"))
