"""Wan 2.1 I2V (family ``wan2.1-i2v``): the tiny model set, caching equal to WanImageToVideoPipeline's own encode
path (``prepare_latents``' condition, ``encode_image``), the adapter's forward equal to the pipeline's transformer
call, training and exports."""

from __future__ import annotations

import pytest
import torch
from latentmill.stages.families import FAMILIES, WanI2VEncoders, index_family
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.loader import CacheFamilyError, check_streams
from latentmill.trainer.wan21_i2v import WanI2VAdapter, first_frame_channels, wan_prompt_embeds

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig
from latentmill.tiny_wan import I2V_RECIPE_PATH, load_recipe
from tests.helpers import assert_recipe_refused
from tests.trainer_helpers import torch_threads


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def pipe(tiny_wan_i2v):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v)


def clip(frames=9, height=32, width=48, seed=0):
    """A moving gradient clip [1, 3, F, H, W] in [-1, 1], on the 8-bit grid (as decoded pixels are)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(1, 3, 1, height, width, generator=gen)
    shift = torch.linspace(0, 0.5, frames).view(1, 1, frames, 1, 1)
    return (((base + shift) % 1.0) * 255).round() / 127.5 - 1


def first_image(pixels):
    from PIL import Image

    return Image.fromarray(((pixels[0, :, 0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())


def test_family_is_registered_with_its_streams():
    assert FAMILIES["wan2.1-i2v"] is WanI2VEncoders
    assert index_family({"_class_name": "WanImageToVideoPipeline"}) == "wan2.1-i2v"
    assert [s.name for s in WanI2VEncoders.streams("vae")] == ["latents", "condition_latents", "image_embeds"]
    assert WanI2VEncoders.PIXEL_COMPONENTS == ("vae", "image_encoder")
    configs = {"vae": {"z_dim": 16}, "text_encoder": {"d_model": 4096},
               "image_encoder": {"image_size": 224, "patch_size": 14, "hidden_size": 1280}}
    shapes = WanI2VEncoders.sample_shapes(configs.get, [832, 480, 81], 512)
    assert shapes == {"latents": (16, 21, 60, 104), "condition_latents": (16, 21, 60, 104),
                      "image_embeds": (257, 1280), "prompt_embeds": (512, 4096)}


def test_recipe_rules_name_the_key(tmp_path):
    assert load_recipe(I2V_RECIPE_PATH)["components"]["transformer"]["in_channels"] == 36
    assert_recipe_refused(tmp_path, load_recipe, I2V_RECIPE_PATH,
                          lambda data: data["components"]["transformer"].update(in_channels=16),
                          r"components.transformer.in_channels/out_channels: 16/16 != 36/16 "
                          r"\(vae.z_dim 16, in: 2 x z_dim \+ 4 with an image_encoder\)")
    assert_recipe_refused(tmp_path, load_recipe, I2V_RECIPE_PATH,
                          lambda data: data["components"]["transformer"].update(image_dim=64),
                          r"components.transformer.image_dim: 64 != components.image_encoder")


@pytest.mark.slow
def test_cache_equals_the_pipelines_encode_path(tiny_wan_i2v, pipe):
    """latents as Wan 2.1's; condition_latents = prepare_latents' condition (first frame, then zeros; the VAE's
    argmax; normalised); image_embeds = encode_image of the first frame."""
    encoders = WanI2VEncoders(ModelConfig(str(tiny_wan_i2v), family="wan2.1-i2v"), torch.device("cpu"))
    pixels = torch.cat([clip(), clip(seed=1)])
    streams = encoders.encode_conditions(pixels)
    condition, embeds = streams["condition_latents"], streams["image_embeds"]
    assert condition.shape == (2, 16, 3, 4, 6) and embeds.shape == (2, 17, 32)
    for b in range(2):
        with torch.no_grad():
            _, packed = pipe.prepare_latents(pixels[b : b + 1, :, 0], 1, 16, 32, 48, 9, torch.float32,
                                             torch.device("cpu"), torch.Generator().manual_seed(0))
            image_embeds = pipe.encode_image(first_image(pixels[b : b + 1]), torch.device("cpu"))
        assert packed.shape == (1, 20, 3, 4, 6)
        mask = packed[:, :4]  # the fixed first-frame mask: ones on latent frame 0 only
        assert mask[:, :, 0].min() == 1 and mask[:, :, 1:].max() == 0
        # the pipeline multiplies by 1 / std where the cache divides: float rounding apart
        torch.testing.assert_close(condition[b : b + 1], packed[:, 4:], rtol=0, atol=1e-5)
        torch.testing.assert_close(embeds[b : b + 1], image_embeds, rtol=0, atol=0)
    mean, _ = encoders.encode_pixels(pixels)
    assert float((mean[:, :, 1:] - condition[:, :, 1:]).abs().max()) > 0.1  # zeros after frame 0 are not the clip
    assert not torch.equal(embeds[0], embeds[1])


def test_validation_from_prompts_alone_is_refused_before_any_work():
    from latentmill.trainer.adapters import check_validation

    check_validation(0, "wan2.1-i2v")
    with pytest.raises(ConfigError, match="trainer.validate_every: 5, but the wan2.1-i2v family samples from a source "
                                          "image"):
        check_validation(5, "wan2.1-i2v")


def test_a_cache_without_the_conditioning_streams_is_refused_in_one_line():
    adapter = get_adapter("wan2.1-i2v")
    assert isinstance(adapter, WanI2VAdapter)
    streams = [s.to_json() for s in WanI2VEncoders.STREAMS]
    check_streams({"family": "wan2.1-i2v", "streams": streams}, "wan2.1-i2v", adapter.streams, "m.json")
    lacking = [s for s in streams if s["name"] != "image_embeds"]
    with pytest.raises(CacheFamilyError, match=r"^m.json: the cache holds the streams \['condition_latents', "
                                               r"'latents', 'prompt_embeds'\], the 'wan2.1-i2v' model reads .*: "
                                               r"image_embeds missing; re-run latentmill prep$"):
        check_streams({"family": "wan2.1-i2v", "streams": lacking}, "wan2.1-i2v", adapter.streams, "m.json")


def _capture(transformer):
    """Record the kwargs and output of every transformer call."""
    calls = []
    pre = transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
    post = transformer.register_forward_hook(lambda m, a, kw, out: calls[-1].update(out=out[0]), with_kwargs=True)
    return calls, (pre, post)


@pytest.mark.slow
def test_adapter_calls_the_transformer_like_the_pipeline(pipe):
    """On the pipeline's own input (its noisy latents, timestep / 1000 as sigma, prompt and image embeddings,
    condition latents), the adapter's forward gives the pipeline's transformer output, bit for bit; the mask
    channels the pipeline stacks are the adapter's."""
    calls, hooks = _capture(pipe.transformer)
    with torch.no_grad():
        pipe(image=first_image(clip()), prompt_embeds=wan_prompt_embeds(pipe, ["a red ball"], 16), height=32, width=48, num_frames=9,
             num_inference_steps=2, guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    for hook in hooks:
        hook.remove()
    assert len(calls) == 2
    adapter = get_adapter("wan2.1-i2v")
    for call in calls:
        hidden, timestep = call["hidden_states"], call["timestep"]
        assert hidden.shape == (1, 36, 3, 4, 6) and timestep.shape == (1,)
        noisy = hidden[:, :16]
        assert torch.equal(hidden[:, 16:20], first_frame_channels(noisy))
        batch = {"prompt_embeds": call["encoder_hidden_states"], "condition_latents": hidden[:, 20:],
                 "image_embeds": call["encoder_hidden_states_image"]}
        adapter.check_batch(pipe.transformer, {**batch, "latents": noisy})
        with torch.no_grad():
            pred = adapter.forward(pipe.transformer, noisy, timestep / 1000.0, batch, None)
        assert torch.equal(pred, call["out"])
    with pytest.raises(ValueError, match=r"image_embeds width is 8, transformer image_dim is 32"):
        adapter.check_batch(pipe.transformer, {**batch, "latents": noisy, "image_embeds": torch.zeros(1, 17, 8)})


@pytest.fixture(scope="module")
def i2v_cache(tiny_wan_i2v, tmp_path_factory):
    """The cache stage over two demo videos with configs/demo-wan2.1-i2v.yaml (no Prefect)."""
    import shutil

    from latentmill.recipe import load_recipe
    from tests.conftest import REPO_ROOT
    from tests.helpers import prep_in_process

    videos = tmp_path_factory.mktemp("videos")
    for name in ("ball_64x48_24fps", "square_64x64_8fps"):
        for ext in (".mp4", ".txt"):
            shutil.copy(REPO_ROOT / "data" / "demo" / "videos" / (name + ext), videos)
    out = tmp_path_factory.mktemp("i2v-prep")
    recipe = load_recipe(REPO_ROOT / "configs" / "demo-wan2.1-i2v.yaml",
                         [f"output_dir={out}", f"model.pretrained={tiny_wan_i2v}", f"ingest.source={videos}"])
    sd, manifest, _ = prep_in_process(recipe)["cache"]
    return sd, manifest


@pytest.mark.slow
def test_the_cache_stage_stores_the_pipelines_conditioning(i2v_cache, pipe):
    """Each cached clip's VAE member holds condition_latents and image_embeds equal to what
    WanImageToVideoPipeline computes from the clip's first frame; the manifest records the streams."""
    import json

    from latentmill.stages.cache import load_clip_pixels
    from latentmill.stages.tarshard import read_shard
    from safetensors.torch import load as load_tensors

    sd, manifest = i2v_cache
    assert [s["name"] for s in manifest["streams"]] == ["latents", "condition_latents", "image_embeds",
                                                        "prompt_embeds"]
    assert set(manifest["models"]) == {"vae", "text_encoder", "image_encoder"}
    samples = [s for shard in manifest["shards"] for s in read_shard(sd.root / shard["path"])]
    assert len(samples) >= 2
    for sample in samples[:2]:
        meta, vae = json.loads(sample["json"]), load_tensors(sample["vae.safetensors"])
        assert set(vae) == {"latents", "condition_latents", "image_embeds"}
        pixels = load_clip_pixels(meta, sample)[None]
        frames, height, width = pixels.shape[2:]
        with torch.no_grad():
            _, packed = pipe.prepare_latents(pixels[:, :, 0], 1, 16, height, width, frames, torch.float32,
                                             torch.device("cpu"), torch.Generator().manual_seed(0))
            image_embeds = pipe.encode_image(first_image(pixels), torch.device("cpu"))
        # (encoded in a batch, on the prep's threads: float rounding apart, measured 2.4e-7)
        torch.testing.assert_close(vae["condition_latents"][None], packed[:, 4:], rtol=0, atol=1e-5)
        torch.testing.assert_close(vae["image_embeds"][None], image_embeds, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_image_encoder_keys_the_vae_member_not_the_text(tiny_wan_i2v, tmp_path):
    """A changed image encoder re-encodes every clip's VAE member (its streams come from it) and no caption."""
    import shutil

    from latentmill.stages.cache import CacheConfig, CachePlan
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(tiny_wan_i2v, other)
    (weights,) = (other / "image_encoder").glob("*.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights)
    cfg = CacheConfig()
    base = CachePlan.of(cfg, ModelConfig(str(tiny_wan_i2v), family="wan2.1-i2v"))
    changed = CachePlan.of(cfg, ModelConfig(str(other), family="wan2.1-i2v"))
    assert base.vae_fp != changed.vae_fp and base.text_fp == changed.text_fp
    assert set(base.prints) == {"vae", "text_encoder", "image_encoder"}
    (other / "image_processor" / "preprocessor_config.json").write_text(
        (tiny_wan_i2v / "image_processor" / "preprocessor_config.json").read_text().replace("32", "64"))
    shutil.copy(tiny_wan_i2v / "image_encoder" / weights.name, weights)
    processed = CachePlan.of(cfg, ModelConfig(str(other), family="wan2.1-i2v"))
    assert processed.vae_fp not in (base.vae_fp, changed.vae_fp)  # the processor is part of the image encoder


def test_recipes_train_wan21_i2v():
    from latentmill.recipe import load_recipe
    from tests.conftest import REPO_ROOT

    recipe = load_recipe(REPO_ROOT / "configs" / "wan2.1-i2v-14b.yaml")
    assert (recipe.model.pretrained, recipe.model.family) == ("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "wan2.1-i2v")
    assert (recipe.trainer.mode, recipe.parallel.strategy, recipe.trainer.shift) == ("lora", "fsdp2", 3.0)
    assert (recipe.bucket.frame_step, recipe.bucket.max_frames, recipe.cache.max_sequence_length) == (4, 81, 512)
    full = load_recipe(REPO_ROOT / "configs" / "wan2.1-i2v-14b-full.yaml")
    assert (full.model.family, full.trainer.mode, full.parallel.strategy, full.parallel.hsdp_replicate) == (
        "wan2.1-i2v", "full", "fsdp2", 4)
    demo = load_recipe(REPO_ROOT / "configs" / "demo-wan2.1-i2v.yaml")
    assert demo.model.family == "wan2.1-i2v" and demo.model.tiny_recipe.endswith("data/tiny-wan2.1-i2v.yaml")


@pytest.mark.slow
@pytest.mark.heavy  # 10 s: the plan path itself runs in make test for the other families
def test_plan_counts_the_published_14b():
    from diffusers import WanTransformer3DModel as cls

    from latentmill.plan import plan_config, shipped_models_dir

    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(shipped_models_dir() / "Wan2.1-I2V-14B-480P-Diffusers"),
                                                subfolder="transformer"))
    total = sum(p.numel() for p in model.parameters())
    # Wan2.1-T2V-14B's 14,288,491,584 + the 36-channel patch embedding, the image projection and the image keys
    # and values of the 40 cross-attentions
    assert total == 16_394_878_784 and len(model.blocks) == 40
    lora = plan_config("configs/wan2.1-i2v-14b.yaml", nproc=8)
    assert lora["config"]["shipped_configs"] and lora["fits"]
    # rank 32 on to_q/k/v/out.0 of both attentions of 40 blocks, 5120 wide
    assert lora["trainable_params"] == 40 * 8 * 32 * (5120 + 5120) == 104_857_600
    assert lora["total_params"] == total + lora["trainable_params"]
