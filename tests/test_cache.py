"""Cache stage on the tiny Flux models: shapes, dtypes, values, fingerprints, quarantine, determinism."""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages import cache
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache import CacheConfig, load_pixels
from latentmill.stages.curate import CurateConfig
from latentmill.stages.families import get_encoders
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from safetensors.torch import load as load_tensors

from latentmill.models import (
    CacheMismatchError,
    ModelConfig,
    cached_model_fingerprints,
    check_cache_compatible,
)
from latentmill.recipe import Recipe
from tests.helpers import prep_in_process


def _prep(src, root, model, cache_cfg):
    """Run the four stages in this process; return the cache stage's folder, manifest and records."""
    recipe = Recipe(output_dir=str(root), model=model, ingest=IngestConfig(source=str(src), shard_size=8),
                    curate=CurateConfig(max_exposure=0.5),  # the demo's two over-exposed pictures stay out
                    bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]), cache=cache_cfg)
    return prep_in_process(recipe)["cache"]


@pytest.fixture(scope="module")
def cached(tiny_flux, tmp_path_factory):
    from tests.conftest import DEMO_IMAGES

    model = ModelConfig(pretrained=str(tiny_flux))
    root = tmp_path_factory.mktemp("prep")
    cfg = CacheConfig(dtype="bfloat16", batch_size=3, max_sequence_length=16, shard_bytes=65536)  # several shards
    sd, manifest, records = _prep(DEMO_IMAGES, root, model, cfg)
    return model, cfg, sd, manifest, records


def test_latent_and_text_shapes_and_dtypes(cached):
    model, cfg, sd, manifest, _ = cached
    assert manifest["counts"] == {"in": 24, "out": 24, "quarantined": 0}
    assert manifest["dtype"] == "bfloat16" and manifest["max_sequence_length"] == 16
    assert (manifest["format_version"], manifest["family"], manifest["latents"]) == (3, "flux", "mean")
    assert manifest["text"] == {"trimmed": False, "pad_to": 16}
    n = 0
    for shard in manifest["shards"]:  # shards hold several buckets (layout 2): each sample's is in its json
        for sample in read_shard(sd.root / shard["path"]):
            width, height, frames = json.loads(sample["json"])["bucket"]
            assert set(sample) == {"__key__", "vae.safetensors", "text.safetensors", "json"}
            assert set(load_tensors(sample["vae.safetensors"])) == {"latents"}
            latents = load_tensors(sample["vae.safetensors"])["latents"]
            text = load_tensors(sample["text.safetensors"])
            assert latents.shape == (16, height // 8, width // 8) and latents.dtype == torch.bfloat16
            assert text["prompt_embeds"].shape == (16, 32) and text["prompt_embeds"].dtype == torch.bfloat16
            assert text["pooled_prompt_embeds"].shape == (32,)
            meta = json.loads(sample["json"])
            assert meta["bucket"] == [width, height, frames] and meta["caption"]
            n += 1
    assert n == 24


def test_truncated_image_is_quarantined_where_it_is_first_decoded(cached):
    from tests.conftest import DEMO_IMAGES

    *_, sd, manifest, records = cached
    assert not [q for r in records for q in r.quarantined]  # the cache never sees it
    curated = [json.loads(line) for line in (sd.root.parent / "curate" / "quarantine.jsonl").read_text().splitlines()]
    (q,) = [q for q in curated if q["source"] == "truncated.jpg"]
    assert q["stage"] == "curate" and q["reason"].startswith("cannot decode pixels: OSError")
    # bytes damaged after curation still stop at the cache's decode (its unit quarantines what raises)
    with pytest.raises(OSError, match="truncated"):
        cache.decode_sample({"image": (DEMO_IMAGES / "truncated.jpg").read_bytes()}, {"crop": {}, "bucket": [64, 64, 1]})


def test_latents_match_a_direct_vae_encode(cached):
    model, cfg, sd, manifest, _ = cached
    from diffusers import AutoencoderKL

    shard = manifest["shards"][0]
    sample = next(read_shard(sd.root / shard["path"]))
    meta = json.loads(sample["json"])
    src_dir = StageDir(sd.root.parent / "bucket", "bucket")
    raw = next(s for b in src_dir.read_manifest()["shards"] for s in read_shard(src_dir.root / b["path"])
               if s["__key__"] == sample["__key__"])
    image = raw["image"]
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
    """A second clean run gives the same bytes; it decodes in a read-ahead thread (prefetch on), the first
    one in line (prefetch "auto" is off on the CPU), which must not change a byte either."""
    import dataclasses

    from tests.conftest import DEMO_IMAGES

    model, cfg, _, manifest, _ = cached
    assert cfg.prefetch == "auto"
    _, again, records = _prep(DEMO_IMAGES, tmp_path, model, dataclasses.replace(cfg, prefetch=True))
    assert [(s["name"], s["sha256"]) for s in again["shards"]] == [(s["name"], s["sha256"]) for s in manifest["shards"]]
    assert not any(r.reused for r in records)  # a fresh folder: every unit really ran


def test_encoders_are_loaded_once(cached):
    model, *_ = cached
    assert get_encoders(model, "flux", torch.device("cpu")) is get_encoders(model, "flux", torch.device("cpu"))


def _latents_by_source(sd, manifest):
    out = {}
    for shard in manifest["shards"]:
        for sample in read_shard(sd.root / shard["path"]):
            out[json.loads(sample["json"])["source"]] = sample
    return out


def test_recaption_reencodes_text_only_and_vae_swap_reencodes_latents_only(tiny_flux, demo_images, tmp_path):
    from latentmill.tiny import build_tiny_flux

    model = ModelConfig(pretrained=str(tiny_flux))
    cfg = CacheConfig(dtype="float32", batch_size=4, max_sequence_length=16)
    sd, first, records = _prep(demo_images, tmp_path, model, cfg)
    assert cache.component_report(records)["components"] == {"vae": {"processed": 24, "reused": 0},
                                                             "text": {"processed": 24, "reused": 0}}
    before = _latents_by_source(sd, first)

    # One new caption: its shard's unit re-runs, but only one text embedding is computed.
    (demo_images / "img_005.txt").write_text("a brand new caption\n")
    sd, second, records = _prep(demo_images, tmp_path, model, cfg)
    report = cache.component_report(records)["components"]
    assert report["text"] == {"processed": 1, "reused": 23}
    assert report["vae"] == {"processed": 0, "reused": 24}
    after = _latents_by_source(sd, second)
    assert after["img_005.jpg"]["vae.safetensors"] == before["img_005.jpg"]["vae.safetensors"]
    assert after["img_005.jpg"]["text.safetensors"] != before["img_005.jpg"]["text.safetensors"]
    assert after["img_007.jpg"]["text.safetensors"] == before["img_007.jpg"]["text.safetensors"]

    # Another VAE: every latent is re-encoded, every text embedding reused.
    other_vae = build_tiny_flux(tmp_path / "other", seed=3) / "vae"
    swapped = ModelConfig(pretrained=str(tiny_flux), vae=str(other_vae))
    sd, third, records = _prep(demo_images, tmp_path, swapped, cfg)
    report = cache.component_report(records)["components"]
    assert report == {"vae": {"processed": 24, "reused": 0}, "text": {"processed": 0, "reused": 24}}
    assert third["models"]["vae"]["fingerprint"] != second["models"]["vae"]["fingerprint"]
    assert third["models"]["text_encoder_2"] == second["models"]["text_encoder_2"]


def test_trimmed_text_distribution_latents_and_empty_prompt(tiny_flux, tmp_path):
    from tests.conftest import DEMO_IMAGES

    model = ModelConfig(pretrained=str(tiny_flux))
    cfg = CacheConfig(dtype="float32", max_sequence_length=32, trim_text="always", latents="distribution")
    sd, manifest, records = _prep(DEMO_IMAGES, tmp_path, model, cfg)
    assert manifest["text"] == {"trimmed": True, "pad_to": 32} and manifest["latents"] == "distribution"
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    for sample in list(_latents_by_source(sd, manifest).values())[:5]:
        caption_text = json.loads(sample["json"])["caption"]
        n_tokens = int(pipe.tokenizer_2(caption_text, max_length=32, truncation=True).input_ids.__len__())
        text = load_tensors(sample["text.safetensors"])
        assert text["prompt_embeds"].shape == (n_tokens, 32)
        full, _, _ = pipe.encode_prompt(caption_text, prompt_2=None, max_sequence_length=32)
        torch.testing.assert_close(text["prompt_embeds"], full[0, :n_tokens])
        vae = load_tensors(sample["vae.safetensors"])
        assert vae["latents_std"].shape == vae["latents"].shape and bool((vae["latents_std"] > 0).all())

    empty = load_tensors((sd.root / manifest["empty_prompt"]["path"]).read_bytes())
    assert empty["pooled_prompt_embeds"].shape == (32,)
    assert empty["prompt_embeds"].shape == (1, 32)  # the empty caption is just the EOS token
    sizes = cache.component_report(records)["bytes_per_sample"]
    assert 0 < sizes["text"] < 32 * 32 * 4  # trimmed: less than a padded float32 sequence


def test_sample_mode_latents_are_seeded_and_reproducible(tiny_flux, tmp_path):
    from tests.conftest import DEMO_IMAGES

    model = ModelConfig(pretrained=str(tiny_flux))
    runs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cfg = CacheConfig(dtype="float32", max_sequence_length=8, latents="sample", seed=seed)
        runs.append(_prep(DEMO_IMAGES, tmp_path / name, model, cfg)[1])
    digests = [[s["sha256"] for s in m["shards"]] for m in runs]
    assert digests[0] == digests[1] and digests[0] != digests[2]


def test_verify_catches_a_flipped_byte(cached, tmp_path, capsys):
    import shutil

    from latentmill.inspect import verify_path

    *_, sd, manifest, _ = cached
    copy = tmp_path / "cache"
    shutil.copytree(sd.root, copy)
    assert verify_path(copy) == 0
    victim = copy / manifest["shards"][2]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert verify_path(copy) == 1
    assert f"MISMATCH {victim}" in capsys.readouterr().out


def test_units_spread_evenly_over_gpus():
    from collections import Counter

    from latentmill.stages.workers import unit_gpu as pick_gpu

    from latentmill.core.hashing import stable_hash

    counts = Counter(pick_gpu(stable_hash(i), 4) for i in range(4000))
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 900
    assert pick_gpu("00000007ab", 4) == 3


def test_component_keys_record_the_dtype_the_encoders_ran_in(tiny_flux, tiny_wan):
    """On a GPU the encoders run in bf16 (the Wan VAE in float32 everywhere): those latents and embeddings
    are not the CPU's bytes, so their keys differ; the CPU keys stay what they were before (float32 is
    not written into them)."""
    from latentmill.stages.cache import CachePlan

    from latentmill.core.hashing import stable_hash

    flux = ModelConfig(pretrained=str(tiny_flux))
    cpu, gpu = CachePlan.of(CacheConfig(device="cpu"), flux), CachePlan.of(CacheConfig(device="cuda"), flux)
    assert cpu.vae_fp != gpu.vae_fp and cpu.text_fp != gpu.text_fp
    assert CachePlan.of(CacheConfig(), flux).vae_fp == cpu.vae_fp  # auto on this GPU-less machine: the CPU
    assert cpu.vae_fp == stable_hash({"family": "flux", "vae": cpu.prints["vae"], "dtype": "bfloat16",
                                      "latents": "mean", "seed": None, "resample": "lanczos",
                                      "version": cache.FORMAT_VERSION})
    wan = ModelConfig(pretrained=str(tiny_wan))
    cpu, gpu = CachePlan.of(CacheConfig(device="cpu"), wan), CachePlan.of(CacheConfig(device="cuda"), wan)
    assert cpu.vae_fp == gpu.vae_fp and cpu.text_fp != gpu.text_fp


def test_a_numbered_worker_process_keeps_to_one_gpu(monkeypatch):
    """A process-pool worker loads its encoders (and captioning model) on one GPU whatever its units, or
    8 workers on 8 GPUs would hold up to 8 copies per GPU."""
    from latentmill.stages.workers import WORKER_INDEX_ENV, worker_gpu
    from latentmill.stages.workers import unit_gpu as pick_gpu

    from latentmill.core.hashing import stable_hash

    assert worker_gpu(4) is None  # the test process is not a numbered worker
    monkeypatch.setenv(WORKER_INDEX_ENV, "5")
    assert {pick_gpu(stable_hash(i), 4) for i in range(100)} == {1}
    assert worker_gpu(8) == 5 and worker_gpu(0) is None


def test_family_mismatch_is_refused(cached):
    model, _, _, manifest, _ = cached
    wrong = ModelConfig(pretrained=model.pretrained, family="wan")
    with pytest.raises(CacheMismatchError, match="made for the 'flux' family, the recipe's model .* is 'wan'"):
        check_cache_compatible(manifest, wrong)
    # model.family auto: the family read from the recipe's pipeline decides (a Wan pipeline over a Flux cache)
    with pytest.raises(CacheMismatchError, match="made for the 'flux' family"):
        check_cache_compatible(manifest, model, family="wan")
    check_cache_compatible(manifest, model, family="flux")  # no error


def test_manifest_records_the_family_streams(cached):
    """The manifest names each stream of a sample (docs/cache-format.md, "Streams"), as the family declares
    them, and the samples hold exactly those tensors."""
    from latentmill.stages.families import FluxEncoders

    _, _, sd, manifest, _ = cached
    assert manifest["streams"] == [s.to_json() for s in FluxEncoders.STREAMS]
    assert [(s["name"], s["component"], s["pad"]) for s in manifest["streams"]] == [
        ("latents", "vae", "none"), ("prompt_embeds", "text", "keep"), ("pooled_prompt_embeds", "text", "none")]
    sample = next(read_shard(sd.root / manifest["shards"][0]["path"]))
    assert set(load_tensors(sample["text.safetensors"])) == {"prompt_embeds", "pooled_prompt_embeds"}


def test_every_caption_is_cached_and_the_loader_picks_one_per_epoch(tiny_flux, tmp_path):
    from latentmill.stages.caption import CaptionConfig
    from latentmill.trainer.loader import LatentLoader, caption_choice

    from tests.conftest import DEMO_IMAGES

    recipe = Recipe(output_dir=str(tmp_path), model=ModelConfig(pretrained=str(tiny_flux)),
                    ingest=IngestConfig(source=str(DEMO_IMAGES), shard_size=8),
                    curate=CurateConfig(max_exposure=0.5),
                    caption=CaptionConfig(captioner="template", template="trtcrd, {caption}", policy="extend"),
                    bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]),
                    cache=CacheConfig(dtype="float32", max_sequence_length=16))
    sd, manifest, records = prep_in_process(recipe)["cache"]
    assert cache.component_report(records)["components"]["text"] == {"processed": 48, "reused": 0}
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    sample = next(read_shard(sd.root / manifest["shards"][0]["path"]))
    meta = json.loads(sample["json"])
    assert len(meta["captions"]) == 2 and meta["captions"][1] == "trtcrd, " + meta["captions"][0]
    for j, member in enumerate(("text.safetensors", "text.1.safetensors")):
        embeds, _, _ = pipe.encode_prompt(meta["captions"][j], prompt_2=None, max_sequence_length=16)
        torch.testing.assert_close(load_tensors(sample[member])["prompt_embeds"], embeds[0])

    # The loader trains each sample on one of its captions per epoch: seeded, and both get used.
    loader = LatentLoader(sd.root, batch_size=4, seed=0)
    key = sample["__key__"]
    chosen = [caption_choice(0, epoch, key, 2) for epoch in range(16)]
    assert set(chosen) == {0, 1}
    for epoch in (0, 1):
        batches = loader.epoch_batches(epoch)
        bucket, indices = next((b, ix) for b, ix in batches
                               if any(loader.buckets[b][i].key == key for i in ix))
        batch = loader._read_batch(bucket, indices, epoch)
        row = [loader.buckets[bucket][i].key for i in indices].index(key)
        member = ("text.safetensors", "text.1.safetensors")[chosen[epoch]]
        expected = load_tensors(sample[member])["prompt_embeds"]
        torch.testing.assert_close(batch["prompt_embeds"][row], expected)


def test_weight_digests_are_remembered_across_processes(tiny_flux, tmp_path, monkeypatch):
    import os
    import shutil
    import sqlite3

    from latentmill.core import fingerprints
    from latentmill.core.hashing import sha256_file

    store = tmp_path / "weights.sqlite"
    monkeypatch.setenv("LATENTMILL_HASH_STORE", str(store))
    shutil.copytree(tiny_flux / "vae", tmp_path / "model" / "vae")
    weights = sorted((tmp_path / "model" / "vae").glob("*.safetensors"))
    old = 1_700_000_000_000_000_000  # long ago: not within the racy window of FileHashes
    for w in (tmp_path / "model" / "vae").iterdir():
        os.utime(w, ns=(old, old))
    src = fingerprints.ComponentSource(str(tmp_path / "model"), "vae")
    monkeypatch.setattr(fingerprints, "_memo", {})
    first = fingerprints.component_fingerprint(src)
    rows = dict(sqlite3.connect(store).execute("SELECT path, sha256 FROM files").fetchall())
    assert weights and all(rows[str(w.resolve())] == sha256_file(w) for w in weights)
    # a new process (empty memo) reads the digests back; a wrong digest in the store proves they are used
    with sqlite3.connect(store) as db:
        db.executemany("UPDATE files SET sha256 = ? WHERE path = ?", [("0" * 64, str(w.resolve())) for w in weights])
    monkeypatch.setattr(fingerprints, "_memo", {})
    assert fingerprints.component_fingerprint(src) != first
    # a weight file that changes (new mtime) is hashed again
    for w in weights:
        os.utime(w, ns=(old + 1, old + 1))
    monkeypatch.setattr(fingerprints, "_memo", {})
    assert fingerprints.component_fingerprint(src) == first


def test_prefetch_auto_decodes_in_line_on_the_cpu(tiny_flux, tmp_path, monkeypatch):
    """cache.prefetch "auto": no decode read-ahead thread when encoding on the CPU (it fought the encoders'
    threads for the cores); true still asks for one."""
    import dataclasses

    from tests.conftest import DEMO_IMAGES

    seen = []
    real = cache._prefetched

    def spy(fn, items, enabled):
        seen.append(enabled)
        return real(fn, items, enabled)

    monkeypatch.setattr(cache, "_prefetched", spy)
    model = ModelConfig(pretrained=str(tiny_flux))
    cfg = CacheConfig(dtype="bfloat16", batch_size=3, max_sequence_length=16)
    _prep(DEMO_IMAGES, tmp_path / "auto", model, cfg)
    assert seen and set(seen) == {False}
    seen.clear()
    _prep(DEMO_IMAGES, tmp_path / "on", model, dataclasses.replace(cfg, prefetch=True))
    assert seen and set(seen) == {True}
