"""The Wan adapter: calls the transformer like WanPipeline, trains on cached video latents, exports for WanPipeline."""

import statistics

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanTransformer3DModel
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import ADAPTERS, get_adapter
from latentmill.trainer.objective import interpolate, velocity_target
from latentmill.trainer.wan import WanAdapter, check_video_batch_fits, wan_forward

from tests.trainer_helpers import (
    TINY_WAN_TRANSFORMER,
    add_validation_prompts,
    build_tiny_wan_transformer,
    read_metrics,
    torch_threads,
    write_fake_cache,
)


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(transformer-only pretrained folder, cache): 8 smooth video latents in two buckets, trimmed text."""
    root = tmp_path_factory.mktemp("wan")
    pretrained = build_tiny_wan_transformer(root / "pretrained")
    cache = root / "cache"
    buckets = {(32, 32, 9): 4, (48, 32, 5): 4}
    write_fake_cache(cache, buckets, family="wan", smooth=True, trimmed=True, seq_len=8)
    return str(pretrained), cache


def _inputs(B=2, F=3, H=4, W=6, L=5):
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(B, 16, F, H, W, generator=gen),
        torch.rand(B, generator=gen),
        torch.randn(B, L, 32, generator=gen),
    )


def test_registry_picks_the_adapter_by_family():
    assert set(ADAPTERS) >= {"flux", "wan"}
    assert isinstance(get_adapter("wan"), WanAdapter)
    with pytest.raises(ValueError, match="unknown model family 'sd3'; known: flux, (.+, )?wan"):
        get_adapter("sd3")


def test_forward_calls_transformer_like_the_pipeline():
    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_WAN_TRANSFORMER).eval()
    noisy, sigmas, prompt = _inputs()
    with torch.no_grad():
        pred = wan_forward(model, noisy, sigmas, prompt)
        # WanPipeline.__call__: timestep = t.expand(B) with t from the scheduler (sigma * 1000)
        reference = model(
            hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=prompt, return_dict=False
        )[0]
    assert pred.shape == noisy.shape
    torch.testing.assert_close(pred, reference)
    assert WanAdapter().seq_len(noisy) == 3 * 2 * 3


def test_velocity_target_is_what_the_wan_scheduler_inverts():
    """UniPC with flow_prediction recovers x0 = x_sigma - sigma * v: the trainer's target is that v."""
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    sched.set_timesteps(10)
    x0, noise, _ = _inputs(B=1)
    noise = torch.randn_like(x0)
    for i in (0, 4, 9):
        sched._step_index = i
        sigma = sched.sigmas[i].reshape(1)
        assert float(sched.timesteps[i]) == pytest.approx(1000 * float(sigma), abs=1.0)
        x_t = interpolate(x0, noise, sigma)
        x0_pred = sched.convert_model_output(velocity_target(x0, noise), sample=x_t)
        torch.testing.assert_close(x0_pred, x0, atol=1e-4, rtol=1e-4)


def test_mismatched_cache_is_refused_with_the_difference():
    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_WAN_TRANSFORMER)
    noisy, _, prompt = _inputs()
    check_video_batch_fits(model, noisy, prompt)
    with pytest.raises(ValueError, match="text_dim is 32"):
        check_video_batch_fits(model, noisy, torch.zeros(2, 5, 24))
    with pytest.raises(ValueError, match="expected \\[B, C, F, H, W\\]"):
        check_video_batch_fits(model, torch.zeros(2, 16, 4, 6), prompt)
    with pytest.raises(ValueError, match="not a multiple of patch_size"):
        check_video_batch_fits(model, torch.zeros(2, 16, 3, 5, 6), prompt)


@pytest.mark.parametrize(
    ("mode", "max_ratio"),
    # Measured here (30 steps, seeds 0-4): full 0.61-0.65, lora (rank 4, attention only) 0.77-0.81.
    [("full", 0.75), ("lora", 0.9)],
)
def test_trains_on_cached_video_latents(setup, tmp_path, mode, max_ratio):
    pretrained, cache = setup
    cfg = TrainerConfig(
        mode=mode,
        max_steps=30,
        batch_size=4,
        learning_rate=3e-3 if mode == "full" else 1e-2,
        lora_rank=4,
        save_every=0,
        export=False,
    )
    summary = train(cfg, cache_dir=cache, pretrained=pretrained, train_dir=tmp_path, progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert summary["family"] == "wan" and len(losses) == 30
    assert all(map(lambda x: x == x and x < 1e3, losses))
    ratio = statistics.mean(losses[-5:]) / statistics.mean(losses[:5])
    assert ratio < max_ratio, f"loss fell only to {ratio:.3f} of its start"
    assert {tuple(r["bucket"]) for r in read_metrics(tmp_path)} == {(32, 32, 9), (48, 32, 5)}


def test_flux_cache_on_a_wan_model_is_refused(setup, tmp_path):
    pretrained, _ = setup
    write_fake_cache(tmp_path / "cache", {(16, 16, 1): 2}, family="wan", text_dim=24)
    with pytest.raises(ValueError, match="prompt_embeds width is 24, transformer text_dim is 32"):
        train(
            TrainerConfig(max_steps=1, export=False),
            cache_dir=tmp_path / "cache",
            pretrained=pretrained,
            train_dir=tmp_path / "t",
            progress=False,
        )


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory):
    """Video latents for 32x48 px, 9 frames: [16, 3, 4, 6]; trimmed UMT5 embeds padded to 16 tokens."""
    root = tmp_path_factory.mktemp("wan-export-cache")
    write_fake_cache(root, {(48, 32, 9): 3}, family="wan", trimmed=True, seq_len=16, latents="distribution")
    return root


GENERATE = dict(
    prompt="a red ball", height=32, width=48, num_frames=9, num_inference_steps=2, output_type="np"
)


def test_full_export_loads_and_generates(tiny_wan, export_cache, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline

    cfg = TrainerConfig(
        mode="full", max_steps=3, batch_size=2, learning_rate=1e-3, save_every=3, caption_dropout=0.5
    )
    summary = train(
        cfg,
        cache_dir=export_cache,
        pretrained=str(tiny_wan),
        train_dir=tmp_path / "train",
        export_dir=tmp_path / "export",
        progress=False,
    )
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, WanPipeline)
    from safetensors.torch import load_file

    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000003" / "model.safetensors")
    exported = pipe.transformer.state_dict()
    # stored in trainer.export_dtype (bfloat16 by default), except the modules Wan keeps in float32
    files = load_file(tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    kept = {k for k, v in files.items() if v.dtype == torch.float32}
    assert kept and all("time_embedder" in k or "scale_shift_table" in k or "norm" in k for k in kept), kept
    assert {v.dtype for k, v in files.items() if k not in kept} == {torch.bfloat16}
    assert all(torch.equal(exported[k], v if k in kept else v.to(torch.bfloat16).to(exported[k].dtype))
               for k, v in trained.items())
    base = WanPipeline.from_pretrained(tiny_wan).transformer.state_dict()
    assert any(not torch.equal(base[k], exported[k]) for k in trained)
    frames = pipe(generator=torch.Generator().manual_seed(0), max_sequence_length=16, **GENERATE).frames
    assert frames.shape == (1, 9, 32, 48, 3)


def test_lora_export_loads_into_the_base_pipeline(tiny_wan, export_cache, tmp_path):
    from diffusers import WanPipeline

    add_validation_prompts(export_cache, str(tiny_wan), ["a red ball"], max_sequence_length=16)  # as a prep does
    cfg = TrainerConfig(
        mode="lora",
        max_steps=3,
        batch_size=2,
        learning_rate=1e-2,
        lora_rank=4,
        save_every=0,
        validate_every=3,
        validation_prompts=["a red ball"],
        validation_steps=1,
        validation_size=[48, 32, 9],
    )
    summary = train(
        cfg,
        cache_dir=export_cache,
        pretrained=str(tiny_wan),
        train_dir=tmp_path / "train",
        export_dir=tmp_path / "lora",
        progress=False,
    )
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    from PIL import Image

    (grid,) = summary["validation"]  # one row: first, two middle and last frame of the 9-frame video
    assert grid.endswith("step-000003.png") and Image.open(grid).size == (4 * 48, 32)
    pipe = WanPipeline.from_pretrained(tiny_wan)
    pipe.load_lora_weights(summary["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert pipe.transformer.peft_config[adapter].r == 4
    frames = pipe(max_sequence_length=16, **GENERATE).frames
    assert frames.shape == (1, 9, 32, 48, 3)
