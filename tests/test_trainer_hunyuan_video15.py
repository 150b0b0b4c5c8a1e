"""Training HunyuanVideo 1.5 (family ``hunyuanvideo1.5``): the loop's step is the objective computed by hand on
the loader's padded, masked text streams, and the exports (full, LoRA) load into HunyuanVideo15Pipeline and
generate."""

from __future__ import annotations

import pytest
import torch
from latentmill.stages.families import family_streams
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.hunyuan_video15 import hunyuan_video15_forward
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.objective import flow_matching_loss, interpolate, sample_sigmas
from latentmill.trainer.train import derive_seed

from tests.trainer_helpers import read_metrics, torch_threads, write_fake_cache

pytestmark = pytest.mark.slow
STREAMS = [s.to_json() for s in family_streams("hunyuanvideo1.5")]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """48 x 32 px, 9 frames: latents [16, 3, 2, 3]; up to 8 Qwen tokens and 0-3 glyph tokens."""
    root = tmp_path_factory.mktemp("hunyuan-cache")
    write_fake_cache(root, {(48, 32, 9): 3}, family="hunyuanvideo1.5", channels=16, seq_len=8,
                     dtype=torch.float32, trimmed=True, streams=STREAMS)
    return root


def test_first_step_loss_is_the_objective_by_hand(tiny_hunyuan_video15, cache, tmp_path):
    """Step 1's logged loss, recomputed from the run's own draws with the pipeline's call (both text streams
    padded to their manifest lengths, 8 and 256 tokens, with masks; 729 zero image tokens)."""
    cfg = TrainerConfig(mode="full", max_steps=1, batch_size=1, save_every=0, export=False, shift=5.0)
    train(cfg, cache_dir=cache, pretrained=str(tiny_hunyuan_video15), train_dir=tmp_path, progress=False, seed=3)
    (record,) = read_metrics(tmp_path)

    batch = next(iter(LatentLoader(cache, 1, 3)))
    assert batch["prompt_embeds"].shape == (1, 8, 32) and batch["prompt_embeds_2"].shape == (1, 256, 32)
    assert batch["prompt_embeds_mask"].sum() >= 2 and batch["prompt_embeds_2_mask"].sum() <= 3
    x0 = batch["latents"]
    # the sample's own generator: keyed by (seed, epoch, its epoch ordinal), as the run drew it
    gen = torch.Generator().manual_seed(derive_seed(3, f"sample:{batch['epoch']}:{batch['ordinals'][0]}"))
    sigma = sample_sigmas(1, cfg, gen, shift=5.0)
    noise = torch.randn(x0.shape[1:], generator=gen)[None]
    from diffusers import HunyuanVideo15Transformer3DModel

    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(tiny_hunyuan_video15, subfolder="transformer")
    with torch.no_grad():
        pred = hunyuan_video15_forward(transformer, interpolate(x0, noise, sigma), sigma, batch["prompt_embeds"],
                                       batch["prompt_embeds_mask"], batch["prompt_embeds_2"],
                                       batch["prompt_embeds_2_mask"], image_tokens=729)
    assert record["loss"] == pytest.approx(float(flow_matching_loss(pred, noise - x0)), rel=1e-5)


GENERATE = dict(prompt='a sign that reads "OPEN"', height=32, width=48, num_frames=9, num_inference_steps=2,
                output_type="np")


def test_full_export_generates(tiny_hunyuan_video15, cache, tmp_path):
    from diffusers import DiffusionPipeline, HunyuanVideo15Pipeline

    cfg = TrainerConfig(mode="full", max_steps=2, batch_size=2, learning_rate=1e-3, save_every=0, shift=5.0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_hunyuan_video15), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    assert summary["family"] == "hunyuanvideo1.5"
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, HunyuanVideo15Pipeline)
    base = HunyuanVideo15Pipeline.from_pretrained(tiny_hunyuan_video15).transformer.state_dict()
    assert any(not torch.equal(base[k].bfloat16(), v.bfloat16()) for k, v in pipe.transformer.state_dict().items())
    frames = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames
    assert frames.shape == (1, 9, 32, 48, 3) and frames.std() > 0


@pytest.mark.heavy
def test_lora_export_loads_into_the_transformer(tiny_hunyuan_video15, cache, tmp_path):
    """diffusers 0.42 has no LoRA loader for this pipeline: the file is what save_lora_weights writes, and the
    transformer's own load_lora_adapter loads it."""
    from diffusers import HunyuanVideo15Pipeline

    cfg = TrainerConfig(mode="lora", max_steps=2, batch_size=2, learning_rate=1e-2, lora_rank=4, save_every=0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_hunyuan_video15), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    pipe = HunyuanVideo15Pipeline.from_pretrained(tiny_hunyuan_video15)
    before = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames
    pipe.transformer.load_lora_adapter(summary["export_dir"], use_safetensors=True)
    (name,) = pipe.transformer.active_adapters()
    assert pipe.transformer.peft_config[name].r == 4
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k]
    assert lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)
    after = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames
    assert after.shape == (1, 9, 32, 48, 3) and not (after == before).all()
