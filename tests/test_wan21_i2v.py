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
    import yaml

    data = load_recipe(I2V_RECIPE_PATH)
    assert data["components"]["transformer"]["in_channels"] == 36
    data["components"]["transformer"]["in_channels"] = 16
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"components.transformer.in_channels/out_channels: 16/16 != 36/16 "
                                          r"\(vae.z_dim 16, in: 2 x z_dim \+ 4 with an image_encoder\)"):
        load_recipe(bad)
    data = load_recipe(I2V_RECIPE_PATH)
    data["components"]["transformer"]["image_dim"] = 64
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"components.transformer.image_dim: 64 != components.image_encoder"):
        load_recipe(bad)


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
