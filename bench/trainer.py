"""Figures 3 and 6: how long the trainer waits on data, and its step time against a bare training loop.

Ours: ``latentmill.trainer.train.train`` (full fine-tune, AdamW, batch 4, no checkpoints/export/TensorBoard) on a
latent cache written with the cache stage's shard writer; step times and data waits are the trainer's
own per-step ``step_time_s`` and ``data_wait_s`` from ``metrics.jsonl``.
Baseline (figure 6): ``bench.bare.BareStep`` on the same transformer (loaded the same way) and the very
same batches, held in memory: logit-normal σ, interpolate, forward, MSE, backward, clip, AdamW step.

Configurations:

* ``tiny``: the tiny Flux set (``data/tiny-flux.yaml``) at the demo's settings: 128² buckets (latent
  16×16×16), 32 T5 tokens, float32 cache (configs/demo.yaml), batch 4: "the tiny training run";
* ``small``: the larger ``bench/small-flux.yaml`` set at 256² (latent 16×32×32), 128 tokens, bf16 cache.

The first ``WARMUP`` steps of every run are left out of the step-time means (first-call set-up), and one
short untimed run of each side goes before the timed ones (a process's first run pays one-time costs).
Run alone: ``python -m bench.trainer --quick``.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import time

from bench.common import (
    SMALL_RECIPE,
    TINY_RECIPE,
    drop_cache,
    figure,
    fresh_dir,
    log,
    model_dir,
    model_summary,
    reps_of,
    run_benchmark,
    setup_env,
    shard_paths,
    write_latent_cache,
)

setup_env()

WARMUP = 5
CONFIGS = {
    "tiny": {"recipe": TINY_RECIPE, "spec": {"latent": [16, 16, 16], "text_len": 32, "text_dim": 32,
                                             "pooled_dim": 32, "bucket": [128, 128, 1]}, "dtype": "float32"},
    "small": {"recipe": SMALL_RECIPE, "spec": {"latent": [16, 32, 32], "text_len": 128, "text_dim": 128,
                                               "pooled_dim": 64, "bucket": [256, 256, 1]}, "dtype": "bfloat16"},
}


def train_run(cache_dir, pretrained, train_dir, steps: int, batch: int) -> list[dict]:
    """One ``latentmill.trainer.train.train`` run; returns its metrics.jsonl records."""
    from latentmill.trainer.config import TrainerConfig
    from latentmill.trainer.train import train

    if train_dir.exists():
        shutil.rmtree(train_dir)
    cfg = TrainerConfig(max_steps=steps, batch_size=batch, save_every=0, export=False, tensorboard=False,
                        log_every=10**6, learning_rate=1e-4)
    train(cfg, cache_dir=cache_dir, pretrained=str(pretrained), train_dir=train_dir, seed=0, progress=False)
    return [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]


def bare_run(batches, pretrained, steps: int, device: str = "cpu") -> list[float]:
    """The bare loop over ``batches`` (held in memory); returns per-step seconds."""
    import torch
    from latentmill.trainer.threads import choose_cpu_threads

    from bench.bare import BareStep, load_transformer

    step = BareStep(load_transformer(pretrained, device))
    threads = torch.get_num_threads()
    if device == "cpu":  # the threads train() would use: the two sides differ in the trainer's work only
        torch.set_num_threads(choose_cpu_threads().threads)
    times = []
    try:
        for i in range(steps):
            b = batches[i % len(batches)]
            start = time.perf_counter()
            step(b["latents"], b["prompt_embeds"], b["pooled_prompt_embeds"])
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return times


def run_config(name: str, conf: dict, args, reps: int, work) -> list:
    """Figures 3 (tiny only) and 6 for one model configuration."""
    import torch
    from latentmill.trainer.loader import LatentLoader

    batch = 4
    figures = []
    steps = {"tiny": 120, "small": 15}[name] if not args.quick else {"tiny": 15, "small": 8}[name]
    num = 512 if not args.quick else 64
    pretrained = model_dir(conf["recipe"])
    cache = work / f"cache-{name}"
    manifest = write_latent_cache(cache, num, conf["spec"], shard_samples=64, dtype_name=conf["dtype"])
    shards = shard_paths(cache, manifest)
    with LatentLoader(cache, batch, seed=0, dtype=torch.float32) as loader:
        it = iter(loader)
        batches = [next(it) for _ in range(steps)]  # the very batches train() sees

    def mean_after_warmup(values):
        return statistics.fmean(values[WARMUP:] if len(values) > WARMUP + 1 else values)

    runs: dict[str, list] = {k: [] for k in ("ours", "bare", "wait", "step", "wait_cold", "step_cold")}

    def ours(rep):
        metrics = train_run(cache, pretrained, work / f"train-{name}", steps, batch)
        runs["wait"].append(sum(m["data_wait_s"] for m in metrics))
        runs["step"].append(sum(m["step_time_s"] for m in metrics))
        return 1000 * mean_after_warmup([m["step_time_s"] for m in metrics])

    def bare(rep):
        return 1000 * mean_after_warmup(bare_run(batches, pretrained, steps, args.device))

    # One short untimed run of each first: the first training run of a process pays one-time costs (kernel
    # and allocator warm-up) for several steps, and would otherwise weigh on whichever side goes first.
    train_run(cache, pretrained, work / f"train-{name}", WARMUP * 2, batch)
    bare_run(batches, pretrained, WARMUP * 2, args.device)
    for rep in range(reps):
        order = [("ours", ours), ("bare", bare)] if rep % 2 == 0 else [("bare", bare), ("ours", ours)]
        for who, fn in order:
            gc.collect()  # the previous run's model and optimizer, if a cycle holds them: not in this run's steps
            runs[who].append(fn(rep))
            log(f"trainer {name} rep {rep + 1}/{reps} {who}: {runs[who][-1]:.2f} ms/step")
        if name == "tiny":  # a cold start: the shards dropped from the page cache first
            drop_cache(shards)
            metrics = train_run(cache, pretrained, work / f"train-{name}", steps, batch)
            runs["wait_cold"].append(sum(m["data_wait_s"] for m in metrics))
            runs["step_cold"].append(sum(m["step_time_s"] for m in metrics))
            log(f"trainer {name} rep {rep + 1}/{reps} cold data wait {runs['wait_cold'][-1]:.3f} s")

    inputs = {"model": model_summary(pretrained), "samples": num, "sample": conf["spec"],
              "cache_dtype": conf["dtype"], "batch_size": batch, "steps": steps, "warmup_steps_excluded": WARMUP,
              "trainer": "TrainerConfig(mode=full, batch_size=4, lr=1e-4, save_every=0, export=False, "
                         "tensorboard=False), CPU float32"}
    if name == "tiny":
        # ours = data wait per step, baseline = step time per step, ratio = the share (all steps)
        note = ("ratio = sum(data_wait_s) / sum(step_time_s) over all steps of train() (its summary's "
                "data_wait_fraction); ours: data wait per step, baseline: step time per step (ms)")
        figures.append(figure(
            "3. data wait share of step time, tiny training run (hot)",
            [1000 * w / steps for w in runs["wait"]], [1000 * s / steps for s in runs["step"]],
            "ms/step", "< 0.02", inputs, note,
            ratios=[w / s for w, s in zip(runs["wait"], runs["step"])]))
        figures.append(figure(
            "3. data wait share of step time, tiny training run (cold start)",
            [1000 * w / steps for w in runs["wait_cold"]], [1000 * s / steps for s in runs["step_cold"]],
            "ms/step", "< 0.02", inputs, note + "; "
            f"the shards dropped from the page cache before train(); {steps} steps x {batch} samples read "
            f"{steps * batch} of {num} samples, all cold",
            ratios=[w / s for w, s in zip(runs["wait_cold"], runs["step_cold"])]))
    figures.append(figure(
        f"6. trainer step time vs bare loop ({name})", runs["ours"], runs["bare"], "ms/step", "<= 1.05",
        inputs, "ours: train()'s step_time_s (data fetch to optimizer/LR step); baseline: bench.bare.BareStep "
                "on the same batches held in memory"))
    return figures


def run(args) -> list:
    work = fresh_dir("trainer")
    figures = []
    for name, conf in CONFIGS.items():
        # the tiny run's steps (~10 ms) move with every hiccup of a shared machine: more repetitions of it,
        # which cost seconds
        reps = reps_of(args, full=9 if name == "tiny" else 5, quick=2)
        figures += run_config(name, conf, args, reps, work)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return figures




def main(argv=None) -> None:
    run_benchmark("trainer", __doc__, run, argv)


if __name__ == "__main__":
    main()
