"""Edit datasets (``ingest.edit``): a target image, its source image and an instruction are one sample, in each
of the three layouts; a pair stays together through ingest and bucketing, an incomplete one is quarantined
naming it, counts conserve, and an edit recipe over data without pairs stops before any work."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
import torch
from latentmill.stages import bucket, ingest
from latentmill.stages.cache import load_pixels
from latentmill.stages.ingest import REFERENCE_MEMBER, IngestConfig
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from PIL import Image

from latentmill.core.config import ConfigError
from latentmill.preflight import check_edit_source


def _image(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path.read_bytes()


def _ingest(cfg: IngestConfig, root: Path):
    sd = StageDir(root, "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg, sd)]
    sd.write_manifest(records, {"shard_size": cfg.shard_size})
    samples = {json.loads(s["json"])["source"]: s for shard in sd.read_manifest()["shards"]
               for s in read_shard(sd.root / shard["path"])}
    reasons = {q["source"]: q["reason"] for r in records for q in r.quarantined}
    return sd, records, samples, reasons


def _check_pair(sample: dict, target: bytes, source: bytes, caption: str) -> None:
    meta = json.loads(sample["json"])
    assert sample["image"] == target and sample[REFERENCE_MEMBER] == source
    assert meta[REFERENCE_MEMBER]["sha256"] == hashlib.sha256(source).hexdigest()
    assert meta["sidecar_caption"] == caption


def test_a_lone_source_image_is_listed_at_its_own_path(tmp_path):
    """A source image without its target, first in its folder, is an entry at its own path, with the reason."""
    from latentmill.stages.sources import list_source

    src = tmp_path / "edits"
    _image(src / "d.src.jpg", (32, 32), (4, 5, 6))
    _image(src / "e.jpg", (32, 32), (1, 2, 3))
    lone, target = list_source(str(src), edit=True).entries
    assert (lone.id, lone.uri) == ("d.src.jpg", str((src / "d.src.jpg").resolve()))
    assert lone.error == "edit pair: a source image without its target (d.<image extension>)"
    assert (target.id, target.error, target.reference) == ("e.jpg", None, None)


def test_sidecar_pairs_are_one_sample_and_incomplete_ones_are_quarantined(tmp_path):
    src = tmp_path / "edits"
    a, a_src = _image(src / "a.jpg", (64, 48), (200, 0, 0)), _image(src / "a.src.png", (40, 40), (0, 0, 200))
    b, b_src = _image(src / "sub" / "b.png", (48, 64), (0, 200, 0)), _image(src / "sub" / "b.src.png", (48, 64), (9, 9, 9))
    (src / "a.txt").write_text("make the square red\n")
    (src / "sub" / "b.txt").write_text("turn it green\n")
    _image(src / "c.jpg", (32, 32), (1, 2, 3))  # a target without its source image
    _image(src / "d.src.jpg", (32, 32), (4, 5, 6))  # a source image without its target
    cfg = IngestConfig(source=str(src), edit=True)
    _, records, samples, reasons = _ingest(cfg, tmp_path / "out")
    assert sorted(samples) == ["a.jpg", "sub/b.png"]
    _check_pair(samples["a.jpg"], a, a_src, "make the square red")
    _check_pair(samples["sub/b.png"], b, b_src, "turn it green")
    assert reasons["c.jpg"].startswith("edit pair: no source image for c.jpg (c.src.<ext> beside it")
    assert reasons["d.src.jpg"] == "edit pair: a source image without its target (d.<image extension>)"
    counts = [sum(getattr(r, k) for r in records) for k in ("samples_in", "samples_out")]
    assert counts == [4, 2] and sum(len(r.quarantined) for r in records) == 2  # in = out + quarantined

    # the same folder without ingest.edit: four plain images (the .src ones too), no reference member
    _, _, plain, _ = _ingest(IngestConfig(source=str(src)), tmp_path / "plain")
    assert sorted(plain) == ["a.jpg", "a.src.png", "c.jpg", "d.src.jpg", "sub/b.png", "sub/b.src.png"]
    assert not any(REFERENCE_MEMBER in s for s in plain.values())


def test_paired_folders_and_a_manifest_give_the_same_pairs(tmp_path):
    root = tmp_path / "paired"
    t1, s1 = _image(root / "target" / "x.png", (64, 48), (10, 20, 30)), _image(root / "source" / "x.jpg", (64, 48), (30, 20, 10))
    (root / "target" / "x.txt").write_text("swap the colours\n")
    _image(root / "target" / "y.png", (32, 32), (0, 0, 0))  # no source
    _image(root / "source" / "z.png", (32, 32), (0, 0, 0))  # no target
    _, records, samples, reasons = _ingest(IngestConfig(source=str(root), edit=True), tmp_path / "out")
    assert sorted(samples) == ["x.png"]
    _check_pair(samples["x.png"], t1, s1, "swap the colours")
    assert reasons["y.png"].startswith("edit pair: no source image for y.png")
    assert reasons["source/z.png"] == "edit pair: a source image without its target (target/z.png)"

    manifest = tmp_path / "pairs.csv"
    with open(manifest, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["target", "source", "instruction"])
        writer.writerow([str(root / "target" / "x.png"), "paired/source/x.jpg", "swap the colours"])
        writer.writerow([str(root / "target" / "y.png"), "", "nothing"])
    cfg = IngestConfig(source=str(manifest), edit=True, caption_column="instruction")
    _, _, samples, reasons = _ingest(cfg, tmp_path / "out-manifest")
    (sample,) = samples.values()
    meta = json.loads(sample["json"])
    assert sample["image"] == t1 and sample[REFERENCE_MEMBER] == s1 and meta["sidecar_caption"] == "swap the colours"
    assert any(r.startswith("edit pair: no source image") for r in reasons.values())


def test_a_pair_gets_one_bucket_and_a_changed_source_reruns_its_unit(tmp_path):
    src = tmp_path / "edits"
    _image(src / "a.jpg", (96, 64), (200, 0, 0))
    source = _image(src / "a.src.jpg", (64, 64), (0, 0, 200))
    cfg = IngestConfig(source=str(src), edit=True)
    sd, first, _, _ = _ingest(cfg, tmp_path / "out")
    bcfg = bucket.BucketConfig(resolution=64)
    bsd = StageDir(tmp_path / "out-bucket", "bucket").ensure()
    records = [bsd.run_unit(u, lambda unit, out: bucket.process(bcfg, unit, out)) for u in bucket.plan(bcfg, sd, bsd)]
    (sample,) = [s for r in records for shard in r.shards for s in read_shard(bsd.root / shard.path)]
    meta = json.loads(sample["json"])
    target_px = load_pixels(sample["image"], meta["crop"], meta["bucket"])
    source_px = load_pixels(sample[REFERENCE_MEMBER], meta[REFERENCE_MEMBER]["crop"], meta["bucket"])
    assert target_px.shape == source_px.shape == (3, meta["bucket"][1], meta["bucket"][0])
    assert source_px[2].mean() > 0.5 > source_px[0].mean()  # the blue source, cropped to the target's bucket
    assert sample[REFERENCE_MEMBER] == source

    _image(src / "a.src.jpg", (64, 64), (0, 200, 0))  # a new source image: the pair is new work
    _, second, _, _ = _ingest(cfg, tmp_path / "out")
    assert {r.unit_id for r in second}.isdisjoint({r.unit_id for r in first})


def test_an_edit_recipe_over_data_without_pairs_stops_before_any_work(tmp_path):
    _image(tmp_path / "plain" / "a.jpg", (32, 32), (1, 1, 1))
    with pytest.raises(ConfigError, match=r"ingest.edit: .* holds no edit pairs; put each source image beside"):
        check_edit_source(str(tmp_path / "plain"), tmp_path / "plain", None)
    (tmp_path / "m.csv").write_text("path,caption\na.jpg,x\n")
    with pytest.raises(ConfigError, match="the manifest .* has no 'source' column of source images"):
        check_edit_source(str(tmp_path / "m.csv"), tmp_path / "m.csv", None)
    _image(tmp_path / "plain" / "a.src.jpg", (32, 32), (1, 1, 1))
    check_edit_source(str(tmp_path / "plain"), tmp_path / "plain", None)  # a pair: no error


# ---------------------------------------------------------------------------------------------------------
# The cache and the loader: a family with a stream of the source image
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture()
def edit_flux(monkeypatch):
    """The tiny Flux family with one more stream, ``reference_latents`` of the pair's source image (what
    Qwen-Image-Edit's cache holds), registered as ``flux`` for the test."""
    from latentmill.stages import cache as cache_stage
    from latentmill.stages import families
    from latentmill.stages.encoders import Stream
    from latentmill.stages.family_flux import FluxEncoders

    class EditFlux(FluxEncoders):
        STREAMS = (*FluxEncoders.STREAMS,
                   Stream("reference_latents", "vae", "[C, H/8, W/8]", "(z - shift_factor) * scaling_factor",
                          from_reference=True))

    monkeypatch.setitem(families.FAMILIES, "flux", EditFlux)
    families.release_encoders()
    cache_stage.forget_plans()
    yield EditFlux
    families.release_encoders()
    cache_stage.forget_plans()


@pytest.mark.slow  # builds the tiny Flux set, runs the stages
def test_a_reference_stream_is_the_source_image_encoded_at_the_targets_bucket(edit_flux, tiny_flux, tmp_path):
    from latentmill.stages.bucket import BucketConfig
    from latentmill.stages.cache import CacheConfig
    from latentmill.stages.families import get_encoders
    from latentmill.trainer.loader import LatentLoader
    from safetensors.torch import load

    from latentmill.models import ModelConfig
    from latentmill.recipe import Recipe
    from tests.helpers import prep_in_process

    src = tmp_path / "edits"
    for i, (size, colour) in enumerate([((64, 48), (200, 0, 0)), ((48, 64), (0, 200, 0)), ((64, 64), (0, 0, 200))]):
        _image(src / f"p{i}.jpg", size, colour)
        _image(src / f"p{i}.src.png", (40 + 8 * i, 40), tuple(255 - c for c in colour))
        (src / f"p{i}.txt").write_text(f"invert the colours of picture {i}\n")
    model = ModelConfig(pretrained=str(tiny_flux))

    def prep(root, edit):
        recipe = Recipe(output_dir=str(root), model=model, ingest=IngestConfig(source=str(src), edit=edit),
                        bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]),
                        cache=CacheConfig(dtype="float32", max_sequence_length=16))
        return prep_in_process(recipe)["cache"]

    sd, manifest, records = prep(tmp_path / "out", edit=True)
    assert manifest["counts"] == {"in": 3, "out": 3, "quarantined": 0}
    assert [s["name"] for s in manifest["streams"]][-1] == "reference_latents"
    encoders = get_encoders(model, "flux", torch.device("cpu"))
    for shard in manifest["shards"]:
        for sample in read_shard(sd.root / shard["path"]):
            meta = json.loads(sample["json"])
            vae = load(sample["vae.safetensors"])
            bucket_dir = sd.root.parent / "bucket"
            source = next(s for sh in json.loads((bucket_dir / "manifest.json").read_text())["shards"]
                          for s in read_shard(bucket_dir / sh["path"]) if s["__key__"] == sample["__key__"])
            expected = encoders.encode_pixels(load_pixels(source[REFERENCE_MEMBER], meta[REFERENCE_MEMBER]["crop"],
                                                          meta["bucket"]).unsqueeze(0))[0][0]
            assert vae["reference_latents"].shape == vae["latents"].shape
            assert torch.equal(vae["reference_latents"], expected), sample["__key__"]
    with LatentLoader(sd.root, batch_size=1, seed=0) as loader:
        batch = next(iter(loader))
    assert batch["reference_latents"].shape == batch["latents"].shape

    # the same pictures prepared without ingest.edit: no pair reaches the cache of a family that needs one
    _, manifest, records = prep(tmp_path / "plain", edit=False)
    reasons = {q["reason"] for r in records for q in r.quarantined}
    assert manifest["counts"]["out"] == 0 and reasons == {
        'no source image: the flux family trains on edit pairs (ingest.edit: true, docs/prep.md "Edit datasets")'}
