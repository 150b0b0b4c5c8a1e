"""Cache stage on the tiny Z-Image models: the cached latents and Qwen3 embeddings are what ``ZImagePipeline``
computes (its own ``encode_prompt`` and VAE path), the text stored at its real length."""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages.cache import load_pixels
from latentmill.stages.families import detect_family, family_class
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from safetensors.torch import load as load_tensors

from latentmill.models import ModelConfig
from latentmill.recipe import load_recipe
from tests.conftest import REPO_ROOT
from tests.helpers import prep_in_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def zcache(tiny_zimage, tmp_path_factory):
    out = tmp_path_factory.mktemp("zimage-prep")
    recipe = load_recipe(REPO_ROOT / "configs" / "demo-z-image.yaml",
                         [f"output_dir={out}", f"model.pretrained={tiny_zimage}",
                          f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'images'}"])
    sd, manifest, _ = prep_in_process(recipe)["cache"]
    return recipe, sd, manifest


def _samples(sd, manifest):
    for shard in manifest["shards"]:
        yield from read_shard(sd.root / shard["path"])


def test_family_streams_and_shapes(zcache, tiny_zimage):
    _, sd, manifest = zcache
    assert detect_family(ModelConfig(pretrained=str(tiny_zimage))) == "z-image"
    assert manifest["family"] == "z-image" and set(manifest["models"]) == {"vae", "text_encoder"}
    assert manifest["text"] == {"trimmed": True, "pad_to": 64}
    assert [(s["name"], s["pad"]) for s in manifest["streams"]] == [("latents", "none"), ("prompt_embeds", "mask")]
    assert manifest["models"]["vae"]["scaling_factor"] == pytest.approx(0.3611)
    n = 0
    for sample in _samples(sd, manifest):
        width, height, _ = json.loads(sample["json"])["bucket"]
        assert width % 16 == 0 and height % 16 == 0
        assert load_tensors(sample["vae.safetensors"])["latents"].shape == (16, height // 8, width // 8)
        embeds = load_tensors(sample["text.safetensors"])["prompt_embeds"]
        assert embeds.ndim == 2 and embeds.shape[1] == 32 and 10 < embeds.shape[0] <= 64
        n += 1
    assert n == manifest["counts"]["out"] == 24


def test_text_equals_the_pipeline_encode_prompt(zcache, tiny_zimage):
    """Each caption's stored tokens are ZImagePipeline.encode_prompt's list entry: same count, same values."""
    from diffusers import ZImagePipeline

    _, sd, manifest = zcache
    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    samples = list(_samples(sd, manifest))[:6]
    captions = [json.loads(s["json"])["caption"] for s in samples]
    expected, negative = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=64)
    assert negative == [] and len(expected) == len(captions)
    lengths = set()
    for sample, want in zip(samples, expected):
        got = load_tensors(sample["text.safetensors"])["prompt_embeds"]
        assert got.shape == want.shape  # the real tokens only, chat template included
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
        lengths.add(got.shape[0])
    assert len(lengths) > 1  # captions of different lengths: the trimming is per caption

    # the empty prompt (caption dropout) is the template around "" (6 tokens), as the pipeline encodes it
    empty = load_tensors((sd.root / manifest["empty_prompt"]["path"]).read_bytes())["prompt_embeds"]
    (want,) = pipe.encode_prompt("", do_classifier_free_guidance=False, max_sequence_length=64)[0]
    assert empty.shape == want.shape and empty.shape[0] > 1
    torch.testing.assert_close(empty, want.float(), atol=1e-5, rtol=1e-5)


def test_latents_equal_the_pipeline_vae_path(zcache, tiny_zimage):
    """latents = (mean - shift_factor) * scaling_factor: the inverse of what ZImagePipeline decodes."""
    from diffusers import ZImagePipeline

    _, sd, manifest = zcache
    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    src_dir = StageDir(sd.root.parent / "bucket", "bucket")
    raw = {s["__key__"]: s for b in src_dir.read_manifest()["shards"] for s in read_shard(src_dir.root / b["path"])}
    for sample in list(_samples(sd, manifest))[:3]:
        meta = json.loads(sample["json"])
        pixels = load_pixels(raw[sample["__key__"]]["image"], meta["crop"], meta["bucket"])[None]
        with torch.no_grad():
            mean = pipe.vae.encode(pixels).latent_dist.mean
        expected = (mean - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        got = load_tensors(sample["vae.safetensors"])["latents"]
        torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)
        # and the pipeline's decode inverts the normalisation: the same image as decoding the raw mean
        with torch.no_grad():
            via_pipe = pipe.vae.decode(got[None] / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor).sample
            direct = pipe.vae.decode(mean).sample
        torch.testing.assert_close(via_pipe, direct, atol=1e-4, rtol=1e-4)


def test_sample_shapes_estimate_the_stored_tensors(zcache, tiny_zimage):
    from latentmill.models import component_source, read_component_config

    recipe, _, _ = zcache
    cls = family_class("z-image")
    shapes = cls.sample_shapes(lambda name: read_component_config(component_source(recipe.model, name)),
                               [48, 64, 1], 64)
    assert shapes == {"latents": (16, 8, 6), "prompt_embeds": (64, 32)}
    # the published sizes when no config is at hand: Qwen3-4B's width 2560
    assert cls.sample_shapes(lambda name: {}, [1024, 1024, 1], 512)["prompt_embeds"] == (512, 2560)
