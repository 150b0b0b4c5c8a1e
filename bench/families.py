"""Figure 21: per image family, the cache stage against a bare loop of the family pipeline's own encode calls,
and what a cached sample of each family weighs (issue 32).

For each image family that has a tiny model set (``latentmill.tinyio.TINY_BUILDERS``, built from
``data/tiny-<family>.yaml``) and an entry in ``PIPELINE_ENCODE`` below: ``N`` generated photo-like JPEGs
with sidecar captions (``bench.common.make_images``), bucket resolution 256, cache dtype bf16, cache batch
8, the family's default token limit; one untimed prep first (ingest, caption, curate, bucket, and Prefect's
start-up). Then, per repetition, back to back in alternating order:

* ours: the cache stage's ``seconds`` in the summary of ``run_prep`` with the earlier stages reused (the
  cache folder and snapshots removed first, the process's loaded encoders and fingerprints forgotten);
* baseline: the family's Diffusers pipeline, loaded with ``from_pretrained`` without its transformer inside
  the timing, and per batch of the same bucket shards: decode, resize and crop to the sample's bucket
  (``bench.bare.BareEncoders.pixels``), the pipeline's own ``encode_prompt`` and VAE path (its latent
  normalisation and packing), cast to bf16, nothing written.

Goal: ours / baseline <= 1.15 per family. The details give each family's cache bytes per sample (the run
summary's ``bytes_per_sample``: its VAE and text members, trimmed where the family's text stream allows it).

Run alone: ``python -m bench.families --quick``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import (
    REPO_ROOT,
    WORK,
    figure,
    fresh_dir,
    log,
    make_images,
    reps_of,
    reset_process_caches,
    run_benchmark,
    setup_env,
    sync,
)
from bench.prep import quiet_prep

setup_env()

RESOLUTION, CACHE_BATCH = 256, 8


def _flux(pipe, pixels_BCHW, captions: list[str], max_sequence_length: int) -> list:
    """FluxPipeline: ``encode_prompt`` (CLIP pooled + T5), the VAE mean normalised (z - shift) * scale."""
    import torch

    embeds, pooled, _ = pipe.encode_prompt(captions, None, max_sequence_length=max_sequence_length)
    with torch.no_grad():
        z = pipe.vae.encode(pixels_BCHW.to(pipe.vae.dtype)).latent_dist.mode()
    latents = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    return [latents, embeds, pooled]


def _flux2(pipe, pixels_BCHW, captions: list[str], max_sequence_length: int) -> list:
    """Flux2Pipeline / Flux2KleinPipeline: ``encode_prompt`` (three hidden layers side by side), the VAE path of
    ``_encode_vae_image`` (the posterior's mode, 2x2-patchified, normalised by the VAE's batch-norm statistics)."""
    import torch

    embeds, _ = pipe.encode_prompt(captions, max_sequence_length=max_sequence_length)
    with torch.no_grad():
        latents = pipe._encode_vae_image(pixels_BCHW.to(pipe.vae.dtype), generator=None)
    return [latents, embeds]


def _zimage(pipe, pixels_BCHW, captions: list[str], max_sequence_length: int) -> list:
    """ZImagePipeline: ``encode_prompt`` (Qwen3 ``hidden_states[-2]`` in the chat template, each prompt's real
    tokens), the VAE mean normalised (z - shift) * scale."""
    import torch

    embeds, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False,  # (it rewrites the list)
                                   max_sequence_length=max_sequence_length)
    with torch.no_grad():
        z = pipe.vae.encode(pixels_BCHW.to(pipe.vae.dtype)).latent_dist.mode()
    latents = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    return [latents, *embeds]


def _qwen_image(pipe, pixels_BCHW, captions: list[str], max_sequence_length: int) -> list:
    """QwenImagePipeline: ``encode_prompt`` (Qwen2.5-VL over the chat template, the prefix dropped, padded to
    the batch's longest with its mask), the VAE mean of one-frame clips normalised ``(z - mean) / std`` (the
    pipelines' ``_encode_vae_image`` with the mode)."""
    import torch

    embeds, mask = pipe.encode_prompt(captions, max_sequence_length=max_sequence_length)
    with torch.no_grad():
        z = pipe.vae.encode(pixels_BCHW[:, :, None].to(pipe.vae.dtype)).latent_dist.mode()
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return [((z - mean) / std)[:, :, 0], embeds] + ([] if mask is None else [mask])


# family -> the pipeline's own encode calls on one batch: (pipe, pixels [B, 3, H, W] in [-1, 1], captions,
# max_sequence_length) -> the tensors a cache stores. A new image family adds its line here.
PIPELINE_ENCODE: dict[str, Callable[..., list]] = {"flux": _flux, "z-image": _zimage, "flux2": _flux2,
                                                   "flux2-klein": _flux2}
PIPELINE_ENCODE["qwen-image"] = _qwen_image


def tiny_pipeline(family: str) -> Path:
    """The family's tiny pipeline folder (built once, seed 0, under bench/.work/models)."""
    from latentmill.tinyio import ensure_tiny

    return ensure_tiny(family, WORK / "models" / f"tiny-{family}", REPO_ROOT / "data" / f"tiny-{family}.yaml")


def recipe_for(source: Path, output_dir: Path, pretrained: Path):
    from latentmill.recipe import recipe_from_dict

    return recipe_from_dict({
        "output_dir": str(output_dir), "seed": 0, "model": {"pretrained": str(pretrained)},
        "runner": {"kind": "threads", "workers": 2},
        "ingest": {"source": str(source), "shard_size": 64},
        "bucket": {"resolution": RESOLUTION},
        "cache": {"dtype": "bfloat16", "batch_size": CACHE_BATCH},
    })


def bare_cache(family: str, bucket_dir: Path, pretrained: Path, max_sequence_length: int) -> int:
    """The pipeline's own encode calls over every sample of the bucket shards; returns the sample count."""
    import diffusers
    import torch
    from latentmill.stages.pixels import image_member

    from bench.bare import BareEncoders, read_tar_samples

    index = json.loads((pretrained / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(pretrained, transformer=None)
    encode = PIPELINE_ENCODE[family]
    manifest = json.loads((bucket_dir / "manifest.json").read_text())
    count = 0
    for shard in manifest["shards"]:
        samples = read_tar_samples(bucket_dir / shard["path"])
        metas = [json.loads(s["json"]) for s in samples]
        order = sorted(range(len(samples)), key=lambda i: (metas[i]["bucket"], samples[i]["__key__"]))
        batches: list[list[int]] = []
        for i in order:  # runs of one bucket, cut every CACHE_BATCH samples (as the cache stage batches)
            if batches and len(batches[-1]) < CACHE_BATCH and metas[batches[-1][0]]["bucket"] == metas[i]["bucket"]:
                batches[-1].append(i)
            else:
                batches.append([i])
        for batch in batches:
            width, height = metas[batch[0]]["bucket"][:2]
            pixels = torch.stack([BareEncoders.pixels(samples[i][image_member(samples[i])], metas[i]["crop"],
                                                      width, height) for i in batch])
            with torch.no_grad():
                out = encode(pipe, pixels, [metas[i]["caption"] for i in batch], max_sequence_length)
            _ = [t.to(torch.bfloat16) for t in out]
            count += len(batch)
    sync("cpu")
    return count


def family_figure(family: str, src: Path, work: Path, reps: int, n: int):
    """Figure 21 of one family: its cache stage against the bare loop, on the images of ``src``."""
    pretrained = tiny_pipeline(family)
    out = work / family
    recipe = recipe_for(src, out, pretrained)
    start = time.perf_counter()
    first = quiet_prep(recipe)
    log(f"{family}: set-up prep {time.perf_counter() - start:.0f} s")
    cached = first["stages"]["cache"]["out"]
    last: list[dict[str, Any]] = [first["stages"]["cache"]]

    def ours(rep):
        shutil.rmtree(out / "prep" / "cache")
        shutil.rmtree(out / "snapshots")
        reset_process_caches()
        stage = quiet_prep(recipe)["stages"]["cache"]
        assert stage["processed"] == cached, stage
        last[0] = stage
        return stage["seconds"]

    def bare(rep):
        start = time.perf_counter()
        assert bare_cache(family, out / "prep" / "bucket", pretrained, recipe.cache.max_sequence_length) == cached
        return time.perf_counter() - start

    ours(-1)  # untimed warm-up of both (first calls pay one-off kernel selection per shape)
    bare(-1)
    o, b = [], []
    for rep in range(reps):
        order = [("ours", ours, o), ("baseline", bare, b)]
        for who, fn, acc in (order if rep % 2 == 0 else order[::-1]):
            acc.append(fn(rep))
            log(f"{family} rep {rep + 1}/{reps} {who}: {acc[-1]:.2f} s")
    inputs = {"family": family, "images": n, "bucket_resolution": RESOLUTION, "cache_dtype": "bfloat16",
              "cache_batch": CACHE_BATCH, "max_sequence_length": recipe.cache.max_sequence_length,
              "pretrained": str(pretrained.relative_to(REPO_ROOT)), "runner": "threads x2"}
    return figure(f"21. {family}: cache stage vs the pipeline's own encode calls", o, b, "s", "<= 1.15", inputs,
                  "ours: run_prep's stages.cache.seconds with the earlier stages reused; baseline: "
                  "bench.families.bare_cache, models loaded inside the timing in both",
                  details={"bytes_per_sample": last[0].get("bytes_per_sample"), "samples": cached})


def run(args) -> list:
    from latentmill.tinyio import TINY_BUILDERS

    reps = reps_of(args, full=3, quick=2)
    n = 24 if args.quick else 96
    work = fresh_dir("families")
    src = work / "images"
    make_images(src, n, seed=0)
    try:
        return [family_figure(family, src, work, reps, n) for family in sorted(set(PIPELINE_ENCODE) & set(TINY_BUILDERS))]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> None:
    run_benchmark("families", __doc__, run, argv)


if __name__ == "__main__":
    main()
