"""Wan 2.2 I2V A14B (family ``wan2.2-i2v``): two experts of an image-to-video pipeline without an image encoder.
The family is told from Wan 2.1 I2V by its ``model_index.json``; the cache equals WanImageToVideoPipeline's own
encode path (``prepare_latents``' condition; no image embedding, as the pipeline computes none); the adapter's
forward equals each expert's call in the pipeline, and the pipeline picks the expert the trainer's routing does."""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages.families import FAMILIES, WanI2VA14BEncoders, WanI2VEncoders, index_family
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.loader import CacheFamilyError, check_streams
from latentmill.trainer.wan21_i2v import first_frame_channels, wan_prompt_embeds
from latentmill.trainer.wan22_i2v import WanI2VA14BAdapter

from latentmill.models import ModelConfig
from tests.conftest import REPO_ROOT
from tests.test_wan21_i2v import _capture, clip, first_image
from tests.trainer_helpers import torch_threads

MODELS = REPO_ROOT / "configs" / "models"
A14B_I2V = MODELS / "Wan2.2-I2V-A14B-Diffusers"


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def pipe(tiny_wan22_i2v):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(tiny_wan22_i2v)


def test_family_is_told_from_wan21_i2v_and_declares_its_streams():
    assert FAMILIES["wan2.2-i2v"] is WanI2VA14BEncoders
    index = json.loads((A14B_I2V / "model_index.json").read_text())
    assert index_family(index) == "wan2.2-i2v"
    assert index_family(json.loads((MODELS / "Wan2.1-I2V-14B-480P-Diffusers" / "model_index.json").read_text())) \
        == "wan2.1-i2v"
    assert [s.name for s in WanI2VA14BEncoders.STREAMS] == ["latents", "condition_latents", "prompt_embeds"]
    # the condition stream is Wan 2.1 I2V's, the same rule and normalisation
    assert WanI2VA14BEncoders.STREAMS[1] == WanI2VEncoders.STREAMS[1]
    assert WanI2VA14BEncoders.COMPONENTS == ("vae", "text_encoder")
    shapes = WanI2VA14BEncoders.sample_shapes({"vae": {"z_dim": 16}, "text_encoder": {"d_model": 4096}}.get,
                                              [1280, 720, 81], 512)
    assert shapes == {"latents": (16, 21, 90, 160), "condition_latents": (16, 21, 90, 160),
                      "prompt_embeds": (512, 4096)}
    adapter = get_adapter("wan2.2-i2v")
    assert isinstance(adapter, WanI2VA14BAdapter) and adapter.pipeline_class == "WanImageToVideoPipeline"
    high, low = adapter.experts(str(A14B_I2V))
    assert (high.name, high.component, high.sigma_min) == ("high", "transformer", 0.9)
    assert (low.name, low.component, low.sigma_max) == ("low", "transformer_2", 0.9)


def test_a_cache_without_the_condition_stream_is_refused_in_one_line():
    adapter = get_adapter("wan2.2-i2v")
    streams = [s.to_json() for s in WanI2VA14BEncoders.STREAMS]
    check_streams({"family": "wan2.2-i2v", "streams": streams}, "wan2.2-i2v", adapter.streams, "m.json")
    lacking = [s for s in streams if s["name"] != "condition_latents"]
    with pytest.raises(CacheFamilyError, match=r"^m.json: .*the 'wan2.2-i2v' model reads .*: condition_latents "
                                               r"missing; re-run latentmill prep$"):
        check_streams({"family": "wan2.2-i2v", "streams": lacking}, "wan2.2-i2v", adapter.streams, "m.json")


def test_recipes_train_wan22_i2v():
    from latentmill.recipe import load_recipe

    lora = load_recipe(REPO_ROOT / "configs" / "wan2.2-a14b-i2v-lora.yaml")
    assert (lora.model.pretrained, lora.model.family) == ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "wan2.2-i2v")
    assert (lora.trainer.mode, lora.trainer.expert, lora.parallel.strategy, lora.trainer.shift) == (
        "lora", "high", "fsdp2", 5.0)
    assert (lora.trainer.validate_every, lora.bucket.frame_step, lora.bucket.max_frames) == (0, 4, 81)
    full = load_recipe(REPO_ROOT / "configs" / "wan2.2-a14b-i2v-full.yaml")
    assert (full.model.family, full.trainer.mode, full.trainer.expert, full.parallel.hsdp_replicate) == (
        "wan2.2-i2v", "full", "high", 4)
    demo = load_recipe(REPO_ROOT / "configs" / "demo-wan2.2-i2v.yaml")
    assert (demo.model.family, demo.trainer.expert) == ("wan2.2-i2v", "both")
    assert demo.model.tiny_recipe.endswith("data/tiny-wan2.2-i2v.yaml")


@pytest.mark.slow
def test_the_pipeline_encodes_no_image_and_the_cache_equals_its_condition(tiny_wan22_i2v, pipe):
    """WanImageToVideoPipeline of Wan 2.2 I2V A14B has no image encoder and experts without image_dim: it computes
    no image embedding. condition_latents = prepare_latents' condition (first frame, then zeros; the VAE's argmax;
    normalised), as for Wan 2.1 I2V."""
    assert pipe.image_encoder is None and pipe.image_processor is None
    assert pipe.transformer.config.image_dim is None and pipe.transformer_2.config.image_dim is None
    assert index_family(json.loads((tiny_wan22_i2v / "model_index.json").read_text())) == "wan2.2-i2v"
    encoders = WanI2VA14BEncoders(ModelConfig(str(tiny_wan22_i2v), family="wan2.2-i2v"), torch.device("cpu"))
    pixels = torch.cat([clip(), clip(seed=1)])
    streams = encoders.encode_conditions(pixels)
    assert set(streams) == {"condition_latents"} and streams["condition_latents"].shape == (2, 16, 3, 4, 6)
    for b in range(2):
        with torch.no_grad():
            _, packed = pipe.prepare_latents(pixels[b : b + 1, :, 0], 1, 16, 32, 48, 9, torch.float32,
                                             torch.device("cpu"), torch.Generator().manual_seed(0))
        assert packed.shape == (1, 20, 3, 4, 6)
        torch.testing.assert_close(streams["condition_latents"][b : b + 1], packed[:, 4:], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_adapter_calls_each_expert_like_the_pipeline(tiny_wan22_i2v, pipe):
    """4 steps at the tiny scheduler's shift 5 (Wan2.2-I2V-A14B's): timesteps 999, 937 (high expert: t >= 0.9 x
    1000), 833, 626 (low). The pipeline calls each expert with no image embedding; the adapter's forward on the same input gives
    its output bit for bit, and the expert the trainer routes each sigma to is the one the pipeline called."""
    calls = {}
    hooks = []
    for slot in ("transformer", "transformer_2"):
        calls[slot], slot_hooks = _capture(getattr(pipe, slot))
        hooks += slot_hooks
    with torch.no_grad():
        pipe(image=first_image(clip()), prompt_embeds=wan_prompt_embeds(pipe, ["a red ball"], 16), height=32,
             width=48, num_frames=9, num_inference_steps=4, guidance_scale=1.0, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    for hook in hooks:
        hook.remove()
    assert (len(calls["transformer"]), len(calls["transformer_2"])) == (2, 2)
    adapter = get_adapter("wan2.2-i2v")
    experts = {e.component: e for e in adapter.experts(str(tiny_wan22_i2v))}
    for slot, slot_calls in calls.items():
        for call in slot_calls:
            hidden, timestep = call["hidden_states"], call["timestep"]
            assert hidden.shape == (1, 36, 3, 4, 6) and call["encoder_hidden_states_image"] is None
            noisy = hidden[:, :16]
            assert torch.equal(hidden[:, 16:20], first_frame_channels(noisy))
            batch = {"prompt_embeds": call["encoder_hidden_states"], "condition_latents": hidden[:, 20:]}
            adapter.check_batch(getattr(pipe, slot), {**batch, "latents": noisy})
            sigma = timestep / 1000.0
            assert [c for c, e in experts.items() if bool(e.serves(sigma))] == [slot]
            with torch.no_grad():
                pred = adapter.forward(getattr(pipe, slot), noisy, sigma, batch, None)
            assert torch.equal(pred, call["out"])
    # a Wan 2.1 I2V cache's image embedding does not fit these experts, nor a Wan 2.1 I2V transformer this cache
    with pytest.raises(ValueError, match=r"image_embeds width is 32, transformer image_dim is None"):
        adapter.check_batch(pipe.transformer, {**batch, "latents": noisy, "image_embeds": torch.zeros(1, 17, 32)})


@pytest.mark.slow
@pytest.mark.heavy  # two plans of a 14B model on meta: the plan path runs in make test for the other families
def test_plan_counts_one_expert_or_both_from_the_published_configs():
    from diffusers import WanTransformer3DModel as cls

    from latentmill.plan import plan_config

    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(A14B_I2V), subfolder="transformer_2"))
    # Wan2.2-T2V-A14B's expert (14,288,491,584) with the 36-channel patch embedding: 20 more channels x 2 x 2 x 5120
    assert sum(p.numel() for p in model.parameters()) == 14_288_491_584 + 20 * 4 * 5120 == 14_288_901_184
    high = plan_config("configs/wan2.2-a14b-i2v-lora.yaml", nproc=8)
    assert high["config"]["shipped_configs"] and high["config"]["expert"] == "high"
    # the static part is small; 720p x 81 frames (75,600 tokens) of activations need cp 2, which the recipe sets
    assert high["per_rank"]["static_bytes"] < 10 * 2**30 and high["config"]["cp_size"] == 2 and high["fits"]
    # rank 32 on to_q/k/v/out.0 of both attentions and the two MLP layers of 40 blocks, 5120 wide (MLP 13824)
    assert high["trainable_params"] == 40 * 32 * (8 * 2 * 5120 + 2 * (5120 + 13824))
    assert high["total_params"] == 14_288_901_184 + high["trainable_params"]
    both = plan_config("configs/wan2.2-a14b-i2v-lora.yaml", ["trainer.expert=both"], nproc=8)
    assert both["total_params"] == 2 * high["total_params"]


def test_a_run_of_both_warns_when_the_shift_starves_an_expert():
    """Routing by the recipe's sigmas gives the high-noise expert 28% of the micro-batches at Wan 2.2 I2V's sample
    shift 5, 13.6% at 3 and 1.4% at 1 (the sigmas >= 0.9 of logit-normal): there the warning names the key."""
    from latentmill.trainer import TrainerConfig
    from latentmill.trainer.experts import routing_shares, routing_warning

    experts = list(get_adapter("wan2.2-i2v").experts(str(A14B_I2V)))
    shares = {shift: routing_shares(experts, TrainerConfig(shift=shift))["high"] for shift in (1.0, 3.0, 5.0)}
    assert shares == pytest.approx({1.0: 0.014, 3.0: 0.136, 5.0: 0.278}, abs=0.003)
    assert routing_warning(experts, TrainerConfig(shift=3.0)) is None
    assert routing_warning(experts[:1], TrainerConfig(shift=1.0)) is None  # one expert per run: its own budget
    assert routing_warning(experts, TrainerConfig(shift=1.0, max_steps=600)) == (
        "trainer.expert: both at trainer.shift 1: the high expert serves 1.4% of the sigmas, so it trains on about 8 "
        "of the run's 600 micro-batches; train it in a run of its own (trainer.expert=high) or at the pipeline's "
        "shift")
