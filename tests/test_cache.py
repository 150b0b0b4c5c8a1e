"""Cache stage on the tiny Flux models: shapes, dtypes, values, fingerprints, quarantine, determinism."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as load_tensors

from latentmill.models import (
    CacheMismatchError,
    ModelConfig,
    cached_model_fingerprints,
    check_cache_compatible,
)
from latentmill.recipe import Recipe
from pipelines.prep import STAGES, manifest_header, plan_stage, stage_processor
from stages import cache
from stages.bucket import BucketConfig
from stages.cache import CacheConfig, get_encoders, load_pixels
from stages.ingest import IngestConfig
from stages.shardio import StageDir, read_shard


def _prep(src, root, model, cache_cfg):
    """Run the four stages in this process (no Prefect) through the flow's own plan/process functions."""
    recipe = Recipe(output_dir=str(root), model=model, ingest=IngestConfig(source=str(src), shard_size=8),
                    bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]), cache=cache_cfg)
    for name in STAGES:
        sd = StageDir(recipe.stage_dir(name), name).ensure()
        records = [sd.run_unit(u, stage_processor(name, recipe)) for u in plan_stage(name, recipe)]
        manifest = sd.write_manifest(records, manifest_header(name, recipe))
    return sd, manifest, records


@pytest.fixture(scope="module")
def cached(tiny_flux, tmp_path_factory):
    from tests.conftest import DEMO_IMAGES

    model = ModelConfig(pretrained=str(tiny_flux))
    root = tmp_path_factory.mktemp("prep")
    cfg = CacheConfig(dtype="bfloat16", batch_size=3, max_sequence_length=16)
    sd, manifest, records = _prep(DEMO_IMAGES, root, model, cfg)
    return model, cfg, sd, manifest, records


def test_latent_and_text_shapes_and_dtypes(cached):
    model, cfg, sd, manifest, _ = cached
    assert manifest["counts"] == {"in": 25, "out": 24, "quarantined": 1}
    assert manifest["dtype"] == "bfloat16" and manifest["max_sequence_length"] == 16
    n = 0
    for shard in manifest["shards"]:
        width, height, frames = shard["bucket"]
        for sample in read_shard(sd.root / shard["path"]):
            assert set(sample) == {"__key__", "vae.safetensors", "text.safetensors", "json"}
            latents = load_tensors(sample["vae.safetensors"])["latents"]
            text = load_tensors(sample["text.safetensors"])
            assert latents.shape == (16, height // 8, width // 8) and latents.dtype == torch.bfloat16
            assert text["prompt_embeds"].shape == (16, 32) and text["prompt_embeds"].dtype == torch.bfloat16
            assert text["pooled_prompt_embeds"].shape == (32,)
            meta = json.loads(sample["json"])
            assert meta["bucket"] == [width, height, frames] and meta["caption"]
            n += 1
    assert n == 24


def test_truncated_image_is_quarantined_at_decode(cached):
    *_, sd, manifest, records = cached
    (q,) = [q for r in records for q in r.quarantined]
    assert q["source"] == "truncated.jpg" and q["stage"] == "cache"
    assert q["reason"].startswith("cannot decode pixels")


def test_latents_match_a_direct_vae_encode(cached):
    model, cfg, sd, manifest, _ = cached
    from diffusers import AutoencoderKL

    shard = manifest["shards"][0]
    sample = next(read_shard(sd.root / shard["path"]))
    meta = json.loads(sample["json"])
    src_dir = StageDir(sd.root.parent / "bucket", "bucket")
    raw = next(s for b in src_dir.read_manifest()["shards"] for s in read_shard(src_dir.root / b["path"])
               if s["__key__"] == sample["__key__"])
    image = raw.get("jpg") or raw.get("png")
    vae = AutoencoderKL.from_pretrained(model.pretrained, subfolder="vae")
    with torch.no_grad():
        mean = vae.encode(load_pixels(image, meta["crop"], meta["bucket"])[None]).latent_dist.mean[0]
    expected = (mean - vae.config.shift_factor) * vae.config.scaling_factor
    got = load_tensors(sample["vae.safetensors"])["latents"].float()
    torch.testing.assert_close(got, expected.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)


def test_text_embeddings_match_the_pipeline_encode_prompt(cached):
    model, cfg, sd, manifest, _ = cached
    from diffusers import FluxPipeline

    sample = next(read_shard(sd.root / manifest["shards"][0]["path"]))
    caption_text = json.loads(sample["json"])["caption"]
    pipe = FluxPipeline.from_pretrained(model.pretrained)
    embeds, pooled, _ = pipe.encode_prompt(caption_text, prompt_2=None, max_sequence_length=16)
    text = load_tensors(sample["text.safetensors"])
    torch.testing.assert_close(text["prompt_embeds"].float(), embeds[0].to(torch.bfloat16).float())
    torch.testing.assert_close(text["pooled_prompt_embeds"].float(), pooled[0].to(torch.bfloat16).float())


def test_manifest_records_model_fingerprints(cached):
    model, _, _, manifest, _ = cached
    prints = cached_model_fingerprints(model)
    assert {k: v["fingerprint"] for k, v in manifest["models"].items()} == prints
    assert manifest["models"]["vae"]["class"] == "AutoencoderKL"
    assert manifest["models"]["vae"]["scaling_factor"] == pytest.approx(0.3611)
    check_cache_compatible(manifest, model)  # no error


def test_swapped_vae_is_refused_and_changes_cache_keys(cached, tmp_path):
    model, cfg, sd, manifest, _ = cached
    from latentmill.tiny import build_tiny_flux

    other = build_tiny_flux(tmp_path / "other", seed=1)
    swapped = ModelConfig(pretrained=model.pretrained, vae=str(other / "vae"))
    with pytest.raises(CacheMismatchError, match="vae: cache was made with fingerprint"):
        check_cache_compatible(manifest, swapped)
    upstream = StageDir(sd.root.parent / "bucket", "bucket")  # prep/bucket beside prep/cache
    old = {u.unit_id for u in cache.plan(cfg, model, upstream)}
    new = {u.unit_id for u in cache.plan(cfg, swapped, upstream)}
    assert old.isdisjoint(new)


def test_cache_is_byte_reproducible(cached, tmp_path):
    from tests.conftest import DEMO_IMAGES

    model, cfg, _, manifest, _ = cached
    _, again, records = _prep(DEMO_IMAGES, tmp_path, model, cfg)
    assert [(s["name"], s["sha256"]) for s in again["shards"]] == [(s["name"], s["sha256"]) for s in manifest["shards"]]
    assert not any(r.reused for r in records)  # a fresh folder: every unit really ran


def test_encoders_are_loaded_once(cached):
    model, cfg, *_ = cached
    assert get_encoders(model, cfg) is get_encoders(model, cfg)
