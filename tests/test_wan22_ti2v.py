"""Wan 2.2 TI2V-5B (family ``wan2.2-ti2v``): the tiny model set, caching equal to the pipelines' encode path, the
per-token-timestep objective (text-to-video and image-to-video), exports for WanPipeline and
WanImageToVideoPipeline."""

from __future__ import annotations

import pytest
import torch
from latentmill.stages.families import FAMILIES, WanTI2VEncoders
from latentmill.stages.family_wan import encode_causal
from latentmill.trainer.adapters import check_i2v, get_adapter
from latentmill.trainer.objective import first_frame_mask, flow_matching_loss
from latentmill.trainer.wan22_ti2v import WanTI2VAdapter, ti2v_timesteps

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig
from latentmill.tiny_wan import TI2V_RECIPE_PATH, load_recipe
from tests.helpers import assert_recipe_refused
from tests.trainer_helpers import torch_threads


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def t2v(tiny_wan_ti2v):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(tiny_wan_ti2v)


@pytest.fixture(scope="module")
def i2v(tiny_wan_ti2v):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(tiny_wan_ti2v)


def clip(frames=9, height=32, width=64, seed=0):
    """A moving gradient clip [1, 3, F, H, W] in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(1, 3, 1, height, width, generator=gen)
    shift = torch.linspace(0, 0.5, frames).view(1, 1, frames, 1, 1)
    return ((base + shift) % 1.0) * 2 - 1


def test_family_is_registered_with_its_streams():
    assert FAMILIES["wan2.2-ti2v"] is WanTI2VEncoders
    assert isinstance(get_adapter("wan2.2-ti2v"), WanTI2VAdapter)
    (latents, text) = WanTI2VEncoders.STREAMS
    assert latents.shape == "[C, 1 + (F - 1)/4, H/16, W/16]" and text.pad == "zeros"
    vae = {"z_dim": 48, "scale_factor_spatial": 16, "dim_mult": [1, 2, 4, 4]}
    shapes = WanTI2VEncoders.sample_shapes(lambda name: vae if name == "vae" else {"d_model": 4096},
                                           [1280, 704, 121], 512)
    assert shapes == {"latents": (48, 31, 44, 80), "prompt_embeds": (512, 4096)}


def test_recipe_rules_name_the_key(tmp_path):
    assert load_recipe(TI2V_RECIPE_PATH)["pipeline"] == {"expand_timesteps": True}
    assert_recipe_refused(tmp_path, load_recipe, TI2V_RECIPE_PATH,
                          lambda data: data["components"]["vae"].update(scale_factor_spatial=8),
                          r"components.vae.scale_factor_spatial: 8 != 2 \*\* 3 x 2")
    assert_recipe_refused(tmp_path, load_recipe, TI2V_RECIPE_PATH, lambda data: data.update(pipeline={"boundary": 1}),
                          "pipeline: expected a mapping of expand_timesteps")


def test_i2v_probability_is_refused_for_a_family_without_it():
    check_i2v(0.0, "wan")
    check_i2v(0.5, "wan2.2-ti2v")
    with pytest.raises(ConfigError, match="trainer.i2v_probability: 0.5, but family 'wan' does not condition on a "
                                          "first-frame image; set it to 0, or train one of wan2.2-ti2v"):
        check_i2v(0.5, "wan")


def test_first_frame_mask_and_the_loss_over_the_learned_frames():
    mask = first_frame_mask(torch.Size([2, 48, 3, 2, 4]), torch.tensor([True, False]))
    assert mask.shape == (2, 1, 3, 2, 4)
    assert mask[0, 0, 0].sum() == 0 and mask[0, 0, 1:].min() == 1 and mask[1].min() == 1
    target = torch.zeros(2, 48, 3, 2, 4)
    pred = torch.zeros(2, 48, 3, 2, 4)
    pred[0, :, 0] = 100.0  # the clean frame's prediction does not count
    pred[0, :, 1:] = 1.0
    pred[1] = 3.0
    assert float(flow_matching_loss(pred, target, mask=mask)) == pytest.approx((1.0 + 9.0) / 2)
    assert float(flow_matching_loss(pred, target, torch.tensor([2.0, 0.0]), mask=mask)) == pytest.approx(1.0)


def test_per_token_timesteps_are_the_pipelines():
    class Config:
        patch_size = (1, 2, 2)

    transformer = type("T", (), {"config": Config})()
    shape = torch.Size([2, 48, 3, 4, 6])
    sigmas = torch.tensor([0.25, 0.5])
    ts = ti2v_timesteps(transformer, sigmas, shape)
    assert ts.shape == (2, 3 * 2 * 3) and ts[0].eq(250.0).all() and ts[1].eq(500.0).all()
    ts = ti2v_timesteps(transformer, sigmas, shape, first_frame_mask(shape, torch.tensor([True, False])))
    assert ts[0, :6].eq(0).all() and ts[0, 6:].eq(250.0).all() and ts[1].eq(500.0).all()


@pytest.mark.slow
def test_tiny_set_is_a_ti2v_pipeline(t2v, i2v):
    assert t2v.config.expand_timesteps and i2v.config.expand_timesteps
    assert (t2v.vae.config.z_dim, t2v.transformer.config.in_channels, t2v.transformer.config.out_channels) == (48,) * 3
    assert (t2v.vae_scale_factor_spatial, t2v.vae_scale_factor_temporal) == (16, 4)
    assert t2v.transformer.config.image_dim is None and t2v.scheduler.config.flow_shift == 5.0


@pytest.mark.slow
def test_cache_equals_the_pipelines_encode_path(tiny_wan_ti2v, i2v):
    """The cached latents are the pipeline's normalised latents; their first frame is WanImageToVideoPipeline's
    image condition (the image encoded alone), to float rounding: no separate image stream is needed."""
    encoders = WanTI2VEncoders(ModelConfig(str(tiny_wan_ti2v), family="wan2.2-ti2v"), torch.device("cpu"))
    pixels = clip()
    mean, std = encoders.encode_pixels(pixels)
    assert mean.shape == std.shape == (1, 48, 3, 2, 4)
    vae = i2v.vae
    with torch.no_grad():
        raw = vae.encode(pixels).latent_dist.mean
        _, condition, frame_mask = i2v.prepare_latents(pixels[:, :, 0], 1, 48, 32, 64, 9, torch.float32,
                                                       torch.device("cpu"), torch.Generator().manual_seed(0))
    norm_mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    norm_std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(mean, (raw - norm_mean) / norm_std, rtol=0, atol=0)
    assert condition.shape == (1, 48, 1, 2, 4)
    assert frame_mask[0, 0, 0].sum() == 0 and frame_mask[0, 0, 1:].min() == 1
    assert float((mean[:, :, :1] - condition).abs().max()) < 1e-5  # measured 1e-6 (normalised)
    assert float((mean[:, :, 1:2] - condition).abs().max()) > 0.1  # a later frame is another latent


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan2.2-ti2v", "wan"])
def test_chunked_encode_is_the_vaes_bit_for_bit(request, family):
    """``encode_causal`` patchifies each causal chunk on its own (no whole-clip copy of the pixels); its latent
    distribution is ``vae.encode``'s bit for bit on CPU float32, for both Wan VAEs (2.2: patch_size 2; 2.1: none).
    Fails if a Diffusers release changes the VAE's chunk loop."""
    from diffusers import AutoencoderKLWan

    folder = request.getfixturevalue({"wan2.2-ti2v": "tiny_wan_ti2v", "wan": "tiny_wan"}[family])
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae").eval()
    assert vae.config.patch_size == (2 if family == "wan2.2-ti2v" else None)
    for frames in (1, 5, 33):
        pixels = clip(frames=frames, height=32, width=32, seed=frames)
        with torch.no_grad():
            ours = encode_causal(vae, pixels, torch.device("cpu")).parameters
            theirs = vae.encode(pixels).latent_dist.parameters
        assert ours.shape == theirs.shape == (1, 2 * vae.config.z_dim, 1 + (frames - 1) // 4) + ours.shape[3:]
        assert torch.equal(ours, theirs), f"{frames} frames: {float((ours - theirs).abs().max())}"


def _capture(transformer):
    """Record the kwargs and output of every transformer call."""
    calls = []
    pre = transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
    post = transformer.register_forward_hook(lambda m, a, kw, out: calls[-1].update(out=out[0]), with_kwargs=True)
    return calls, (pre, post)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_adapter_calls_the_transformer_like_the_pipeline(t2v, i2v, task):
    """The adapter's forward on the pipeline's own input (its noisy latents with the clean image frame, its
    timestep / 1000 as sigma, its prompt embeddings) gives the pipeline's transformer output, bit for bit."""
    pipe = t2v if task == "t2v" else i2v
    calls, hooks = _capture(pipe.transformer)
    kwargs = dict(prompt="a red ball", height=32, width=64, num_frames=9, num_inference_steps=2, guidance_scale=1.0,
                  max_sequence_length=16, output_type="latent", generator=torch.Generator().manual_seed(0))
    if task == "i2v":  # prompt_embeds: its prompt_clean needs ftfy, which WanPipeline's does not
        kwargs["prompt_embeds"] = t2v.encode_prompt(kwargs.pop("prompt"), do_classifier_free_guidance=False,
                                                    max_sequence_length=16)[0]
        from PIL import Image

        kwargs["image"] = Image.fromarray(((clip()[0, :, 0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())
    with torch.no_grad():
        pipe(**kwargs)
    for hook in hooks:
        hook.remove()
    assert len(calls) == 2
    adapter = get_adapter("wan2.2-ti2v")
    for call in calls:
        hidden, timestep = call["hidden_states"], call["timestep"]
        assert timestep.shape == (1, 3 * 1 * 2)  # [B, seq]: 3 latent frames of 1 x 2 tokens
        sigma = timestep[:, -1:].flatten() / 1000.0
        batch = {"prompt_embeds": call["encoder_hidden_states"]}
        if task == "i2v":
            assert timestep[0, :2].eq(0).all() and timestep[0, 2:].gt(0).all()
            batch["first_frame_mask"] = first_frame_mask(hidden.shape, torch.tensor([True]))
        with torch.no_grad():
            pred = adapter.forward(pipe.transformer, hidden, sigma, batch, None)
        assert torch.equal(pred, call["out"])


def test_the_pipeline_config_tells_ti2v_from_wan21(tmp_path):
    from latentmill.stages.bucket import BucketConfig
    from latentmill.stages.families import index_family

    from latentmill.preflight import check_bucket, check_components

    assert index_family({"_class_name": "WanPipeline", "expand_timesteps": True}) == "wan2.2-ti2v"
    assert index_family({"_class_name": "WanImageToVideoPipeline", "expand_timesteps": True}) == "wan2.2-ti2v"
    assert index_family({"_class_name": "WanPipeline"}) == "wan"
    assert index_family({"_class_name": "WanPipeline", "expand_timesteps": False}) == "wan"
    assert index_family({"_class_name": "WanImageToVideoPipeline"}) == "wan2.1-i2v"  # (CLIP image embeds)
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline", "expand_timesteps": true}')
    check_components(ModelConfig(str(tmp_path), family="wan2.2-ti2v"))
    with pytest.raises(ConfigError, match="model.family: 'wan', but .* is a WanPipeline \\(the 'wan2.2-ti2v' family"):
        check_components(ModelConfig(str(tmp_path), family="wan"))
    check_bucket("wan2.2-ti2v", BucketConfig(step=64))
    check_bucket("wan", BucketConfig(step=16))
    with pytest.raises(ConfigError, match="bucket.step: 16 px, but wan2.2-ti2v needs sizes in multiples of 32 px"):
        check_bucket("wan2.2-ti2v", BucketConfig(step=16))


def test_recipes_sample_as_ti2v():
    from latentmill.stages.bucket import bucket_sizes

    from latentmill.recipe import load_recipe
    from latentmill.tiny_wan import DEFAULT_RECIPE_PATH

    configs = DEFAULT_RECIPE_PATH.parents[1] / "configs"
    for name, mode in (("wan2.2-ti2v-5b-lora.yaml", "lora"), ("wan2.2-ti2v-5b-full.yaml", "full")):
        recipe = load_recipe(configs / name)
        assert (recipe.model.pretrained, recipe.model.family) == ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "wan2.2-ti2v")
        assert (recipe.trainer.mode, recipe.parallel.strategy) == (mode, "fsdp2")
        assert (recipe.trainer.shift_mode, recipe.trainer.shift, recipe.trainer.i2v_probability) == ("fixed", 5.0, 0.5)
        assert (recipe.bucket.frame_step, recipe.bucket.max_frames, recipe.cache.max_sequence_length) == (4, 121, 512)
        sizes = bucket_sizes(recipe.bucket)
        assert sizes[1.7778] == (1280, 704) and all(w % 32 == 0 and h % 32 == 0 for w, h in sizes.values())
    demo = load_recipe(configs / "demo-wan2.2-ti2v.yaml")
    assert demo.model.family == "wan2.2-ti2v" and demo.model.tiny_recipe.endswith("data/tiny-wan2.2-ti2v.yaml")
    assert demo.bucket.step == 32 and demo.trainer.i2v_probability == 0.5


@pytest.mark.heavy  # a family's plan on meta; make test plans FLUX.1 and Wan 2.1 at their published sizes (test_plan.py)
def test_plan_counts_the_published_5b():
    from diffusers import WanTransformer3DModel as cls

    from latentmill.plan import plan_config, shipped_models_dir

    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(shipped_models_dir() / "Wan2.2-TI2V-5B-Diffusers"),
                                                subfolder="transformer"))
    total = sum(p.numel() for p in model.parameters())
    assert total == 4_999_787_712 and len(model.blocks) == 30  # "5B"
    full = plan_config("configs/wan2.2-ti2v-5b-full.yaml", nproc=8)
    assert full["total_params"] == full["trainable_params"] == total and full["config"]["shipped_configs"]
    assert full["per_rank"]["optimizer_bytes"] == 2 * full["per_rank"]["params_bytes"] and full["fits"]
    lora = plan_config("configs/wan2.2-ti2v-5b-lora.yaml", nproc=8)
    # rank 32 on to_q/k/v/out.0 of both attentions of 30 blocks, 3072 wide
    assert lora["trainable_params"] == 30 * 8 * 32 * (3072 + 3072) == 47_185_920
    assert lora["total_params"] == total + lora["trainable_params"]
