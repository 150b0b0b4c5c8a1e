"""The tiny Z-Image model set (data/tiny-z-image.yaml): the real Z-Image structure, built offline, reproducibly."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from latentmill.core.config import ConfigError
from latentmill.tiny_zimage import DEFAULT_RECIPE_PATH, build_tiny_zimage, load_recipe, main
from latentmill.tinyio import TINY_BUILDERS, ensure_tiny


def _hashes(folder: Path, pattern: str = "*.safetensors") -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob(pattern))}


@pytest.fixture(scope="module")
def pipe(tiny_zimage):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(tiny_zimage)


def test_loads_as_zimage_pipeline_with_the_real_structure(pipe):
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen2Tokenizer, Qwen3Model

    assert isinstance(pipe, ZImagePipeline)
    assert isinstance(pipe.transformer, ZImageTransformer2DModel) and isinstance(pipe.vae, AutoencoderKL)
    assert isinstance(pipe.text_encoder, Qwen3Model) and isinstance(pipe.tokenizer, Qwen2Tokenizer)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert (pipe.scheduler.config.shift, pipe.scheduler.config.use_dynamic_shifting) == (3.0, False)
    assert pipe.transformer.config.cap_feat_dim == pipe.text_encoder.config.hidden_size == 32
    assert pipe.transformer.config.in_channels == pipe.vae.config.latent_channels == 16
    assert pipe.text_encoder.config.num_hidden_layers == 3  # hidden_states[-2] is not the last layer's
    assert sum(p.numel() for p in pipe.transformer.parameters()) < 2_000_000
    image = pipe("a red square", height=64, width=48, num_inference_steps=2, guidance_scale=0.0,
                 max_sequence_length=32, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (48, 64)


def test_tokenizer_and_chat_template(pipe):
    tok = pipe.tokenizer
    assert len(tok) == 768 and (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [765, 766, 767]
    text = tok.apply_chat_template([{"role": "user", "content": "a red square"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=True)
    assert text == "<|im_start|>user\na red square<|im_end|>\n<|im_start|>assistant\n"
    off = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # as Qwen3's template
    ids = tok(text).input_ids
    assert ids[0] == 766 and ids.count(767) == 1 and tok.decode(ids) == text  # byte-level: round trip
    assert tok.decode(tok("ünïcödé ✓").input_ids) == "ünïcödé ✓"  # any text encodes
    assert len(tok("a photo of a cat sitting on a wooden table").input_ids) < 20  # learned merges


def test_same_seed_same_bytes_other_seed_other_weights(tiny_zimage, tmp_path):
    same = build_tiny_zimage(tmp_path / "same", seed=0)
    other = build_tiny_zimage(tmp_path / "other", seed=1)
    assert _hashes(same) == _hashes(tiny_zimage)
    assert _hashes(same, "*.json") == _hashes(tiny_zimage, "*.json")
    key = "transformer/diffusion_pytorch_model.safetensors"
    assert _hashes(other)[key] != _hashes(tiny_zimage)[key]


@pytest.mark.slow  # builds a tiny Z-Image pipeline
def test_registered_builder_and_cli(tmp_path, capsys):
    assert TINY_BUILDERS["z-image"] == "latentmill.tiny_zimage:ensure_tiny_zimage"
    out = ensure_tiny("z-image", tmp_path / "models" / "tiny-z-image", DEFAULT_RECIPE_PATH)
    before = (out / "model_index.json").stat().st_mtime_ns
    assert main([str(out), "--if-missing"]) == 0
    assert Path(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert (out / "model_index.json").stat().st_mtime_ns == before  # kept, not rebuilt


def test_recipe_is_checked_before_building(tmp_path):
    recipe = load_recipe()
    assert recipe["components"]["transformer"]["cap_feat_dim"] == recipe["components"]["text_encoder"]["hidden_size"]
    text = DEFAULT_RECIPE_PATH.read_text(encoding="utf-8")
    for old, new, match in (
        ("cap_feat_dim: 32", "cap_feat_dim: 48", "cap_feat_dim"),
        ("in_channels: 16                  # = vae", "in_channels: 8 #", "in_channels"),
        ("axes_dims: [8, 12, 12]", "axes_dims: [8, 12, 10]", "axes_dims"),
        ("num_hidden_layers: 3", "num_hidden_layers: 1", "hidden_states"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text.replace(old, new), encoding="utf-8")
        with pytest.raises(ConfigError, match=match):
            build_tiny_zimage(tmp_path / "out", recipe=bad)
    assert not (tmp_path / "out").exists()
