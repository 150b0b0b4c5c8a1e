"""JAX loader vs torch loader: samples/s of ``latentmill.jax.JaxLatentLoader`` and ``LatentLoader`` on one snapshot.

Data: ``N`` Flux-class 512² samples (latent 16×64×64, T5 77×4096, pooled 768, bf16: ~750 KB each) written
with the cache stage's shard writer in shards of 64 samples (one index beside each tar), published as a
dataset snapshot (``latentmill.pipelines.snapshot.publish``); both loaders read that snapshot folder.

Contenders, each reading every sample once per epoch, batch size 8, ``PASSES`` epochs per measurement (8 with
bf16 output, 3 with float32) of one loader constructed inside the first epoch's timing (defaults: prefetch on,
io_threads=2), page cache hot:

* ours: ``JaxLatentLoader`` (NumPy batches; bf16 as ``ml_dtypes.bfloat16``), and in the informational
  figure with ``as_jax=True`` (each batch ``jax.device_put`` on the default device, here the CPU, and
  waited for with ``jax.block_until_ready``);
* baseline: ``LatentLoader`` with the same arguments and output dtype (torch tensors).

Each repetition pairs one measurement of each (alternating which goes first); the ratio of a pair is one
repetition. Goal: ours >= 0.8x the torch loader. Run alone: ``python -m bench.jaxloader --quick``.
"""

from __future__ import annotations

import time

from bench.common import (
    FLUX_512,
    figure,
    fresh_dir,
    log,
    reps_of,
    run_benchmark,
    setup_env,
    shard_paths,
    timed,
    warm_cache,
    write_latent_cache,
)

setup_env()

PASSES = {"bf16": 8, "f32": 3}  # hot epochs per timed measurement (full size; 1 with --quick): a bf16 epoch
# of 512 samples is ~0.25 s, short enough for one hiccup of a shared machine to move it
BATCH = 8


def run(args) -> list:
    import jax
    import torch
    from latentmill.pipelines.snapshot import publish
    from latentmill.trainer.loader import LatentLoader

    from latentmill.jax import JaxLatentLoader

    reps = reps_of(args, full=5, quick=2)
    num = 128 if args.quick else 512
    work = fresh_dir("jaxloader")
    t0 = time.perf_counter()
    cache = work / "output" / "prep" / "cache"
    manifest = write_latent_cache(cache, num, FLUX_512, shard_samples=64, seed=0)
    snapshot = publish(work / "output", cache)["path"]
    shards = shard_paths(cache, manifest)
    shard_bytes = sum(p.stat().st_size for p in shards)
    log(f"generated {num} samples ({shard_bytes / 2**20:.0f} MiB), snapshot {snapshot}, "
        f"in {time.perf_counter() - t0:.0f} s")

    def epochs(make):
        """A generator: each ``next`` reads one epoch of a loader built at the first ``next``."""
        with make() as loader:
            it = iter(loader)
            try:
                while True:
                    count = 0
                    for _ in range(len(loader)):
                        batch = next(it)
                        count += len(batch["keys"])
                    yield count
            finally:
                it.close()

    def as_jax_epochs():
        with JaxLatentLoader(snapshot, BATCH, seed=0, dtype="bfloat16", as_jax=True) as loader:
            it = iter(loader)
            while True:
                count = 0
                for _ in range(len(loader)):
                    batch = next(it)
                    jax.block_until_ready([v for v in batch.values() if isinstance(v, jax.Array)])
                    count += len(batch["keys"])
                yield count

    contenders = {
        "jax_bf16": lambda: epochs(lambda: JaxLatentLoader(snapshot, BATCH, seed=0, dtype="bfloat16")),
        "torch_bf16": lambda: epochs(lambda: LatentLoader(snapshot, BATCH, seed=0, dtype=torch.bfloat16)),
        "jax_f32": lambda: epochs(lambda: JaxLatentLoader(snapshot, BATCH, seed=0, dtype="float32")),
        "torch_f32": lambda: epochs(lambda: LatentLoader(snapshot, BATCH, seed=0, dtype=torch.float32)),
        "jax_device": as_jax_epochs,
    }
    for make in contenders.values():  # one untimed pass each: first-touch page faults, jax's first put
        warm_cache(shards)
        gen = make()
        next(gen)
        gen.close()
    def measure(who: str) -> tuple[float, float]:
        """Samples/s (wall, CPU) over ``passes`` hot epochs of one fresh loader."""
        passes = 1 if args.quick else PASSES["f32" if who.endswith("f32") else "bf16"]
        wall = cpu = 0.0
        gen = contenders[who]()
        for _ in range(passes):
            warm_cache(shards)
            pass_wall, pass_cpu, count = timed(lambda: next(gen))
            assert count == num, (who, count, num)
            wall, cpu = wall + pass_wall, cpu + pass_cpu
        gen.close()
        return passes * num / wall, passes * num / cpu

    pairs = [("jax_bf16", "torch_bf16"), ("jax_f32", "torch_f32"), ("jax_device", "torch_bf16")]
    results = {pair: {"ours": [], "base": [], "ours_cpu": [], "base_cpu": []} for pair in pairs}
    for rep in range(reps):
        for k, (ours, base) in enumerate(pairs):
            order = [ours, base] if (rep + k) % 2 == 0 else [base, ours]
            for who in order:
                rate, cpu_rate = measure(who)
                side = "ours" if who == ours else "base"
                results[(ours, base)][side].append(rate)
                results[(ours, base)][side + "_cpu"].append(cpu_rate)
                log(f"jaxloader rep {rep + 1}/{reps} {who}: {rate:.0f} samples/s")

    inputs = {"samples": num, "sample": FLUX_512 | {"dtype": "bfloat16", "bytes_on_disk": round(shard_bytes / num)},
              "shard_samples": 64, "shards": len(shards), "batch_size": BATCH,
              "epochs_per_measurement": {k: 1 if args.quick else v for k, v in PASSES.items()},
              "page_cache": "hot", "jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()],
              "loaders": "JaxLatentLoader / LatentLoader(snapshot, 8, seed=0, dtype=...) (defaults: prefetch=True, "
                         "io_threads=2), one per measurement, constructed inside its first epoch's timing"}

    def fig(name, pair, goal, notes):
        r = results[pair]
        cpu_ratios = [o / b for o, b in zip(r["ours_cpu"], r["base_cpu"])]
        return figure(name, r["ours"], r["base"], "samples/s", goal, inputs, notes,
                      details={"cpu_time_ratio": sorted(cpu_ratios)[len(cpu_ratios) // 2]})

    figures = [
        fig("16. JAX loader vs torch loader, bf16 output (hot)", ("jax_bf16", "torch_bf16"), ">= 0.8",
            "NumPy batches (ml_dtypes.bfloat16, the stored dtype: what a JAX step on a GPU should take) vs "
            "the torch loader's bf16 tensors; the same plan, reads and bytes (tests/test_jax_loader.py)"),
        fig("16. JAX loader vs torch loader, float32 output (hot)", ("jax_f32", "torch_f32"), ">= 0.8",
            "both convert bf16 -> float32 on the host (torch's conversion, shared)"),
        fig("JAX loader with jax.device_put (CPU device) vs torch loader, bf16 (hot)",
            ("jax_device", "torch_bf16"), None,
            "informational: as_jax=True, every array put on jax's default device and waited for"),
    ]
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return figures


def main(argv=None) -> None:
    run_benchmark("jaxloader", __doc__, run, argv)


if __name__ == "__main__":
    main()
