"""Training Wan 2.2 I2V A14B (family ``wan2.2-i2v``): one expert's step is the objective computed by hand over the
conditioned input at a sigma of its range; both experts in one run resume bit for bit; the full and LoRA exports
load into WanImageToVideoPipeline (``transformer`` and ``transformer_2``) and generate a clip from an image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from latentmill.stages.families import WanI2VA14BEncoders
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.experts import expert_sigma
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.objective import derive_seed, flow_matching_loss, interpolate
from latentmill.trainer.wan21_i2v import i2v_forward, wan_prompt_embeds

from tests.test_trainer_wan21_i2v import _image
from tests.trainer_helpers import read_metrics, torch_threads, write_fake_cache

pytestmark = pytest.mark.slow
STREAMS = [s.to_json() for s in WanI2VA14BEncoders.STREAMS]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """48 x 32 px, 9 frames: latents and condition_latents [16, 3, 4, 6]; 16 UMT5 tokens; no image embedding."""
    root = tmp_path_factory.mktemp("i2v-a14b-cache")
    write_fake_cache(root, {(48, 32, 9): 4}, family="wan2.2-i2v", seq_len=16, dtype=torch.float32, streams=STREAMS)
    return root


def test_low_expert_step_is_the_objective_by_hand(tiny_wan22_i2v, cache, tmp_path):
    """Step 1 of a low-expert run: its logged loss, recomputed from the run's own draws (a sigma below 0.9)
    through transformer_2 and the conditioned input; the condition reaches the prediction."""
    cfg = TrainerConfig(mode="full", expert="low", max_steps=1, batch_size=1, save_every=0, export=False, shift=3.0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_wan22_i2v), train_dir=tmp_path, progress=False, seed=3)
    (record,) = read_metrics(tmp_path)
    assert (summary["family"], summary["expert"]) == ("wan2.2-i2v", "low")

    batch = next(iter(LatentLoader(cache, 1, 3)))
    x0 = batch["latents"]
    # the sample's own generator: keyed by (seed, epoch, its epoch ordinal), as the run drew it
    gen = torch.Generator().manual_seed(derive_seed(3, f"sample:{batch['epoch']}:{batch['ordinals'][0]}"))
    (_, low) = get_adapter("wan2.2-i2v").experts(str(tiny_wan22_i2v))
    sigma = expert_sigma(cfg, gen, 3.0, low)
    assert float(sigma) < 0.9
    noise = torch.randn(x0.shape[1:], generator=gen)[None]
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(tiny_wan22_i2v, subfolder="transformer_2")
    noisy = interpolate(x0, noise, sigma)
    with torch.no_grad():
        pred = i2v_forward(transformer, noisy, sigma, batch["prompt_embeds"], batch["condition_latents"], None)
        unconditioned = i2v_forward(transformer, noisy, sigma, batch["prompt_embeds"],
                                    torch.zeros_like(batch["condition_latents"]), None)
    assert record["loss"] == pytest.approx(float(flow_matching_loss(pred, noise - x0)), rel=1e-5)
    assert float((pred - unconditioned).abs().max()) > 1e-2, float((pred - unconditioned).abs().max())


def _generate(pipe):
    """A 9-frame clip from an image over 4 steps, 2 per expert (prompt_embeds: the pipeline's cleaning needs ftfy)."""
    video = pipe(image=_image(), prompt_embeds=wan_prompt_embeds(pipe, ["a red ball"], 16), guidance_scale=1.0,
                 height=32, width=48, num_frames=9, num_inference_steps=4, output_type="np",
                 generator=torch.Generator().manual_seed(0)).frames
    assert video.shape == (1, 9, 32, 48, 3) and video.std() > 0
    return video


def test_both_experts_resume_exactly_and_the_full_export_generates_from_an_image(tiny_wan22_i2v, cache, tmp_path):
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    cfg = {"mode": "full", "expert": "both", "max_steps": 4, "batch_size": 1, "grad_accum_steps": 2,
           "learning_rate": 1e-3, "save_every": 2, "shift": 3.0}
    summary = train(TrainerConfig(**cfg), cache_dir=cache, pretrained=str(tiny_wan22_i2v), train_dir=tmp_path / "a",
                    export_dir=tmp_path / "export", progress=False, seed=1)
    records = read_metrics(tmp_path / "a")
    assert summary["expert"] == "both" and [sum(r["expert_micro_batches"].values()) for r in records] == [2] * 4
    step2 = tmp_path / "a" / "checkpoints" / "step-000002"
    assert (step2 / "transformer_2" / "model.safetensors").is_file()
    train(TrainerConfig(**cfg, resume=str(step2), export=False), cache_dir=cache, pretrained=str(tiny_wan22_i2v),
          train_dir=tmp_path / "b", progress=False, seed=1)
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == [r["loss"] for r in records[2:]]  # bit for bit

    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, WanImageToVideoPipeline) and pipe.config.boundary_ratio == 0.9
    assert pipe.image_encoder is None
    base = WanImageToVideoPipeline.from_pretrained(tiny_wan22_i2v)
    routed = {name for r in records for name in r["expert_micro_batches"]}
    for slot, name in (("transformer", "high"), ("transformer_2", "low")):
        trained, untrained = getattr(pipe, slot).state_dict(), getattr(base, slot).state_dict()
        assert any(not torch.equal(trained[k], untrained[k].to(trained[k].dtype)) for k in untrained) == (
            name in routed), slot
    assert routed == {"high", "low"}, routed
    assert not (_generate(pipe) == _generate(base)).all()


def test_both_experts_lora_exports_load_into_their_slots_and_generate(tiny_wan22_i2v, cache, tmp_path):
    from diffusers import WanImageToVideoPipeline

    cfg = TrainerConfig(mode="lora", expert="both", max_steps=3, batch_size=1, grad_accum_steps=2,
                        learning_rate=1e-2, lora_rank=4, save_every=0, shift=3.0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_wan22_i2v), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False, seed=1)
    export = Path(summary["export_dir"])
    assert sorted(p.name for p in export.iterdir() if p.is_dir()) == ["high_noise", "low_noise"]
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan22_i2v)
    pipe.load_lora_weights(export / "high_noise", adapter_name="high")
    pipe.load_lora_weights(export / "low_noise", adapter_name="low", load_into_transformer_2=True)
    assert list(pipe.transformer.peft_config) == ["high"] and list(pipe.transformer_2.peft_config) == ["low"]
    assert pipe.transformer_2.peft_config["low"].r == 4
    assert not (_generate(pipe) == _generate(WanImageToVideoPipeline.from_pretrained(tiny_wan22_i2v))).all()
