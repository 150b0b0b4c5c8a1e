"""HunyuanVideo 1.5 (family ``hunyuanvideo1.5``): the tiny model set, caching equal to the pipeline's encode path
(VAE latents, Qwen2.5-VL and ByT5 glyph streams with their masks), and the adapter's transformer call equal to
the pipeline's."""

from __future__ import annotations

import pytest
import torch
from latentmill.stages.families import FAMILIES, family_streams, index_family
from latentmill.stages.family_hunyuanvideo1_5 import HunyuanVideo15Encoders
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.hunyuan_video15 import HunyuanVideo15Adapter, hunyuan_video15_forward

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig
from latentmill.tiny_hunyuan_video15 import DEFAULT_RECIPE_PATH, load_recipe
from tests.helpers import assert_recipe_refused
from tests.trainer_helpers import torch_threads

CAPTIONS = ['a shop sign that reads "OPEN" in red letters', "a red ball rolls across a green table", ""]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def pipe(tiny_hunyuan_video15):
    from diffusers import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline.from_pretrained(tiny_hunyuan_video15)


def clip(frames=9, height=32, width=48, seed=0):
    """A moving gradient clip [1, 3, F, H, W] in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(1, 3, 1, height, width, generator=gen)
    shift = torch.linspace(0, 0.5, frames).view(1, 1, frames, 1, 1)
    return ((base + shift) % 1.0) * 2 - 1


def test_family_is_registered_with_its_streams():
    assert FAMILIES["hunyuanvideo1.5"] is HunyuanVideo15Encoders
    assert isinstance(get_adapter("hunyuanvideo1.5"), HunyuanVideo15Adapter)
    assert index_family({"_class_name": "HunyuanVideo15Pipeline"}) == "hunyuanvideo1.5"
    latents, text, glyph = (s.to_json() for s in family_streams("hunyuanvideo1.5"))
    assert (latents["shape"], latents["normalisation"]) == ("[C, 1 + (F - 1)/4, H/16, W/16]", "z * scaling_factor")
    assert (text["pad"], "pad_to" in text) == ("mask", False)  # padded to text.pad_to (max_sequence_length)
    assert (glyph["name"], glyph["pad"], glyph["pad_to"]) == ("prompt_embeds_2", "mask", 256)
    # the published 480p model (its config defaults): 32 channels, Qwen2.5-VL-7B 3584 wide, Glyph-ByT5 1472
    shapes = HunyuanVideo15Encoders.sample_shapes(lambda name: {}, [848, 480, 121], 1024)
    assert shapes == {"latents": (32, 31, 30, 53), "prompt_embeds": (1000, 3584), "prompt_embeds_2": (256, 1472)}


def test_recipe_rules_name_the_key(tmp_path):
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["components"]["transformer"].update(in_channels=32),
                          r"components.transformer.in_channels/out_channels: 32/16 != "
                          r"2 \* vae.latent_channels \+ 1 / vae.latent_channels \(33/16\)")
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["components"]["text_encoder"].update(num_hidden_layers=2),
                          r"num_hidden_layers: must be >= 3 \(the pipeline reads hidden_states")


@pytest.mark.slow
def test_tiny_set_is_a_hunyuan_video15_pipeline(pipe):
    from latentmill.tiny_hunyuan_video15 import prompt_template

    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (16, 4)
    assert pipe.transformer.config.in_channels == 2 * pipe.vae.config.latent_channels + 1
    assert pipe.scheduler.config.shift == 5.0 and pipe.guider.guidance_scale == 6.0
    template, crop = prompt_template()
    assert len(pipe.tokenizer(template.split("{}")[0]).input_ids) == crop == pipe.prompt_template_encode_start_idx
    chat = pipe.tokenizer.apply_chat_template([[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]],
                                              add_generation_prompt=True, tokenize=False)
    assert chat == ["<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.slow
def test_cache_equals_the_pipelines_encode_path(tiny_hunyuan_video15, pipe):
    """The cached latents are the VAE's scaled mean (the pipeline decodes ``latents / scaling_factor``); the text
    streams' real tokens are ``encode_prompt``'s, bit for bit, and their count is the pipeline's mask."""
    encoders = HunyuanVideo15Encoders(ModelConfig(str(tiny_hunyuan_video15), family="hunyuanvideo1.5"),
                                      torch.device("cpu"))
    pixels = torch.cat([clip(), clip(seed=1)])
    mean, std = encoders.encode_pixels(pixels)
    assert mean.shape == std.shape == (2, 16, 3, 2, 3)
    with torch.no_grad():
        for i in range(2):
            raw = pipe.vae.encode(pixels[i:i + 1]).latent_dist
            torch.testing.assert_close(mean[i:i + 1], raw.mean * 1.1341, rtol=0, atol=0)
            torch.testing.assert_close(std[i:i + 1], raw.std * 1.1341, rtol=0, atol=0)
        encoded = encoders.encode_text(CAPTIONS, 64)
        embeds, mask, glyph, glyph_mask = pipe.encode_prompt(CAPTIONS, device=torch.device("cpu"),
                                                             dtype=torch.float32, batch_size=3)
    assert embeds.shape == (3, 1000, 32) and glyph.shape == (3, 256, 32)
    assert encoded["lengths"] == mask.sum(1).int().tolist() and 0 < min(encoded["lengths"])
    assert encoded["prompt_embeds_2_lengths"] == glyph_mask.sum(1).int().tolist()
    assert encoded["prompt_embeds_2_lengths"][0] == len('Text "OPEN". ') + 1  # bytes and </s>
    assert encoded["prompt_embeds_2_lengths"][1:] == [0, 0]  # no quoted text: no glyph token
    for i in range(3):
        n, g = encoded["lengths"][i], encoded["prompt_embeds_2_lengths"][i]
        assert torch.equal(encoded["prompt_embeds"][i, :n], embeds[i][mask[i].bool()])
        assert torch.equal(encoded["prompt_embeds_2"][i, :g], glyph[i][glyph_mask[i].bool()])
        assert not encoded["prompt_embeds"][i, n:].any() and not encoded["prompt_embeds_2"][i, g:].any()


def _capture(transformer):
    """Record the kwargs and output of every transformer call."""
    calls = []
    pre = transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
    post = transformer.register_forward_hook(lambda m, a, kw, out: calls[-1].update(out=out[0]), with_kwargs=True)
    return calls, (pre, post)


@pytest.mark.slow
def test_adapter_calls_the_transformer_like_the_pipeline(pipe):
    """On the pipeline's own inputs (its noisy latents, its timestep / 1000 as sigma, both text streams with their
    masks, conditional and unconditional), the adapter's call gives the pipeline's transformer output: bit for bit
    with the pipeline's padding and 729 zero image tokens, and to float rounding with the text trimmed to its
    real tokens and one image token (what training feeds)."""
    calls, hooks = _capture(pipe.transformer)
    with torch.no_grad():
        pipe(prompt=CAPTIONS[0], height=32, width=48, num_frames=9, num_inference_steps=1, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    for hook in hooks:
        hook.remove()
    assert len(calls) == 2  # classifier-free guidance: the prompt, then the empty one
    adapter = get_adapter("hunyuanvideo1.5")
    for call in calls:
        hidden, c = call["hidden_states"], pipe.vae.config.latent_channels
        assert hidden.shape == (1, 2 * c + 1, 3, 2, 3) and not hidden[:, c:].any()
        assert call["image_embeds"].shape == (1, 729, 16) and not call["image_embeds"].any()
        noisy, sigma = hidden[:, :c], call["timestep"] / 1000.0
        streams = (call["encoder_hidden_states"], call["encoder_attention_mask"], call["encoder_hidden_states_2"],
                   call["encoder_attention_mask_2"])
        with torch.no_grad():
            exact = hunyuan_video15_forward(pipe.transformer, noisy, sigma, *streams, image_tokens=729)
            batch = {"prompt_embeds": streams[0], "prompt_embeds_mask": streams[1].bool(),
                     "prompt_embeds_2": streams[2], "prompt_embeds_2_mask": streams[3].bool()}
            trained = adapter.forward(pipe.transformer, noisy, sigma, batch, None)
        assert torch.equal(exact, call["out"])
        torch.testing.assert_close(trained, call["out"], rtol=1e-5, atol=1e-5)
    assert calls[0]["encoder_attention_mask_2"].sum() > 0 and calls[1]["encoder_attention_mask_2"].sum() == 0


def test_recipes_sample_as_hunyuan_video15():
    from latentmill.stages.bucket import bucket_sizes

    from latentmill.recipe import load_recipe

    configs = DEFAULT_RECIPE_PATH.parents[1] / "configs"
    for name, mode in (("hunyuanvideo1.5-t2v-lora.yaml", "lora"), ("hunyuanvideo1.5-t2v-full.yaml", "full")):
        recipe = load_recipe(configs / name)
        assert (recipe.model.pretrained, recipe.model.family) == ("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
                                                                  "hunyuanvideo1.5")
        assert (recipe.trainer.mode, recipe.parallel.strategy) == (mode, "fsdp2")
        assert (recipe.trainer.shift_mode, recipe.trainer.shift) == ("fixed", 5.0)
        assert (recipe.bucket.frame_step, recipe.bucket.max_frames, recipe.cache.max_sequence_length) == (4, 121, 1000)
        sizes = bucket_sizes(recipe.bucket)
        assert sizes[1.7778] == (848, 480) and all(w % 16 == 0 and h % 16 == 0 for w, h in sizes.values())
    demo = load_recipe(configs / "demo-hunyuanvideo1.5.yaml")
    assert demo.model.family == "hunyuanvideo1.5" and demo.model.tiny_recipe.endswith("data/tiny-hunyuanvideo1.5.yaml")
    assert demo.bucket.step == 16 and demo.bucket.frame_counts == [5, 9, 17]


@pytest.mark.slow
@pytest.mark.heavy  # a family's repeat of plan on the meta device (test_plan.py runs FLUX.1's and Wan's)
def test_plan_counts_the_published_8_3b():
    from diffusers import HunyuanVideo15Transformer3DModel as cls

    from latentmill.plan import plan_config, shipped_models_dir

    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(shipped_models_dir() / "HunyuanVideo-1.5-480p_t2v"),
                                                subfolder="transformer"))
    total = sum(p.numel() for p in model.parameters())
    assert total == 8_326_608_160 and len(model.transformer_blocks) == 54  # "8.3B"
    full = plan_config("configs/hunyuanvideo1.5-t2v-full.yaml", nproc=8)
    last = model.transformer_blocks[-1]
    frozen = sum(p.numel() for m in (last.attn.to_add_out, last.ff_context) for p in m.parameters())
    assert full["total_params"] == total and full["trainable_params"] == total - frozen
    assert full["config"]["shipped_configs"] and full["fits"]
    assert full["per_rank"]["optimizer_bytes"] == 2 * full["per_rank"]["grads_bytes"]
    lora = plan_config("configs/hunyuanvideo1.5-t2v-lora.yaml", nproc=8)
    # rank 32 on to_q/k/v/out.0 (2048 wide) of the 54 blocks and the 2 text-refiner blocks
    assert lora["trainable_params"] == 56 * 4 * 32 * (2048 + 2048) == 29_360_128
    assert lora["total_params"] == total + lora["trainable_params"]


def test_a_too_short_clip_and_a_wrong_frame_step_name_the_4k_plus_1_rule():
    from latentmill.stages.bucket import BucketConfig
    from latentmill.stages.video import plan_clips, too_short_reason

    from latentmill.preflight import check_bucket
    from latentmill.recipe import load_recipe

    demo = load_recipe(DEFAULT_RECIPE_PATH.parents[1] / "configs" / "demo-hunyuanvideo1.5.yaml")
    policy = demo.bucket.clip_policy()
    assert plan_clips(12, 24, policy) == []  # 12 frames at 24 fps: 4 frames at the demo's 8 fps
    assert too_short_reason(12, 24, policy) == (
        "video too short: 12 frames at 24 fps give 4 frames at 8 fps; the smallest bucket needs 5 frames "
        "(bucket.frame_counts; clips are 4k+1 frames, bucket.frame_step)")
    check_bucket("hunyuanvideo1.5", BucketConfig(frame_step=4))
    check_bucket("hunyuanvideo1.5", BucketConfig(frame_step=8))  # 9, 17, ...: 4k+1 lengths all
    check_bucket("flux", BucketConfig(frame_step=3))  # an image family has no rule
    with pytest.raises(ConfigError, match=r"bucket.frame_step: clips of \[3, 7, 11, 15\] frames, but hunyuanvideo1.5 "
                                          r"takes clips of 4k\+1 frames .*; set bucket.frame_step: 4"):
        check_bucket("hunyuanvideo1.5", BucketConfig(frame_step=2))
