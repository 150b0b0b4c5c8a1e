"""HunyuanVideo 1.5 image-to-video (family ``hunyuanvideo1.5-i2v``): the tiny model set, caching equal to
HunyuanVideo15ImageToVideoPipeline's own encode path (``prepare_cond_latents_and_mask``, ``encode_image``), the
adapter's forward equal to the pipeline's transformer call, and the checks that refuse what cannot train."""

from __future__ import annotations

import pytest
import torch
from latentmill.stages.families import FAMILIES, index_family
from latentmill.stages.family_hunyuanvideo1_5_i2v import HunyuanVideo15I2VEncoders, first_frame_images
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.hunyuan_video15 import hunyuan_video15_forward
from latentmill.trainer.hunyuan_video15_i2v import HunyuanVideo15I2VAdapter
from latentmill.trainer.loader import CacheFamilyError, check_streams

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig, tokenizer_source
from latentmill.tiny_hunyuan_video15 import I2V_RECIPE_PATH, load_recipe, measure_scaling_factor
from tests.helpers import assert_recipe_refused
from tests.trainer_helpers import torch_threads

CAPTION = 'a shop sign that reads "OPEN" in red letters'


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def pipe(tiny_hunyuan_video15_i2v):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    return HunyuanVideo15ImageToVideoPipeline.from_pretrained(tiny_hunyuan_video15_i2v)


def clip(frames=9, height=32, width=48, seed=0):
    """A moving gradient clip [1, 3, F, H, W] in [-1, 1], on the 8-bit grid (as decoded pixels are)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(1, 3, 1, height, width, generator=gen)
    shift = torch.linspace(0, 0.5, frames).view(1, 1, frames, 1, 1)
    return (((base + shift) % 1.0) * 255).round() / 127.5 - 1


def test_family_is_registered_with_its_streams():
    assert FAMILIES["hunyuanvideo1.5-i2v"] is HunyuanVideo15I2VEncoders
    assert isinstance(get_adapter("hunyuanvideo1.5-i2v"), HunyuanVideo15I2VAdapter)
    assert index_family({"_class_name": "HunyuanVideo15ImageToVideoPipeline"}) == "hunyuanvideo1.5-i2v"
    assert index_family({"_class_name": "HunyuanVideo15Pipeline"}) == "hunyuanvideo1.5"
    assert [s.name for s in HunyuanVideo15I2VEncoders.streams("vae")] == ["latents", "image_latents", "image_embeds"]
    assert [s.name for s in HunyuanVideo15I2VEncoders.streams("text")] == ["prompt_embeds", "prompt_embeds_2"]
    assert HunyuanVideo15I2VEncoders.PIXEL_COMPONENTS == ("vae", "image_encoder")
    # the published 480p I2V model (its config defaults): SigLIP so400m at 384 px, 14 px patches, 1152 wide
    shapes = HunyuanVideo15I2VEncoders.sample_shapes(lambda name: {}, [848, 480, 121], 1024)
    assert shapes == {"latents": (32, 31, 30, 53), "image_latents": (32, 1, 30, 53), "image_embeds": (729, 1152),
                      "prompt_embeds": (1000, 3584), "prompt_embeds_2": (256, 1472)}


def test_recipe_rules_name_the_key(tmp_path):
    data = load_recipe(I2V_RECIPE_PATH)
    assert data["components"]["transformer"]["task_type"] == "i2v" and "feature_extractor" in data["components"]
    assert_recipe_refused(tmp_path, load_recipe, I2V_RECIPE_PATH,
                          lambda data: data["components"]["transformer"].update(image_embed_dim=64),
                          r"components.transformer.image_embed_dim: 64 != components.image_encoder.hidden_size "
                          r"\(16\)")
    assert_recipe_refused(tmp_path, load_recipe, I2V_RECIPE_PATH, lambda data: data.update(vae_residual_scale=0),
                          r"^vae_residual_scale: 0 is not a number in \(0, 1\]; 1 keeps the VAE's random init$")


def test_validation_from_prompts_alone_is_refused_before_any_work():
    from latentmill.trainer.adapters import check_validation

    check_validation(0, "hunyuanvideo1.5-i2v")
    with pytest.raises(ConfigError, match=r"trainer.validate_every: 5, but the hunyuanvideo1.5-i2v family samples "
                                          r"from a source image"):
        check_validation(5, "hunyuanvideo1.5-i2v")


def test_a_cache_without_the_conditioning_streams_is_refused_in_one_line():
    adapter = get_adapter("hunyuanvideo1.5-i2v")
    streams = [s.to_json() for s in HunyuanVideo15I2VEncoders.STREAMS]
    check_streams({"family": "hunyuanvideo1.5-i2v", "streams": streams}, "hunyuanvideo1.5-i2v", adapter.streams,
                  "m.json")
    lacking = [s for s in streams if s["name"] not in ("image_latents", "image_embeds")]
    with pytest.raises(CacheFamilyError, match=r"^m.json: the cache holds the streams \['latents', 'prompt_embeds', "
                                               r"'prompt_embeds_2'\], the 'hunyuanvideo1.5-i2v' model reads .*: "
                                               r"image_latents, image_embeds missing; re-run latentmill prep$"):
        check_streams({"family": "hunyuanvideo1.5-i2v", "streams": lacking}, "hunyuanvideo1.5-i2v", adapter.streams,
                      "m.json")


@pytest.mark.slow
def test_cache_equals_the_pipelines_encode_path(tiny_hunyuan_video15_i2v, pipe):
    """image_latents = prepare_cond_latents_and_mask's frame 0 (the first frame alone, the VAE's argmax, scaled;
    zeros after it) and image_embeds = encode_image of the first frame, bit for bit; the SigLIP processor is read
    from the pipeline's feature_extractor/ and keys the VAE member."""
    model = ModelConfig(str(tiny_hunyuan_video15_i2v), family="hunyuanvideo1.5-i2v")
    assert tokenizer_source(model, "image_encoder").subfolder == "feature_extractor"
    encoders = HunyuanVideo15I2VEncoders(model, torch.device("cpu"))
    pixels = torch.cat([clip(), clip(seed=1)])
    streams = encoders.encode_conditions(pixels)
    image_latents, embeds = streams["image_latents"], streams["image_embeds"]
    assert image_latents.shape == (2, 16, 1, 2, 3) and embeds.shape == (2, 16, 16)
    cpu = torch.device("cpu")
    for b, image in enumerate(first_frame_images(pixels)):
        with torch.no_grad():
            condition, mask = pipe.prepare_cond_latents_and_mask(torch.zeros(1, 16, 3, 2, 3), image, 1, 32, 48,
                                                                 torch.float32, cpu)
            image_embeds = pipe.encode_image(image, 1, cpu, torch.float32)
        assert torch.equal(condition[:, :, :1], image_latents[b : b + 1]) and not condition[:, :, 1:].any()
        assert torch.equal(mask[:, :, 0], torch.ones(1, 1, 2, 3)) and not mask[:, :, 1:].any()
        assert torch.equal(embeds[b : b + 1], image_embeds)
    mean, _ = encoders.encode_pixels(pixels)
    assert float((mean[:, :, :1] - image_latents).abs().max()) > 0  # the first frame alone, not the clip's frame 0
    assert not torch.equal(embeds[0], embeds[1])


def corner_latents(vae, appearing: bool, scale: float) -> dict[str, torch.Tensor]:
    """Per corner, the latent mean [C, 2, 4, 4] times ``scale`` of a 5-frame 64 px clip with a 16 px dark mark in
    that corner, in frames 1-4 after a plain frame 0 (``appearing``) or in all five."""
    import numpy as np

    from tests.learning import CORNERS, LIGHT, marked_pixels

    latents = {}
    for corner in CORNERS:
        marked = marked_pixels(corner, 4, 64, 16)
        frames = np.stack([np.full_like(marked, LIGHT + 4) if appearing else marked] + [marked] * 4)
        pixels = torch.from_numpy(frames).float().permute(3, 0, 1, 2)[None] / 127.5 - 1
        with torch.no_grad():
            latents[corner] = vae.encode(pixels).latent_dist.mean[0] * scale
    return latents


def frame_1_spread(latents: dict[str, torch.Tensor]) -> list[float]:
    """The mean square difference of latent frame 1 between every two corners."""
    corners = list(latents)
    return [float(((latents[a][:, 1] - latents[b][:, 1]) ** 2).mean())
            for i, a in enumerate(corners) for b in corners[i + 1:]]


@pytest.mark.slow
def test_the_vae_keeps_a_mark_that_appears_after_the_first_frame(pipe):
    """The tiny set's VAE (residual branches scaled by the recipe's vae_residual_scale) puts a mark that appears in
    frames 1-4 into latent frame 1 as strongly as one there from frame 0: what the learning test
    (tests/test_learns_hunyuan_video15_i2v.py) asks the caption to decide. The same VAE at its random init's full
    scale keeps a hundredth of it; its scaling factor is the recipe's, measured."""
    from diffusers import AutoencoderKLHunyuanVideo15

    scale = pipe.vae.config.scaling_factor
    assert scale == pytest.approx(measure_scaling_factor(pipe.vae), rel=2e-3)
    appearing = frame_1_spread(corner_latents(pipe.vae, True, scale))
    present = frame_1_spread(corner_latents(pipe.vae, False, scale))
    # measured: appearing 0.21-0.23, present from frame 0 0.18-0.35 (latents about unit variance)
    assert min(appearing) > 0.15 and min(appearing) > 0.5 * max(present), (appearing, present)
    torch.manual_seed(0)
    unscaled = AutoencoderKLHunyuanVideo15.from_config(pipe.vae.config)  # the recipe's VAE before the scaling
    assert torch.equal(unscaled.encoder.conv_in.conv.weight, pipe.vae.encoder.conv_in.conv.weight)  # not scaled
    # measured: 0.0026-0.0041
    assert max(frame_1_spread(corner_latents(unscaled, True, measure_scaling_factor(unscaled)))) < 0.01


def context_spread(transformer, text_encoder, tokenizer) -> list[float]:
    """The mean square difference, between every two corner captions of the learning test, of the mean of their
    context tokens as the transformer's blocks take them in (the Qwen tokens the cache stores, through the
    ``context_embedder`` with ``cond_type_embed`` added, then the blocks' LayerNorm): a share of their mean square,
    about 1."""
    from diffusers import HunyuanVideo15Pipeline
    from latentmill.stages.family_hunyuanvideo1_5 import CROP_START

    from tests.learning import CORNERS

    captions = [f"a dark mark appears in the {c} corner" for c in CORNERS]
    with torch.no_grad():
        embeds, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            text_encoder, tokenizer, captions, torch.device("cpu"), tokenizer_max_length=32, crop_start=CROP_START)
        mask = mask.bool()
        tokens = (transformer.context_embedder(embeds, torch.full((4,), 500.0), mask)
                  + transformer.cond_type_embed(torch.zeros(mask.shape, dtype=torch.long)))
        tokens = torch.nn.functional.layer_norm(tokens, tokens.shape[-1:]) * mask[..., None]
        means = tokens.sum(1) / mask.sum(1, keepdim=True)
    return [float(((means[a] - means[b]) ** 2).mean()) for a in range(4) for b in range(a + 1, 4)]


@pytest.mark.slow
def test_the_captions_corner_reaches_the_transformers_context_tokens(pipe):
    """The tiny set's text encoder (the recipe's initializer_range: 0.3) gives the four corner captions of the
    learning test context tokens that differ by a few thousandths of their mean square; at its default init (0.02)
    the hidden states (0.02 wide) drown in what the transformer adds to them (the projection's bias,
    cond_type_embed): a millionth, and the caption's left or right was not learnt."""
    from transformers import Qwen2_5_VLTextModel

    spread = context_spread(pipe.transformer, pipe.text_encoder, pipe.tokenizer)
    # measured: 3.6e-3 (bottom left / bottom right) to 2.5e-2
    assert min(spread) > 1e-3, spread
    config = pipe.text_encoder.config
    assert config.initializer_range == 0.3
    config = config.__class__(**{**config.to_dict(), "initializer_range": 0.02})
    torch.manual_seed(0)
    default = Qwen2_5_VLTextModel(config).eval()  # the recipe's text encoder at the default init
    # measured: 1.0e-6 to 3.6e-6
    assert max(context_spread(pipe.transformer, default, pipe.tokenizer)) < 1e-5


def _capture(transformer):
    """Record the kwargs and output of every transformer call."""
    calls = []
    pre = transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
    post = transformer.register_forward_hook(lambda m, a, kw, out: calls[-1].update(out=out[0]), with_kwargs=True)
    return calls, (pre, post)


@pytest.mark.slow
def test_adapter_calls_the_transformer_like_the_pipeline(pipe):
    """On the pipeline's own inputs (its noisy latents, timestep / 1000 as sigma, both text streams with their
    masks, the image's latents and SigLIP tokens), the forward gives the pipeline's transformer output: bit for bit
    with the pipeline's padding, and to float rounding with the text trimmed to its real tokens (what training
    feeds); the condition and mask channels are the ones the adapter builds."""
    image = first_frame_images(clip())[0]
    calls, hooks = _capture(pipe.transformer)
    with torch.no_grad():
        pipe(image=image, prompt=CAPTION, num_frames=9, num_inference_steps=1, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    for hook in hooks:
        hook.remove()
    assert len(calls) == 2  # classifier-free guidance: the prompt, then the empty one
    adapter = get_adapter("hunyuanvideo1.5-i2v")
    c = pipe.vae.config.latent_channels
    for call in calls:
        hidden, embeds = call["hidden_states"], call["image_embeds"]
        assert hidden.shape[:3] == (1, 2 * c + 1, 3) and embeds.shape == (1, 16, 16) and embeds.abs().sum() > 0
        noisy, image_latents, sigma = hidden[:, :c], hidden[:, c : 2 * c, :1], call["timestep"] / 1000.0
        assert image_latents.abs().sum() > 0 and not hidden[:, c : 2 * c, 1:].any()
        streams = (call["encoder_hidden_states"], call["encoder_attention_mask"], call["encoder_hidden_states_2"],
                   call["encoder_attention_mask_2"])
        batch = {"latents": noisy, "image_latents": image_latents, "image_embeds": embeds,
                 "prompt_embeds": streams[0], "prompt_embeds_mask": streams[1].bool(),
                 "prompt_embeds_2": streams[2], "prompt_embeds_2_mask": streams[3].bool()}
        adapter.check_batch(pipe.transformer, batch)
        with torch.no_grad():
            exact = hunyuan_video15_forward(pipe.transformer, noisy, sigma, *streams, image_latents_BC1HW=image_latents,
                                            image_embeds_BSE=embeds)
            trained = adapter.forward(pipe.transformer, noisy, sigma, batch, None)
        assert torch.equal(exact, call["out"])
        torch.testing.assert_close(trained, call["out"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"image_embeds width is 8, the transformer takes 16 \(image_embed_dim\)"):
        adapter.check_batch(pipe.transformer, {**batch, "image_embeds": torch.zeros(1, 16, 8)})
    with pytest.raises(ValueError, match=r"image_latents have shape \(1, 16, 3, \d+, \d+\), expected one latent frame"):
        adapter.check_batch(pipe.transformer, {**batch, "image_latents": noisy})


@pytest.fixture(scope="module")
def i2v_cache(tiny_hunyuan_video15_i2v, tmp_path_factory):
    """The cache stage over two demo videos with configs/demo-hunyuanvideo1.5-i2v.yaml (no Prefect)."""
    import shutil

    from latentmill.recipe import load_recipe
    from tests.conftest import REPO_ROOT
    from tests.helpers import prep_in_process

    videos = tmp_path_factory.mktemp("videos")
    for name in ("ball_64x48_24fps", "square_64x64_8fps"):
        for ext in (".mp4", ".txt"):
            shutil.copy(REPO_ROOT / "data" / "demo" / "videos" / (name + ext), videos)
    out = tmp_path_factory.mktemp("hunyuan-i2v-prep")
    recipe = load_recipe(REPO_ROOT / "configs" / "demo-hunyuanvideo1.5-i2v.yaml",
                         [f"output_dir={out}", f"model.pretrained={tiny_hunyuan_video15_i2v}", f"ingest.source={videos}"])
    sd, manifest, _ = prep_in_process(recipe)["cache"]
    return sd, manifest


@pytest.mark.slow
def test_the_cache_stage_stores_the_pipelines_conditioning(i2v_cache, pipe):
    """Each cached clip's VAE member holds image_latents and image_embeds equal to what
    HunyuanVideo15ImageToVideoPipeline computes from the clip's first frame; the manifest records the streams and
    the image encoder's fingerprint."""
    import json

    from latentmill.stages.cache import load_clip_pixels
    from latentmill.stages.tarshard import read_shard
    from safetensors.torch import load as load_tensors

    sd, manifest = i2v_cache
    assert [s["name"] for s in manifest["streams"]] == ["latents", "image_latents", "image_embeds", "prompt_embeds",
                                                        "prompt_embeds_2"]
    assert set(manifest["models"]) == {"vae", "text_encoder", "text_encoder_2", "image_encoder"}
    samples = [s for shard in manifest["shards"] for s in read_shard(sd.root / shard["path"])]
    assert len(samples) >= 2
    cpu = torch.device("cpu")
    for sample in samples[:2]:
        meta, vae = json.loads(sample["json"]), load_tensors(sample["vae.safetensors"])
        assert set(vae) == {"latents", "image_latents", "image_embeds"}
        pixels = load_clip_pixels(meta, sample)[None]
        (image,) = first_frame_images(pixels)
        latents = torch.zeros(1, *vae["latents"].shape)
        with torch.no_grad():
            condition, _ = pipe.prepare_cond_latents_and_mask(latents, image, 1, *pixels.shape[-2:], torch.float32, cpu)
            image_embeds = pipe.encode_image(image, 1, cpu, torch.float32)
        # (encoded on the prep's threads: float rounding apart at most)
        torch.testing.assert_close(vae["image_latents"][None], condition[:, :, :1], rtol=0, atol=1e-5)
        torch.testing.assert_close(vae["image_embeds"][None], image_embeds, rtol=0, atol=1e-5)


def test_recipes_train_hunyuan_video15_i2v():
    from latentmill.recipe import load_recipe
    from tests.conftest import REPO_ROOT

    for name, mode in (("hunyuanvideo1.5-i2v-lora.yaml", "lora"), ("hunyuanvideo1.5-i2v-full.yaml", "full")):
        recipe = load_recipe(REPO_ROOT / "configs" / name)
        assert (recipe.model.pretrained, recipe.model.family) == ("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",
                                                                  "hunyuanvideo1.5-i2v")
        assert (recipe.trainer.mode, recipe.parallel.strategy, recipe.trainer.shift) == (mode, "fsdp2", 5.0)
        assert recipe.trainer.validate_every == 0  # the pipeline samples from an image
        assert (recipe.bucket.frame_step, recipe.bucket.max_frames, recipe.cache.max_sequence_length) == (4, 121, 1000)
    demo = load_recipe(REPO_ROOT / "configs" / "demo-hunyuanvideo1.5-i2v.yaml")
    assert demo.model.family == "hunyuanvideo1.5-i2v"
    assert demo.model.tiny_recipe.endswith("data/tiny-hunyuanvideo1.5-i2v.yaml")
    assert demo.bucket.step == 16 and demo.bucket.frame_counts == [5, 9, 17]


@pytest.mark.slow
@pytest.mark.heavy  # the plan path runs in make test for text-to-video (tests/test_hunyuan_video15.py), same model
def test_plan_counts_the_published_480p_i2v():
    from diffusers import HunyuanVideo15Transformer3DModel as cls

    from latentmill.models import read_component_config
    from latentmill.plan import plan_config, shipped_models_dir

    shipped = shipped_models_dir() / "HunyuanVideo-1.5-480p_i2v"
    config = cls.load_config(str(shipped), subfolder="transformer")
    assert (config["task_type"], config["in_channels"], config["image_embed_dim"]) == ("i2v", 65, 1152)
    with torch.device("meta"):
        model = cls.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    assert total == 8_326_608_160  # text-to-video's 8.3B: the image projection is in both
    from latentmill.core.fingerprints import ComponentSource

    siglip = read_component_config(ComponentSource(str(shipped), "image_encoder"))
    assert (siglip["image_size"] // siglip["patch_size"]) ** 2 == 729  # the pipeline's vision_num_semantic_tokens
    full = plan_config("configs/hunyuanvideo1.5-i2v-full.yaml", nproc=8)
    assert full["total_params"] == total and full["config"]["shipped_configs"] and full["fits"]
    lora = plan_config("configs/hunyuanvideo1.5-i2v-lora.yaml", nproc=8)
    assert lora["trainable_params"] == 56 * 4 * 32 * (2048 + 2048) == 29_360_128
