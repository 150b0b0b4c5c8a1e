"""Wan 2.2 A14B's two experts, one per run (``trainer.expert: high | low``): the boundary read from the pipeline,
sigmas drawn only from the trained expert's range, the expert's component loaded, checkpointed and exported into
its slot of ``WanPipeline`` (``transformer`` / ``transformer_2``), LoRAs that load the way the pipeline loads
them (``load_lora_weights(..., load_into_transformer_2=True)`` for the low-noise one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import UniPCMultistepScheduler
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapter import ONE_EXPERT, choose_experts
from latentmill.trainer.objective import sample_sigmas, sample_sigmas_within
from latentmill.trainer.wan import WanAdapter

from latentmill.core.config import ConfigError, from_dict
from tests.conftest import REPO_ROOT
from tests.trainer_helpers import add_validation_prompts, read_metrics, torch_threads, write_fake_cache

A14B = REPO_ROOT / "configs" / "models" / "Wan2.2-T2V-A14B-Diffusers"
WAN21 = REPO_ROOT / "configs" / "models" / "Wan2.1-T2V-14B-Diffusers"
GENERATE = dict(prompt="a red ball", height=32, width=48, num_frames=9, num_inference_steps=4, output_type="np",
                max_sequence_length=16)


def test_the_published_pipeline_has_two_experts_split_at_its_boundary():
    high, low = WanAdapter().experts(str(A14B))
    assert (high.name, high.component, high.sigma_min) == ("high", "transformer", 0.875)
    assert (low.name, low.component, low.sigma_min, low.sigma_max) == ("low", "transformer_2", 0.0, 0.875)
    assert (high.lora_folder, low.lora_folder) == ("high_noise", "low_noise")
    assert WanAdapter().experts(str(WAN21)) == ONE_EXPERT
    assert choose_experts(WanAdapter().experts(str(A14B)), "low", "A14B") == (low,)


def test_experts_and_timesteps_route_like_the_pipeline():
    """WanPipeline: t >= boundary_ratio * num_train_timesteps -> transformer, else transformer_2, with the
    scheduler's timesteps (sigma * 1000) at Wan 2.2 T2V's sample shift 12."""
    high, low = WanAdapter().experts(str(A14B))
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0)
    sched.set_timesteps(40)
    sigmas, timesteps = sched.sigmas[:-1], sched.timesteps
    pipeline_high = timesteps >= 0.875 * sched.config.num_train_timesteps
    assert 0 < int(pipeline_high.sum()) < 40
    assert torch.equal(high.serves(sigmas), pipeline_high) and torch.equal(low.serves(sigmas), ~pipeline_high)


def test_one_expert_draws_only_its_own_sigmas_from_the_recipes_distribution():
    cfg = TrainerConfig(timestep_sampling="logit_normal", shift=3.0)
    gen = torch.Generator().manual_seed(0)
    high = torch.cat([sample_sigmas_within(cfg, gen, 3.0, 0.875, float("inf")) for _ in range(400)])
    low = torch.cat([sample_sigmas_within(cfg, gen, 3.0, 0.0, 0.875) for _ in range(400)])
    assert bool((high >= 0.875).all()) and bool((low < 0.875).all())
    # the same distribution, restricted: compare with the recipe's own draws that fall in each range
    every = sample_sigmas(40000, cfg, torch.Generator().manual_seed(1), shift=3.0)
    assert float(high.mean()) == pytest.approx(float(every[every >= 0.875].mean()), abs=0.005)
    assert float(low.mean()) == pytest.approx(float(every[every < 0.875].mean()), abs=0.02)
    with pytest.raises(ValueError, match=r"trainer.expert: no sigma in \[0.999999, 1\].*change trainer.shift"):
        sample_sigmas_within(TrainerConfig(shift=0.01), gen, 0.01, 0.999999, float("inf"))


def test_bad_expert_values_fail_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.expert: 'middle' does not fit 'high' \| 'low' \| 'both' or null"):
        from_dict(TrainerConfig, {"expert": "middle"}, "trainer")
    experts = WanAdapter().experts(str(A14B))
    with pytest.raises(ConfigError, match=r"trainer.expert: A14B has 2 experts \(high: transformer, sigma in "
                                          r"\[0.875, 1\]; low: transformer_2, sigma in \[0, 0.875\)\); set "
                                          r"trainer.expert to one of 'high', 'low'"):
        choose_experts(experts, None, "A14B")
    with pytest.raises(ConfigError, match="trainer.expert: 'high' needs a pipeline with two experts"):
        choose_experts(WanAdapter().experts(str(WAN21)), "high", "Wan2.1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A ``wan`` cache (the family of Wan 2.1 and 2.2 A14B alike): 32x48 px, 9 frames, UMT5 padded to 16."""
    root = tmp_path_factory.mktemp("wan22-cache")
    write_fake_cache(root, {(48, 32, 9): 4}, family="wan", trimmed=True, seq_len=16, latents="distribution")
    return root


def _train(cache: Path, pretrained: Path, out: Path, **cfg) -> dict:
    cfg = {"max_steps": 3, "batch_size": 2, "learning_rate": 1e-3, "save_every": 3, **cfg}
    with torch_threads(1):
        return train(TrainerConfig(**cfg), cache_dir=cache, pretrained=str(pretrained), train_dir=out / "train",
                     export_dir=out / "export", progress=False)


@pytest.mark.slow
def test_low_expert_full_trains_transformer_2_and_exports_both(tiny_wan22, cache, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline
    from safetensors.torch import load_file

    summary = _train(cache, tiny_wan22, tmp_path, mode="full", expert="low")
    state = json.loads((tmp_path / "train" / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    assert state["expert"] == "low" and summary["family"] == "wan"
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, WanPipeline) and pipe.config.boundary_ratio == 0.875
    base = WanPipeline.from_pretrained(tiny_wan22)
    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000003" / "model.safetensors")
    low = pipe.transformer_2.state_dict()
    assert all(torch.equal(low[k], v.to(torch.bfloat16).to(low[k].dtype)) or torch.equal(low[k], v)
               for k, v in trained.items())
    assert any(not torch.equal(base.transformer_2.state_dict()[k], low[k]) for k in trained)
    # the high-noise expert is the pretrained one, file for file
    high = pipe.transformer.state_dict()
    assert all(torch.equal(v, high[k]) for k, v in base.transformer.state_dict().items())
    frames = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames
    assert frames.shape == (1, 9, 32, 48, 3)
    # resuming as the other expert would load low-noise weights into the high-noise model: refused
    with pytest.raises(ConfigError, match="trainer.expert: .*step-000003 trained expert 'low', this run 'high'"):
        _train(cache, tiny_wan22, tmp_path, mode="full", expert="high", resume="latest", max_steps=4)


@pytest.mark.heavy  # one expert per run; make test runs both experts' LoRA export into both slots of one run
def test_lora_exports_load_into_their_experts(tiny_wan22, cache, tmp_path):
    from diffusers import WanPipeline

    add_validation_prompts(cache, str(tiny_wan22), ["a red ball"], max_sequence_length=16)  # as a prep does
    runs = {}
    for expert in ("high", "low"):
        runs[expert] = _train(cache, tiny_wan22, tmp_path / expert, mode="lora", expert=expert, lora_rank=4,
                              learning_rate=1e-2, save_every=0, validate_every=3, validation_prompts=["a red ball"],
                              validation_steps=2, validation_size=[48, 32, 9])
        assert (Path(runs[expert]["export_dir"]) / f"{expert}_noise" / "pytorch_lora_weights.safetensors").is_file()
        assert len(read_metrics(tmp_path / expert / "train")) == 3
        assert len(runs[expert]["validation"]) == 1
    # one export folder for both, as a user gathers them: high_noise/ and low_noise/
    both = tmp_path / "both"
    for expert in ("high", "low"):
        shutil.copytree(Path(runs[expert]["export_dir"]) / f"{expert}_noise", both / f"{expert}_noise")
    pipe = WanPipeline.from_pretrained(tiny_wan22)
    pipe.load_lora_weights(both / "high_noise", adapter_name="high")
    pipe.load_lora_weights(both / "low_noise", adapter_name="low", load_into_transformer_2=True)
    assert list(pipe.transformer.peft_config) == ["high"] and list(pipe.transformer_2.peft_config) == ["low"]
    for model in (pipe.transformer, pipe.transformer_2):
        lora_b = [v for k, v in model.state_dict().items() if "lora_B" in k]
        assert lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)  # trained from B = 0
    frames = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames
    assert frames.shape == (1, 9, 32, 48, 3)


@pytest.mark.slow
def test_a_wan21_cache_feeds_a_wan22_run(tiny_wan, tiny_wan22):
    """The experts share Wan 2.1's VAE and UMT5: the manifest's family (wan) and the fingerprints of a cache made
    with the tiny Wan 2.1 set pass the recipe check of the tiny Wan 2.2 A14B set."""
    from latentmill.models import (
        CacheMismatchError,
        ModelConfig,
        cached_model_fingerprints,
        check_cache_compatible,
    )

    made_with = cached_model_fingerprints(ModelConfig(pretrained=str(tiny_wan), family="wan"), ("vae", "text_encoder"))
    manifest = {"family": "wan", "models": {name: {"fingerprint": fp} for name, fp in made_with.items()}}
    check_cache_compatible(manifest, ModelConfig(pretrained=str(tiny_wan22), family="wan"))
    other = {**manifest, "models": {**manifest["models"], "vae": {"fingerprint": "0" * 64}}}
    with pytest.raises(CacheMismatchError, match="vae: cache was made with fingerprint 000000000000"):
        check_cache_compatible(other, ModelConfig(pretrained=str(tiny_wan22), family="wan"))


def _route_seed(cfg: TrainerConfig, wanted: list[bool]) -> int:
    """A run seed whose first step routes its micro-batches as ``wanted`` (True: high), by the trainer's rule."""
    from latentmill.trainer.train import derive_seed

    for seed in range(100):
        sigmas = [sample_sigmas(1, cfg, torch.Generator().manual_seed(derive_seed(seed, f"expert:0:{micro}")))
                  for micro in range(len(wanted))]
        if [bool(s >= 0.875) for s in sigmas] == wanted:
            return seed
    raise AssertionError("no seed routes so")


@pytest.mark.slow
def test_both_experts_route_micro_batches_resume_exactly_and_export_both(tiny_wan22, cache, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline

    cfg = {"mode": "full", "expert": "both", "max_steps": 4, "batch_size": 1, "grad_accum_steps": 2,
           "save_every": 2, "shift": 3.0}
    seed = _route_seed(TrainerConfig(shift=3.0), [True, False])
    with torch_threads(1):
        summary = train(TrainerConfig(**cfg), cache_dir=cache, pretrained=str(tiny_wan22), train_dir=tmp_path / "a",
                        export_dir=tmp_path / "export", progress=False, seed=seed)
        records = read_metrics(tmp_path / "a")
        assert summary["expert"] == "both" and [sum(r["expert_micro_batches"].values()) for r in records] == [2] * 4
        assert records[0]["expert_micro_batches"] == {"high": 1, "low": 1}  # one step, two experts
        assert records[0]["grad_norm"] == pytest.approx(
            sum(n * n for n in records[0]["expert_grad_norms"].values()) ** 0.5)
        step2 = tmp_path / "a" / "checkpoints" / "step-000002"
        assert (step2 / "model.safetensors").is_file() and (step2 / "transformer_2" / "model.safetensors").is_file()
        train(TrainerConfig(**cfg, resume=str(step2), export=False), cache_dir=cache, pretrained=str(tiny_wan22),
              train_dir=tmp_path / "b", progress=False, seed=seed)
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == [r["loss"] for r in records[2:]]  # bit for bit
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    base = WanPipeline.from_pretrained(tiny_wan22)
    for slot in ("transformer", "transformer_2"):
        trained, untrained = getattr(pipe, slot).state_dict(), getattr(base, slot).state_dict()
        assert any(not torch.equal(trained[k], untrained[k].to(trained[k].dtype)) for k in untrained), slot
    assert pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames.shape == (1, 9, 32, 48, 3)


@pytest.mark.slow
def test_a_step_of_both_experts_trains_the_routed_expert_like_a_run_of_it_alone(tiny_wan22, cache, tmp_path):
    """A step whose 2 micro-batches both go to the low expert is, bit for bit, a step of a low-expert run: the
    same samples, sigmas (drawn in the low range) and noise, the gradient averaged over its 2 micro-batches;
    the high expert, which got none, does not move."""
    from safetensors.torch import load_file

    seed = _route_seed(TrainerConfig(shift=3.0), [False, False])
    with torch_threads(1):
        for expert in ("both", "low"):
            train(TrainerConfig(mode="full", expert=expert, max_steps=1, batch_size=1, grad_accum_steps=2,
                                save_every=1, shift=3.0, export=False),
                  cache_dir=cache, pretrained=str(tiny_wan22), train_dir=tmp_path / expert, progress=False, seed=seed)
    (both,), (low,) = read_metrics(tmp_path / "both"), read_metrics(tmp_path / "low")
    assert both["expert_micro_batches"] == {"low": 2}
    assert (both["loss"], both["grad_norm"]) == (low["loss"], low["grad_norm"])
    step = "step-000001"
    trained = load_file(tmp_path / "both" / "checkpoints" / step / "transformer_2" / "model.safetensors")
    reference = load_file(tmp_path / "low" / "checkpoints" / step / "model.safetensors")
    assert trained.keys() == reference.keys() and all(torch.equal(trained[k], reference[k]) for k in reference)
    from diffusers import WanTransformer3DModel

    high = load_file(tmp_path / "both" / "checkpoints" / step / "model.safetensors")
    base = WanTransformer3DModel.from_pretrained(tiny_wan22, subfolder="transformer").state_dict()
    assert all(torch.equal(high[k], base[k]) for k in high)


@pytest.mark.slow
def test_both_experts_lora_export_loads_into_both_slots(tiny_wan22, cache, tmp_path):
    from diffusers import WanPipeline

    add_validation_prompts(cache, str(tiny_wan22), ["a red ball"], max_sequence_length=16)  # as a prep does
    summary = _train(cache, tiny_wan22, tmp_path, mode="lora", expert="both", lora_rank=4, learning_rate=1e-2,
                     batch_size=1, grad_accum_steps=2, save_every=0, shift=3.0,
                     validate_every=3, validation_prompts=["a red ball"], validation_steps=2,
                     validation_size=[48, 32, 9])
    export = Path(summary["export_dir"])
    # the model card's validation grid in images/ (trainer/card.py)
    assert sorted(p.name for p in export.iterdir() if p.is_dir()) == ["high_noise", "images", "low_noise"]
    assert len(summary["validation"]) == 1
    pipe = WanPipeline.from_pretrained(tiny_wan22)
    pipe.load_lora_weights(export / "high_noise", adapter_name="high")
    pipe.load_lora_weights(export / "low_noise", adapter_name="low", load_into_transformer_2=True)
    assert list(pipe.transformer.peft_config) == ["high"] and list(pipe.transformer_2.peft_config) == ["low"]
    assert pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames.shape == (1, 9, 32, 48, 3)


@pytest.mark.heavy  # three plans of a 14B model on meta (3 minutes on 2 shared cores)
@pytest.mark.slow
def test_plan_counts_one_expert_or_both_from_the_published_configs():
    """One expert: Wan2.1-14B's architecture, counted alone. Both: parameters and AdamW state of the two
    experts resident, gradients and gathered units of one at a time."""
    from latentmill.plan import plan_config

    args = ["model.pretrained=Wan-AI/Wan2.2-T2V-A14B-Diffusers", "parallel.hsdp_replicate=1"]
    high = plan_config("configs/wan2.2-a14b-lora.yaml", args, nproc=2)
    both = plan_config("configs/wan2.2-a14b-lora.yaml", [*args, "trainer.expert=both"], nproc=2)
    assert high["config"]["expert"] == "high" and both["config"]["expert"] == "both"
    assert high["total_params"] == 14_288_491_584 + high["trainable_params"]  # the A14B expert + its LoRA
    assert both["total_params"] == 2 * high["total_params"]
    one, two = high["per_rank"], both["per_rank"]
    assert two["params_bytes"] == 2 * one["params_bytes"] and two["optimizer_bytes"] == 2 * one["optimizer_bytes"]
    assert (two["grads_bytes"], two["gathered_bytes"]) == (one["grads_bytes"], one["gathered_bytes"])
    assert two["static_bytes"] == one["static_bytes"] + one["params_bytes"] + one["buffers_bytes"] + one["optimizer_bytes"]
    assert any("trainer.expert both" in note for note in both["notes"])
