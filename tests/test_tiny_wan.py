"""The tiny Wan-class model set (latentmill.tiny_wan): builds offline, loads like Wan2.1-T2V, is reproducible."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from latentmill.core.config import ConfigError
from latentmill.tiny_wan import (
    DEFAULT_RECIPE_PATH,
    build_tiny_wan,
    ensure_tiny_wan,
    load_recipe,
    main,
    measure_latent_stats,
)


def _hashes(folder: Path, pattern: str = "*.safetensors") -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob(pattern))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def wan_dir(tiny_wan: Path) -> Path:
    return tiny_wan  # the session's tiny Wan pipeline (tests/conftest.py), seed 0


@pytest.fixture(scope="module")
def pipe(wan_dir: Path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(wan_dir)


def test_folder_layout_and_size(wan_dir: Path) -> None:
    assert wan_dir.is_absolute()
    assert (wan_dir / "model_index.json").is_file()
    for sub in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer"):
        assert (wan_dir / sub).is_dir(), sub
    assert sorted(_hashes(wan_dir)) == [
        "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert not list(wan_dir.rglob("*.bin"))
    assert sum(p.stat().st_size for p in wan_dir.rglob("*") if p.is_file()) < 8 * 1024 * 1024
    assert [p.name for p in wan_dir.parent.iterdir()] == [wan_dir.name]  # the temporary build folder renamed


def test_loads_as_wan_pipeline_and_generates_a_video(pipe) -> None:
    from diffusers import WanPipeline

    torch.set_num_threads(1)
    assert type(pipe) is WanPipeline
    kwargs = dict(
        prompt="a red ball", height=32, width=48, num_frames=9, num_inference_steps=2, output_type="np"
    )
    frames = pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames
    assert frames.shape == (1, 9, 32, 48, 3)
    assert 0.0 <= frames.min() and frames.max() <= 1.0 and frames.std() > 0
    again = pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames
    assert (frames == again).all()


def test_components_match_the_wan21_structure(pipe) -> None:
    tr, vae, te = pipe.transformer.config, pipe.vae.config, pipe.text_encoder.config
    assert type(pipe.text_encoder).__name__ == "UMT5EncoderModel"
    assert type(pipe.tokenizer).__name__ == "T5Tokenizer"
    assert (tr.in_channels, tr.out_channels, vae.z_dim) == (16, 16, 16)
    assert tuple(tr.patch_size) == (1, 2, 2)
    assert tr.text_dim == te.d_model == 32
    assert tr.num_layers == 2
    assert tr.num_attention_heads * tr.attention_head_dim == 128 and tr.ffn_dim == 256
    assert len(vae.latents_mean) == len(vae.latents_std) == 16
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (8, 4)
    sched = pipe.scheduler.config
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    assert sched.prediction_type == "flow_prediction" and sched.use_flow_sigmas and sched.flow_shift == 3.0
    assert len(pipe.tokenizer) == te.vocab_size
    assert (pipe.tokenizer.pad_token_id, pipe.tokenizer.eos_token_id) == (0, 1)


def test_vae_compresses_8x_space_4x_time(pipe) -> None:
    torch.set_num_threads(1)
    with torch.no_grad():
        dist = pipe.vae.encode(torch.rand(1, 3, 9, 32, 48) * 2 - 1).latent_dist
        assert dist.mean.shape == (1, 16, 3, 4, 6)
        assert pipe.vae.decode(dist.mean).sample.shape == (1, 3, 9, 32, 48)


def test_latent_statistics_are_the_vaes_own(pipe) -> None:
    """The recipe's latents_mean/std are what this VAE (seed 0) produces, so normalised latents keep the image."""
    torch.set_num_threads(1)
    mean, std = measure_latent_stats(pipe.vae)
    assert pipe.vae.config.latents_mean == pytest.approx(mean, abs=2e-3)
    assert pipe.vae.config.latents_std == pytest.approx(std, rel=2e-2)
    # normalised, two solid colours lie far apart (with Wan2.1's statistics: 0.0004 in mean square)
    mu = torch.tensor(mean).view(1, -1, 1, 1, 1)
    sigma = torch.tensor(std).view(1, -1, 1, 1, 1)
    red_blue = torch.tensor([[0.73, -0.69, -0.69], [-0.69, -0.37, 0.73]]).view(2, 3, 1, 1, 1).expand(2, 3, 5, 32, 32)
    with torch.no_grad():
        z = (pipe.vae.encode(red_blue).latent_dist.mean - mu) / sigma
    assert ((z[0] - z[1]) ** 2).mean().item() > 0.1


def test_same_seed_same_bytes_other_seed_other_weights(wan_dir: Path, tmp_path: Path) -> None:
    same = build_tiny_wan(tmp_path / "same", seed=0)
    other = build_tiny_wan(tmp_path / "other", seed=1)
    reference = _hashes(wan_dir)
    assert _hashes(same) == reference
    assert _hashes(same, "*.json") == _hashes(wan_dir, "*.json")
    key = "transformer/diffusion_pytorch_model.safetensors"
    assert _hashes(other)[key] != reference[key]


@pytest.mark.slow  # builds a tiny Wan pipeline
def test_ensure_builds_once_and_refuses_foreign_folders(tmp_path: Path) -> None:
    out = ensure_tiny_wan(tmp_path / "models" / "wan")
    index = out / "model_index.json"
    before = index.stat().st_mtime_ns
    assert ensure_tiny_wan(out, seed=3) == out
    assert index.stat().st_mtime_ns == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_wan(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_recipe_is_checked_before_building(tmp_path: Path) -> None:
    recipe = load_recipe()
    assert recipe["components"]["transformer"]["text_dim"] == recipe["components"]["text_encoder"]["d_model"]
    text = DEFAULT_RECIPE_PATH.read_text(encoding="utf-8")
    for old, new, match in (
        ("text_dim: 32", "text_dim: 48", "text_dim"),
        ("scale_factor_temporal: 4", "scale_factor_temporal: 2", "scale_factor_temporal"),
        ("in_channels: 16", "in_channels: 8", "in_channels"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text.replace(old, new), encoding="utf-8")
        with pytest.raises(ConfigError, match=match):
            build_tiny_wan(tmp_path / "out", recipe=bad)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # builds a tiny Wan pipeline
def test_cli_builds_and_prints_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli"), "--if-missing"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(printed) == (tmp_path / "cli").absolute()
    assert (Path(printed) / "model_index.json").is_file()
