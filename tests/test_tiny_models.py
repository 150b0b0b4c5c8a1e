"""The tiny Flux-class model set (latentmill.tiny): builds offline, loads like FLUX.1-dev, is reproducible."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from latentmill.core.config import ConfigError
from latentmill.tiny import DEFAULT_RECIPE_PATH, build_tiny_flux, ensure_tiny_flux, load_recipe, main

pytestmark = pytest.mark.slow  # builds the tiny pipelines: not the unit tier

CAPTIONS = [
    "a red square",
    "A Photo of an AXOLOTL swimming in Zurich's lake, 4k!!",
    "naïve café in Zürich — 🦎",
    "",
]


def _hashes(folder: Path, pattern: str = "*.safetensors") -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob(pattern))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_flux(tmp_path_factory.mktemp("tiny") / "flux", seed=0)


@pytest.fixture(scope="module")
def pipe(tiny_dir: Path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(tiny_dir)


def test_folder_layout_and_size(tiny_dir: Path) -> None:
    assert tiny_dir.is_absolute()
    assert (tiny_dir / "model_index.json").is_file()
    for sub in (
        "scheduler",
        "vae",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
        "transformer",
    ):
        assert (tiny_dir / sub).is_dir(), sub
    weights = _hashes(tiny_dir)
    assert sorted(weights) == [
        "text_encoder/model.safetensors",
        "text_encoder_2/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert not list(tiny_dir.rglob("*.bin"))
    total = sum(p.stat().st_size for p in tiny_dir.rglob("*") if p.is_file())
    assert total < 10 * 1024 * 1024  # 8.3 MB, 7.4 of them the transformer (width 128, 2 + 2 blocks)
    # the temporary build folder was renamed into place, nothing left beside it
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]


def test_diffusion_pipeline_loads_as_flux_and_generates(pipe) -> None:
    from diffusers import FluxPipeline

    assert type(pipe) is FluxPipeline
    kwargs = dict(
        prompt="a red square",
        height=64,
        width=48,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=64,
    )
    image = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    assert image.size == (48, 64)
    assert image.mode == "RGB"
    assert any(lo < hi for lo, hi in image.getextrema())  # not a flat image
    again = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    assert image.tobytes() == again.tobytes()


def test_flux_pipeline_from_pretrained_wires_the_components(tiny_dir: Path) -> None:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_dir)
    tr = pipe.transformer.config
    assert tr.in_channels == 4 * pipe.vae.config.latent_channels == 64
    assert tr.patch_size == 1
    assert (tr.num_layers, tr.num_single_layers) == (2, 2)
    # wider than the 64 packed input channels (at 2 x 16 = 32 the demo could not learn: tests/test_learns.py)
    assert tr.num_attention_heads * tr.attention_head_dim == 128 > tr.in_channels
    assert tr.guidance_embeds is True
    assert tr.joint_attention_dim == pipe.text_encoder_2.config.d_model == 32
    assert tr.pooled_projection_dim == pipe.text_encoder.config.hidden_size == 32
    assert sum(tr.axes_dims_rope) == tr.attention_head_dim
    assert pipe.vae_scale_factor == 8
    assert pipe.tokenizer_max_length == 77
    sched = pipe.scheduler.config
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert sched.shift == 3.0 and sched.use_dynamic_shifting is True
    assert (sched.base_shift, sched.max_shift) == (0.5, 1.15)
    assert (sched.base_image_seq_len, sched.max_image_seq_len) == (256, 4096)


def test_components_load_individually(tiny_dir: Path) -> None:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import (
        AutoTokenizer,
        CLIPTextModel,
        CLIPTokenizer,
        CLIPTokenizerFast,
        T5EncoderModel,
        T5TokenizerFast,
    )

    vae = AutoencoderKL.from_pretrained(tiny_dir, subfolder="vae")
    assert vae.config.latent_channels == 16 and len(vae.config.block_out_channels) == 4
    assert not vae.config.use_quant_conv and not vae.config.use_post_quant_conv
    assert FluxTransformer2DModel.from_pretrained(tiny_dir, subfolder="transformer").config.guidance_embeds
    clip = CLIPTextModel.from_pretrained(tiny_dir, subfolder="text_encoder")
    t5 = T5EncoderModel.from_pretrained(tiny_dir, subfolder="text_encoder_2")
    assert clip.config.max_position_embeddings == 77

    tok = AutoTokenizer.from_pretrained(tiny_dir, subfolder="tokenizer")
    tok_2 = AutoTokenizer.from_pretrained(tiny_dir, subfolder="tokenizer_2")
    assert isinstance(tok, CLIPTokenizer)
    assert isinstance(CLIPTokenizerFast.from_pretrained(tiny_dir, subfolder="tokenizer"), CLIPTokenizer)
    assert isinstance(T5TokenizerFast.from_pretrained(tiny_dir, subfolder="tokenizer_2"), T5TokenizerFast)
    assert len(tok) == tok.vocab_size == clip.config.vocab_size
    assert len(tok_2) == tok_2.vocab_size == t5.config.vocab_size

    # the encoders accept what the tokenizers produce
    with torch.no_grad():
        ids = tok(
            CAPTIONS, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
        ).input_ids
        assert clip(ids).pooler_output.shape == (len(CAPTIONS), 32)
        ids_2 = tok_2(
            CAPTIONS, padding="max_length", max_length=64, truncation=True, return_tensors="pt"
        ).input_ids
        assert t5(ids_2).last_hidden_state.shape == (len(CAPTIONS), 64, 32)


def test_vae_encodes_to_16_channels_at_one_eighth(tiny_dir: Path) -> None:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_dir, subfolder="vae")
    assert vae.config.scaling_factor == pytest.approx(0.3611)
    assert vae.config.shift_factor == pytest.approx(0.1159)
    with torch.no_grad():
        dist = vae.encode(torch.rand(1, 3, 64, 48) * 2 - 1).latent_dist
        assert dist.mean.shape == (1, 16, 8, 6)
        assert vae.decode(dist.mean).sample.shape == (1, 3, 64, 48)


def test_clip_tokenizer(pipe) -> None:
    tok = pipe.tokenizer
    assert type(tok).__name__ == "CLIPTokenizer"
    assert tok.model_max_length == 77
    vocab = pipe.text_encoder.config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (vocab - 2, vocab - 1, vocab - 1)
    assert (pipe.text_encoder.config.bos_token_id, pipe.text_encoder.config.eos_token_id) == (
        vocab - 2,
        vocab - 1,
    )

    ids = tok("a red square", padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77
    assert ids[0] == tok.bos_token_id
    content = [i for i in ids[1:] if i != tok.eos_token_id]
    assert 3 <= len(content) <= len("a red square")
    assert tok.decode(content) == "a red square"
    assert ids[1 + len(content)] == tok.eos_token_id
    assert ids[1 + len(content) :] == [tok.pad_token_id] * (76 - len(content))
    assert max(ids) < vocab

    # byte-level BPE: any text survives a round trip, up to CLIP's lowercasing and spacing between pre-tokens
    for text in CAPTIONS:
        enc = tok(text).input_ids
        assert enc[0] == tok.bos_token_id and enc[-1] == tok.eos_token_id
        assert tok.decode(enc, skip_special_tokens=True).replace(" ", "") == text.lower().replace(" ", "")
    long = tok("word " * 200, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(long) == 77 and long[0] == tok.bos_token_id and long[-1] == tok.eos_token_id


def test_t5_tokenizer(pipe) -> None:
    tok = pipe.tokenizer_2
    assert type(tok).__name__ == "T5Tokenizer"
    assert tok.model_max_length == 512
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) == pipe.text_encoder_2.config.vocab_size
    for text in CAPTIONS:
        ids = tok(text).input_ids
        assert ids[-1] == tok.eos_token_id
        assert tok.eos_token_id not in ids[:-1]
    ids = tok("a red square", padding="max_length", max_length=16, truncation=True).input_ids
    n = ids.index(tok.eos_token_id)
    assert n >= 1 and tok.unk_token_id not in ids[:n]
    assert ids[n + 1 :] == [tok.pad_token_id] * (15 - n)
    assert tok.decode(ids, skip_special_tokens=True) == "a red square"
    # characters outside the vocabulary become <unk>, never an error
    assert tok.unk_token_id in tok("🦎").input_ids


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    same = build_tiny_flux(tmp_path / "same", seed=0)
    other = build_tiny_flux(tmp_path / "other", seed=1)
    reference = _hashes(tiny_dir)
    assert _hashes(same) == reference
    # the tokenizers and configs do not depend on the seed either
    assert _hashes(same, "*.json") == _hashes(tiny_dir, "*.json")
    changed = _hashes(other)
    key = "transformer/diffusion_pytorch_model.safetensors"
    assert changed[key] != reference[key]
    assert _hashes(other, "*.json") == _hashes(tiny_dir, "*.json")


def test_ensure_builds_once(tmp_path: Path) -> None:
    out = ensure_tiny_flux(tmp_path / "models" / "flux")
    index = out / "model_index.json"
    assert index.is_file()
    before = index.stat().st_mtime_ns
    assert ensure_tiny_flux(tmp_path / "models" / "flux", seed=7) == out
    assert index.stat().st_mtime_ns == before
    # build_tiny_flux replaces a finished build
    assert build_tiny_flux(out, seed=1) == out
    assert index.is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["flux"]


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_flux(out)
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_recipe_is_checked_before_building(tmp_path: Path) -> None:
    recipe = load_recipe()
    assert (
        recipe["components"]["transformer"]["joint_attention_dim"]
        == recipe["components"]["text_encoder_2"]["d_model"]
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        DEFAULT_RECIPE_PATH.read_text(encoding="utf-8").replace(
            "joint_attention_dim: 32", "joint_attention_dim: 48"
        ),
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match="joint_attention_dim"):
        build_tiny_flux(tmp_path / "out", recipe=bad)
    assert not (tmp_path / "out").exists()


def test_cli_builds_and_prints_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(printed) == (tmp_path / "cli").absolute()
    assert (Path(printed) / "model_index.json").is_file()


def test_failed_build_leaves_nothing_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import FluxPipeline

    real_save = FluxPipeline.save_pretrained

    def save_then_die(self, save_directory, **kwargs):
        real_save(self, save_directory, **kwargs)  # model_index.json is written, then the build "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(FluxPipeline, "save_pretrained", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        ensure_tiny_flux(tmp_path / "flux")
    assert list(tmp_path.iterdir()) == []
