"""Cache stage on the tiny Qwen-Image models: the cached streams are what ``QwenImagePipeline`` computes.

* ``prompt_embeds``: the real tokens of ``QwenImagePipeline.encode_prompt`` (chat template, last hidden layer,
  the 34-token prefix dropped, cut at ``max_sequence_length``), trimmed (a ``mask`` stream);
* ``latents``: the pipelines' VAE path (``_encode_vae_image``: one-frame clip, ``(z - mean) / std``).
"""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache import CacheConfig, load_pixels
from latentmill.stages.curate import CurateConfig
from latentmill.stages.families import FAMILIES, PIPELINE_FAMILIES, family_class
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from safetensors.torch import load as load_tensors

from latentmill.models import ModelConfig
from latentmill.recipe import Recipe
from tests.helpers import prep_in_process

MAX_LEN = 20  # shorter than some demo captions: the cut at max_sequence_length is exercised



@pytest.fixture(scope="module")
def cached(tiny_qwen_image, tmp_path_factory):
    from tests.conftest import DEMO_IMAGES

    model = ModelConfig(pretrained=str(tiny_qwen_image))
    cfg = CacheConfig(dtype="float32", batch_size=3, max_sequence_length=MAX_LEN, latents="distribution")
    recipe = Recipe(output_dir=str(tmp_path_factory.mktemp("prep")), model=model,
                    ingest=IngestConfig(source=str(DEMO_IMAGES), shard_size=8), curate=CurateConfig(max_exposure=0.5),
                    bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]), cache=cfg)
    sd, manifest, records = prep_in_process(recipe)["cache"]
    samples = [s for shard in manifest["shards"] for s in read_shard(sd.root / shard["path"])]
    return model, sd, manifest, samples


def test_family_is_registered_and_detected():
    assert FAMILIES["qwen-image"] is family_class("qwen-image")
    assert PIPELINE_FAMILIES["QwenImagePipeline"] == "qwen-image"
    streams = {s.name: s.pad for s in family_class("qwen-image").STREAMS}
    assert streams == {"latents": "none", "prompt_embeds": "mask"}


@pytest.mark.slow
def test_manifest_streams_and_shapes(cached):
    _, _, manifest, samples = cached
    assert manifest["family"] == "qwen-image" and manifest["counts"]["out"] == 24
    assert manifest["text"] == {"trimmed": True, "pad_to": MAX_LEN}  # trim_text auto trims a mask stream
    assert [(s["name"], s["pad"]) for s in manifest["streams"]] == [("latents", "none"), ("prompt_embeds", "mask")]
    assert manifest["models"]["vae"]["class"] == "AutoencoderKLQwenImage"
    assert manifest["models"]["text_encoder"]["class"] == "Qwen2_5_VLForConditionalGeneration"
    lengths = set()
    for sample in samples:
        width, height, _ = json.loads(sample["json"])["bucket"]
        vae = load_tensors(sample["vae.safetensors"])
        assert vae["latents"].shape == (16, height // 8, width // 8) == vae["latents_std"].shape
        embeds = load_tensors(sample["text.safetensors"])["prompt_embeds"]
        assert embeds.shape[1] == 32 and 1 <= embeds.shape[0] <= MAX_LEN
        lengths.add(embeds.shape[0])
    assert MAX_LEN in lengths and min(lengths) < MAX_LEN  # some captions cut, some shorter: real lengths vary


@pytest.mark.slow
def test_text_equals_the_pipeline_encode_prompt(cached):
    from diffusers import QwenImagePipeline

    model, _, _, samples = cached
    pipe = QwenImagePipeline.from_pretrained(model.pretrained)
    captions = [json.loads(s["json"])["caption"] for s in samples[:6]]
    stored = [load_tensors(s["text.safetensors"])["prompt_embeds"] for s in samples[:6]]
    for caption, embeds in zip(captions, stored):  # one caption at a time, as the pipeline's __call__ does
        expected, mask = pipe.encode_prompt(caption, max_sequence_length=MAX_LEN)
        assert mask is None  # a single caption: every token is real, the pipeline passes no mask
        assert expected.shape[1] == embeds.shape[0]
        torch.testing.assert_close(embeds, expected[0], atol=1e-5, rtol=1e-5)
    # a batch: zero-padded to its longest caption with a mask whose row sums are the stored lengths
    expected, mask = pipe.encode_prompt(captions, max_sequence_length=MAX_LEN)
    assert mask.sum(1).tolist() == [e.shape[0] for e in stored]
    for i, embeds in enumerate(stored):
        torch.testing.assert_close(embeds, expected[i, : len(embeds)], atol=1e-5, rtol=1e-5)
        assert not expected[i, len(embeds):].any()


@pytest.mark.slow
def test_empty_prompt_is_the_template_suffix(cached):
    _, sd, manifest, _ = cached
    empty = load_tensors((sd.root / manifest["empty_prompt"]["path"]).read_bytes())
    # "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n": what follows the dropped prefix of an empty prompt
    assert empty["prompt_embeds"].shape == (5, 32)


@pytest.mark.slow
def test_latents_equal_the_pipeline_vae_path(cached):
    """The img2img pipeline's ``_encode_vae_image`` samples ``mean + std * eps`` and normalises it; with the
    same generator, that is the cached (normalised) mean plus the cached std times the same ``eps``."""
    from diffusers import QwenImageImg2ImgPipeline
    from diffusers.utils.torch_utils import randn_tensor

    model, sd, _, samples = cached
    pipe = QwenImageImg2ImgPipeline.from_pretrained(model.pretrained)
    src_dir = StageDir(sd.root.parent / "bucket", "bucket")
    raw = {s["__key__"]: s for b in src_dir.read_manifest()["shards"] for s in read_shard(src_dir.root / b["path"])}
    for sample in samples[:3]:
        meta = json.loads(sample["json"])
        pixels = load_pixels(raw[sample["__key__"]]["image"], meta["crop"], meta["bucket"])[None, :, None]
        with torch.no_grad():
            got = pipe._encode_vae_image(pixels, torch.Generator().manual_seed(7))[:, :, 0]
        vae = load_tensors(sample["vae.safetensors"])
        eps = randn_tensor((1, 16, 1, *vae["latents"].shape[1:]), generator=torch.Generator().manual_seed(7))[:, :, 0]
        torch.testing.assert_close(got[0], vae["latents"] + vae["latents_std"] * eps[0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_cpu_encodes_a_batch_in_one_vae_call(tiny_qwen_image):
    """On the CPU a batch goes through the VAE in one call, as the pipeline's ``_encode_vae_image`` takes it: bit
    for bit the VAE's own batched encode (one call per image, which the cache once made, is slower and differs
    in the last bits)."""
    encoders = family_class("qwen-image")(ModelConfig(pretrained=str(tiny_qwen_image)), torch.device("cpu"))
    pixels = torch.rand(4, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, std = encoders.encode_latents(pixels)
    vae = encoders.vae
    with torch.no_grad():
        dist = vae.encode(pixels[:, :, None]).latent_dist
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    latents_std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    assert mean.shape == std.shape == (4, 16, 8, 6)
    assert torch.equal(mean, ((dist.mode() - latents_mean) / latents_std)[:, :, 0])
    assert torch.equal(std, (dist.std / latents_std)[:, :, 0])
