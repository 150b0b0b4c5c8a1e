"""Cache stage for Wan-class video: clip latents and UMT5 embeddings with the shapes the model expects."""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages.cache import load_clip_pixels
from latentmill.stages.tarshard import read_shard
from safetensors.torch import load as load_tensors

from latentmill.recipe import load_recipe
from tests.conftest import REPO_ROOT
from tests.helpers import prep_in_process


@pytest.fixture(scope="module")
def video_cache(tiny_wan, tmp_path_factory):
    out = tmp_path_factory.mktemp("video")
    recipe = load_recipe(REPO_ROOT / "configs" / "demo-video.yaml",
                         [f"output_dir={out}", f"model.pretrained={tiny_wan}",
                          f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}"])
    sd, manifest, _ = prep_in_process(recipe)["cache"]
    return recipe, sd, manifest


def _samples(sd, manifest):
    for shard in manifest["shards"]:
        for sample in read_shard(sd.root / shard["path"]):
            yield shard, sample


def test_clip_latents_have_the_wan_shapes(video_cache):
    _, sd, manifest = video_cache
    assert manifest["family"] == "wan" and set(manifest["models"]) == {"vae", "text_encoder"}
    assert manifest["text"] == {"trimmed": True, "pad_to": 32}
    assert len(manifest["models"]["vae"]["latents_mean"]) == 16
    n = 0
    for _shard, sample in _samples(sd, manifest):  # shards hold several buckets: each clip's is in its json
        width, height, frames = json.loads(sample["json"])["bucket"]
        latents = load_tensors(sample["vae.safetensors"])["latents"]
        assert latents.shape == (16, (frames - 1) // 4 + 1, height // 8, width // 8)
        embeds = load_tensors(sample["text.safetensors"])["prompt_embeds"]
        assert embeds.ndim == 2 and embeds.shape[1] == 32 and 1 <= embeds.shape[0] <= 32
        n += 1
    assert n == manifest["counts"]["out"] > 0


def test_clip_latents_match_the_vae_and_feed_the_transformer(video_cache, tiny_wan):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    _, sd, manifest = video_cache
    shard, sample = next(_samples(sd, manifest))
    meta = json.loads(sample["json"])
    vae = AutoencoderKLWan.from_pretrained(tiny_wan, subfolder="vae")
    with torch.no_grad():
        mean = vae.encode(load_clip_pixels(meta, sample)[None]).latent_dist.mean[0]
    mu = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    sigma = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    latents = load_tensors(sample["vae.safetensors"])["latents"]
    torch.testing.assert_close(latents, (mean - mu) / sigma, atol=1e-4, rtol=1e-4)

    transformer = WanTransformer3DModel.from_pretrained(tiny_wan, subfolder="transformer")
    embeds = load_tensors(sample["text.safetensors"])["prompt_embeds"]
    padded = torch.cat([embeds, embeds.new_zeros(32 - embeds.shape[0], embeds.shape[1])])[None]
    with torch.no_grad():
        pred = transformer(hidden_states=latents[None], timestep=torch.tensor([500.0]),
                           encoder_hidden_states=padded, return_dict=False)[0]
    assert pred.shape == latents[None].shape


def test_text_matches_wan_pipeline_encoding(video_cache, tiny_wan):
    from diffusers import WanPipeline

    _, sd, manifest = video_cache
    pipe = WanPipeline.from_pretrained(tiny_wan)
    _, sample = next(_samples(sd, manifest))
    caption = json.loads(sample["json"])["caption"]
    full, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=32)
    embeds = load_tensors(sample["text.safetensors"])["prompt_embeds"]
    torch.testing.assert_close(embeds, full[0, : embeds.shape[0]])
    assert bool((full[0, embeds.shape[0]:] == 0).all())  # what trimming dropped was zero padding
