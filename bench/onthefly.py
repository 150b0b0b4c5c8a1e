"""Figure 7: training from cached latents against encoding every batch on the fly.

Ours: ``latentmill.trainer.train.train`` on the latent cache that the real stages (``latentmill.pipelines.prep.plan_stage`` /
``stage_processor``, no Prefect) made from the images. Baseline: what the Diffusers example scripts do
without their cache flag: every step decodes, resizes and crops the batch's images (held in memory as
JPEG bytes, so no file I/O is counted), runs the VAE (``latent_dist.sample()``) and CLIP + T5, then the
same bare training step as figure 6 (``bench.bare``). Same images, same crops, same models.

Both configs run at 256² (one bucket, center crop) with 128 T5 tokens: image and text tokens in the same
1 : 0.5 proportion as FLUX.1-dev at 512² with 512 tokens. ``tiny``: ``data/tiny-flux.yaml``; ``small``:
``bench/small-flux.yaml`` (see its header). ``details`` has the baseline's per-step breakdown.

Honest context (not measured here): for FLUX.1-dev at 512², a training step (forward + backward of the
12B transformer over 1536 tokens) costs ~1.1e14 FLOPs per sample, the T5-XXL encode ~4.9e12 and the VAE
encode ~1e12: on a GPU, on-the-fly encoding would add only ~5% compute; the cache's large win there is
memory (T5-XXL and the VAE need not sit on the GPU). Small models on a CPU overstate the encoders' share
(convolutions at full pixel resolution are relatively dear), so the ratios here are upper bounds.

Run alone: ``python -m bench.onthefly --quick``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time

from latentmill.stages.pixels import image_member

from bench.common import (
    SMALL_RECIPE,
    TINY_RECIPE,
    figure,
    fresh_dir,
    log,
    make_images,
    model_dir,
    model_summary,
    reps_of,
    run_benchmark,
    setup_env,
    sync,
)

setup_env()

RESOLUTION, TOKENS, BATCH, WARMUP = 256, 128, 4, 3


def prep_with_stages(recipe) -> None:
    """Run ingest → caption → bucket → cache with the stage functions, in this thread (no Prefect)."""
    from latentmill.pipelines.prep import run_stages_in_process

    run_stages_in_process(recipe)


def on_the_fly_run(samples, pretrained, steps: int, device: str = "cpu") -> tuple[list[float], dict[str, float]]:
    """The baseline loop; returns per-step seconds and the mean split (decode, vae, text, train) in ms."""
    import torch

    from bench.bare import BareEncoders, BareStep, load_transformer

    enc = BareEncoders(pretrained, device)
    step = BareStep(load_transformer(pretrained, device))
    times, parts = [], {"decode": [], "vae": [], "text": [], "train": []}
    for i in range(steps):
        group = [samples[(i * BATCH + j) % len(samples)] for j in range(BATCH)]
        t0 = time.perf_counter()
        pixels = torch.stack([enc.pixels(s[image_member(s)], m["crop"], RESOLUTION, RESOLUTION) for s, m in group])
        t1 = time.perf_counter()
        latents = enc.latents(pixels, sample=True)
        sync(device)
        t2 = time.perf_counter()
        embeds, pooled = enc.text([m["caption"] for _, m in group], TOKENS)
        sync(device)
        t3 = time.perf_counter()
        step(latents, embeds, pooled)
        t4 = time.perf_counter()
        times.append(t4 - t0)
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name].append(dt)
    return times, {k: 1000 * statistics.fmean(v[WARMUP:]) for k, v in parts.items()}


def run_config(name: str, recipe_path, args, reps: int, num: int, work) -> list:
    """Figure 7 for one model configuration."""
    from bench.bare import read_tar_samples
    from bench.trainer import train_run
    from latentmill.recipe import recipe_from_dict

    steps = (8 if args.quick else {"tiny": 40, "small": 15}[name])
    pretrained = model_dir(recipe_path)
    recipe = recipe_from_dict({
        "output_dir": str(work / name), "model": {"pretrained": str(pretrained)},
        "ingest": {"source": str(work / "images"), "shard_size": 64},
        "bucket": {"resolution": RESOLUTION, "aspect_ratios": [1.0]},
        "cache": {"dtype": "bfloat16", "max_sequence_length": TOKENS},
    })
    start = time.perf_counter()
    prep_with_stages(recipe)
    log(f"onthefly {name}: prep {time.perf_counter() - start:.1f} s")
    cache_dir = recipe.stage_dir("cache")
    bucket_dir = recipe.stage_dir("bucket")
    samples = []
    for shard in json.loads((bucket_dir / "manifest.json").read_text())["shards"]:
        samples += [(s, json.loads(s["json"])) for s in read_tar_samples(bucket_dir / shard["path"])]

    def mean_ms(values):
        return 1000 * statistics.fmean(values[WARMUP:])

    ours_v, base_v, breakdowns = [], [], []

    def ours():
        metrics = train_run(cache_dir, pretrained, work / f"train-{name}", steps, BATCH)
        return 1000 / mean_ms([m["step_time_s"] for m in metrics])

    def baseline():
        times, parts = on_the_fly_run(samples, pretrained, steps, args.device)
        breakdowns.append(parts)
        return 1000 / mean_ms(times)

    for rep in range(reps):
        order = [("ours", ours, ours_v), ("baseline", baseline, base_v)]
        for who, fn, acc in (order if rep % 2 == 0 else order[::-1]):
            acc.append(fn())
            log(f"onthefly {name} rep {rep + 1}/{reps} {who}: {acc[-1]:.2f} steps/s")
    split = {k: round(statistics.median(b[k] for b in breakdowns), 2) for k in breakdowns[0]}
    inputs = {"model": model_summary(pretrained), "images": num, "bucket": [RESOLUTION, RESOLUTION, 1],
              "t5_tokens": TOKENS, "batch_size": BATCH, "steps": steps, "warmup_steps_excluded": WARMUP,
              "cache": "bfloat16, latents: mean", "baseline_vae": "latent_dist.sample()"}
    return [figure(
        f"7. cached vs on-the-fly encoding, training steps/s ({name})", ours_v, base_v, "steps/s", ">= 3.0",
        inputs, "ours: train() on the cache (its step_time_s); baseline: decode+resize+crop, VAE, CLIP+T5, "
                "then the bare step, every step",
        details={"baseline_ms_per_step": split})]


def run(args) -> list:
    reps = reps_of(args, full=4, quick=2)
    num = 16 if args.quick else 64
    work = fresh_dir("onthefly")
    make_images(work / "images", num, seed=1)
    figures = []
    for name, recipe_path in (("tiny", TINY_RECIPE), ("small", SMALL_RECIPE)):
        figures += run_config(name, recipe_path, args, reps, num, work)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return figures




def main(argv=None) -> None:
    run_benchmark("onthefly", __doc__, run, argv)


if __name__ == "__main__":
    main()
