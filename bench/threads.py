"""Figure 19: CPU training's default intra-op threads against the best thread count of a small sweep.

Ours: ``latentmill.trainer.train.train`` with ``trainer.cpu_threads: 0`` and no ``OMP_NUM_THREADS`` (the
trainer's own choice, ``latentmill.trainer.threads.choose_cpu_threads``), on the tiny run at the demo's
settings (``bench.trainer``'s ``tiny`` configuration: the tiny Flux set, 128² latents, 32 tokens, float32
cache, batch 4); samples/s over the steps after the first ``WARMUP`` (their ``step_time_s``). Baseline: the
same run with ``trainer.cpu_threads`` = 1, 2, ... up to the cores this process may use (at least 2), each
once per repetition; the best samples/s of that repetition. ratio = ours / best (goal >= 0.9). The runs of a
repetition go back to back, their order reversed every other repetition. ``details`` holds the threads
the default chose and why, and the median samples/s of every count of the sweep.

Run alone: ``python -m bench.threads --quick``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics

from bench.common import (
    figure,
    fresh_dir,
    log,
    model_dir,
    model_summary,
    reps_of,
    run_benchmark,
    setup_env,
    write_latent_cache,
)

setup_env()

WARMUP = 5
BATCH = 4


def train_run(cache, pretrained, train_dir, steps: int, cpu_threads: int) -> tuple[float, dict]:
    """(samples/s after the warm-up steps, the summary) of one ``train()`` run with ``cpu_threads``."""
    from latentmill.trainer.config import TrainerConfig
    from latentmill.trainer.train import train

    if train_dir.exists():
        shutil.rmtree(train_dir)
    cfg = TrainerConfig(max_steps=steps, batch_size=BATCH, save_every=0, export=False, tensorboard=False,
                        log_every=10**6, learning_rate=1e-4, cpu_threads=cpu_threads)
    summary = train(cfg, cache_dir=cache, pretrained=str(pretrained), train_dir=train_dir, seed=0, progress=False)
    times = [json.loads(line)["step_time_s"] for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    return BATCH / statistics.fmean(times[WARMUP:]), summary


def run(args) -> list:
    from latentmill.trainer.threads import usable_cores

    from bench.trainer import CONFIGS

    os.environ.pop("OMP_NUM_THREADS", None)  # the default under test is the trainer's own choice
    work = fresh_dir("threads")
    conf = CONFIGS["tiny"]
    steps = 15 if args.quick else 30
    reps = reps_of(args, full=3, quick=1)
    pretrained = model_dir(conf["recipe"])
    cache = work / "cache"
    write_latent_cache(cache, 64 if args.quick else 256, conf["spec"], shard_samples=64, dtype_name=conf["dtype"])
    cores, how = usable_cores()
    sweep = list(range(1, max(2, cores) + 1))
    train_run(cache, pretrained, work / "warm", WARMUP * 2, 0)  # a process's first run pays one-time costs
    ours, best, per_count = [], [], {n: [] for n in sweep}
    chosen = None
    for rep in range(reps):
        order = [0, *sweep] if rep % 2 == 0 else [*reversed(sweep), 0]
        rates = {}
        for n in order:
            gc.collect()
            rates[n], summary = train_run(cache, pretrained, work / "run", steps, n)
            if n == 0:
                chosen = (summary["cpu_threads"], summary["cpu_threads_reason"])
            log(f"threads rep {rep + 1}/{reps} cpu_threads={n or 'default'}: {rates[n]:.1f} samples/s")
        ours.append(rates[0])
        best.append(max(rates[n] for n in sweep))
        for n in sweep:
            per_count[n].append(rates[n])
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    inputs = {"model": model_summary(pretrained), "sample": conf["spec"], "cache_dtype": conf["dtype"],
              "batch_size": BATCH, "steps": steps, "warmup_steps_excluded": WARMUP, "sweep": sweep,
              "usable_cores": f"{cores} ({how})", "load_average": os.getloadavg()}
    details = {"default_threads": chosen[0], "default_reason": chosen[1],
               "samples_per_s_by_threads": {str(n): statistics.median(v) for n, v in per_count.items()}}
    return [figure("19. CPU training: default threads vs the best of a sweep (tiny demo run)", ours, best,
                   "samples/s", ">= 0.9", inputs,
                   "ours: train() with trainer.cpu_threads 0 (its own choice); baseline: the best samples/s of "
                   f"cpu_threads in {sweep} in the same repetition", details=details)]


def main(argv=None) -> None:
    run_benchmark("threads", __doc__, run, argv)


if __name__ == "__main__":
    main()
