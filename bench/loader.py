"""Figures 1 and 2: the trainer's LatentLoader against raw I/O, WebDataset, and one file per sample.

Data: ``N`` Flux-class 512² samples (latent 16×64×64, T5 77×4096, pooled 768, bf16: ~750 KB on disk each)
written with the cache stage's shard writer into shards of 64 samples (the size the cache stage writes:
one per bucket shard), plus the very same tensors as one safetensors file per sample. Figure 1c runs figure
1's contenders again on the largest image family's samples (FLUX.2 dev at 1024²: latent 128×64×64, three
stacked Mistral layers 512×15360, no pooled vector, ~16 MiB each; 128 of them, 32 with ``--quick``).

Contenders, each reading every sample once per epoch, batch size ``B``:

* ours: ``latentmill.trainer.loader.LatentLoader`` with its defaults (start-up from the shard index beside
  each tar, which the shard writer puts there; per batch, each member's safetensors header checked and
  its tensors read with ``os.preadv`` straight into the batch tensors, on ``io_threads=2`` threads for
  batches over 1 MiB; ``prefetch`` on, which in a tight loop like this one reads in the caller's thread),
  one loader per measurement as a training run has one for all its epochs,
  constructed inside the first epoch's timing; output dtype bf16 (the storage dtype);
* raw: a plain sequential read of the same shard files, 1 MiB at a time, bytes discarded;
* raw_fresh (figure 1c, hot): the same sequential read, each ``B`` samples' worth of bytes into a new
  ``torch.empty`` of that size: the memory a loader that hands out new batch tensors must write (a batch of
  FLUX.2 samples is 128 MiB, above glibc's 32 MiB ceiling for reusing freed blocks: every batch is a fresh
  mapping, page-faulted and zeroed by the kernel before the copy);
* webdataset: ``webdataset.WebDataset(shards).map(safetensors decode).to_tuple(...).batched(B)``;
* files: one safetensors file per sample, read with ``safetensors.torch.load_file`` in a shuffled order
  and stacked into batches of B.

A measurement is ``PASSES`` epochs (4; 1 with ``--quick``) of one contender (for ours: of one loader, its
start-up included), each epoch after its own untimed cache warm-up or drop: one hot epoch of 1,024 samples
takes ~0.1 s, short enough for a single hiccup of a shared machine to move it. Each baseline measurement is
paired with one of ours right next to it (alternating which goes first); the ratio of a pair is one
repetition. ``details.cpu_time_ratio`` is the same ratio computed from the CPU time of this process instead
of wall time: on a shared machine it moves less with other people's load.

"hot": every file read once before timing; "cold": ``os.sync()`` then ``POSIX_FADV_DONTNEED`` on every
file of the contender before timing. Run alone: ``python -m bench.loader --quick``.
"""

from __future__ import annotations

import time

from bench.common import (
    FLUX2_DEV_1024,
    FLUX_512,
    figure,
    fresh_dir,
    log,
    median,
    reps_of,
    run_benchmark,
    setup_env,
    shard_paths,
    timed,
    write_latent_cache,
)

setup_env()

PASSES = 4  # epochs per timed measurement (full size); each repetition pairs one measurement of each side


def write_per_file(root, cache_dir, manifest) -> list:
    """The same tensors as the latent shards, one safetensors file per sample."""
    from latentmill.stages.tarshard import read_shard
    from safetensors.torch import load, save_file

    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for path in shard_paths(cache_dir, manifest):
        for sample in read_shard(path):
            tensors = {**load(sample["vae.safetensors"]), **load(sample["text.safetensors"])}
            out = root / f"{sample['__key__']}.safetensors"
            save_file(tensors, str(out))
            paths.append(out)
    return paths


def measure(args, spec: dict, num: int, batch: int, shard_samples: int, passes: int, reps: int,
            pairs: list[tuple[str, str]], work) -> tuple[dict, dict]:
    """Write ``num`` samples shaped as ``spec`` (shards of ``shard_samples``) and time every ``(baseline,
    mode)`` of ``pairs`` against ours; returns the per-pair rates and the figures' inputs."""
    import torch
    import webdataset as wds
    from latentmill.trainer.loader import LatentLoader
    from safetensors.torch import load, load_file

    from bench.common import drop_cache, warm_cache

    t0 = time.perf_counter()
    manifest = write_latent_cache(work / "cache", num, spec, shard_samples=shard_samples, seed=0)
    shards = shard_paths(work / "cache", manifest)
    with_files = any(who == "files" for who, _ in pairs)
    files = write_per_file(work / "files", work / "cache", manifest) if with_files else []
    shard_bytes = sum(p.stat().st_size for p in shards)
    file_bytes = sum(p.stat().st_size for p in files)
    log(f"generated {num} samples ({shard_bytes / 2**20:.0f} MiB shards, {file_bytes / 2**20:.0f} MiB files) "
        f"in {time.perf_counter() - t0:.0f} s")
    columns = ("latents", "prompt_embeds") + (("pooled_prompt_embeds",) if spec.get("pooled_dim") else ())

    # Each contender is a generator: one ``next`` reads one epoch and gives its sample count. A measurement
    # starts a fresh one, so that the loader is constructed (its tar index read) inside the first epoch's
    # timing, then iterates epochs as a training run does: one loader, many epochs.
    def ours(dtype=torch.bfloat16):
        with LatentLoader(work / "cache", batch, seed=0, dtype=dtype) as loader:
            it = iter(loader)
            try:
                while True:
                    count = 0
                    for _ in range(len(loader)):
                        count += len(next(it)["keys"])
                    yield count
            finally:
                it.close()

    def raw():
        while True:
            for path in shards:
                with open(path, "rb", buffering=0) as fh:
                    while fh.read(1 << 20):
                        pass
            yield num

    fresh_bytes = batch * round(shard_bytes / num)

    def raw_fresh():
        while True:
            for path in shards:
                with open(path, "rb", buffering=0) as fh:
                    while fh.readinto(memoryview(torch.empty(fresh_bytes, dtype=torch.uint8).numpy())) == fresh_bytes:
                        pass
            yield num

    def decode(sample):
        return {**load(sample["vae.safetensors"]), **load(sample["text.safetensors"])}

    def webdataset():
        while True:
            ds = (wds.WebDataset([str(p) for p in shards], shardshuffle=False, empty_check=False)
                  .map(decode).to_tuple(*columns).batched(batch))
            yield sum(len(b[0]) for b in ds)

    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()

    def per_file():
        while True:
            count = 0
            for start in range(0, len(order), batch):
                samples = [load_file(str(files[i])) for i in order[start:start + batch]]
                out = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
                count += len(out["latents"])
            yield count

    contenders = {"ours": (ours, shards), "raw": (raw, shards), "raw_fresh": (raw_fresh, shards),
                  "webdataset": (webdataset, shards),
                  "files": (per_file, files), "ours_f32": (lambda: ours(torch.float32), shards)}
    contenders = {who: c for who, c in contenders.items() if who == "ours" or any(who == w for w, _ in pairs)}
    # One untimed pass of each first: the first pass of a process pays for page faults on fresh allocator
    # memory, which a training run pays once, not once per epoch.
    for fn, paths in contenders.values():
        warm_cache(paths)
        epochs = fn()
        next(epochs)
        epochs.close()
    log(f"warm-up passes done at {time.perf_counter() - t0:.0f} s")

    def one(who: str, mode: str) -> tuple[float, float]:
        """Samples/s (wall, CPU) over ``passes`` epochs, each after its own cache warm-up or drop (untimed):
        one 1,024-sample epoch is ~0.1 s hot, short enough for one hiccup of a shared machine to move it."""
        fn, paths = contenders[who]
        wall = cpu = 0.0
        epochs = fn()
        for _ in range(passes):
            if mode == "cold":
                drop_cache(paths)
            else:
                warm_cache(paths)
            pass_wall, pass_cpu, count = timed(lambda: next(epochs))
            assert count == num, (who, count, num)
            wall, cpu = wall + pass_wall, cpu + pass_cpu
        epochs.close()
        return passes * num / wall, passes * num / cpu

    # Each baseline is paired with a pass of ours right before or after it (alternating), so that both
    # see the same machine load; the ratio of each pair is one repetition.
    results = {pair: {"ours": [], "base": [], "ours_cpu": [], "base_cpu": []} for pair in pairs}
    for rep in range(reps):
        for k, (who, mode) in enumerate(pairs):
            names = ["ours", who] if (rep + k) % 2 == 0 else [who, "ours"]
            for name in names:
                rate, cpu_rate = one(name, mode)
                side = "ours" if name == "ours" else "base"
                results[(who, mode)][side].append(rate)
                results[(who, mode)][side + "_cpu"].append(cpu_rate)
                log(f"loader rep {rep + 1}/{reps} {mode} {name}: {rate:.0f} samples/s")

    construct = []  # how much of ours is the start-up from the shard indexes (hot)
    for _ in range(3):
        start = time.perf_counter()
        LatentLoader(work / "cache", batch, seed=0, dtype=torch.bfloat16).close()
        construct.append(time.perf_counter() - start)

    inputs = {"samples": num, "sample": spec | {"dtype": "bfloat16", "bytes_on_disk": round(shard_bytes / num)},
              "shard_samples": shard_samples, "shards": len(shards), "batch_size": batch,
              "epochs_per_measurement": passes,
              "loader": f"LatentLoader(cache_dir, {batch}, seed=0, dtype=bfloat16) (defaults: prefetch=True, "
                        "io_threads=2), one per measurement, constructed inside the timing of its first epoch"}
    if with_files:
        inputs["per_file_bytes"] = round(file_bytes / num)
    return {pair: r | {"construct": construct} for pair, r in results.items()}, inputs


def run(args) -> list:
    reps = reps_of(args, full=5, quick=2)
    passes = 1 if args.quick else PASSES
    work = fresh_dir("loader")
    pairs = [("raw", "hot"), ("webdataset", "hot"), ("files", "hot"), ("ours_f32", "hot"),
             ("raw", "cold"), ("webdataset", "cold"), ("files", "cold")]
    results, inputs = measure(args, FLUX_512, 128 if args.quick else 1024, 8, 64, passes, reps, pairs, work / "flux")
    # The largest image family's samples (~16 MiB each): fewer of them, so the epoch reads as many bytes as
    # ~2,700 FLUX.1 512² samples; one shard per 64 samples, as a 1 GiB unit of them holds.
    big_pairs = [("raw", "hot"), ("raw_fresh", "hot"), ("webdataset", "hot"), ("raw", "cold"), ("webdataset", "cold")]
    big, big_inputs = measure(args, FLUX2_DEV_1024, 32 if args.quick else 128, 8, 64, passes,
                              reps_of(args, full=3, quick=1), big_pairs, work / "flux2")

    def fig(name, who, mode, goal, notes, res=results, ins=inputs):
        r = res[(who, mode)]
        cpu_ratios = [o / b for o, b in zip(r["ours_cpu"], r["base_cpu"])]
        return figure(name, r["ours"], r["base"], "samples/s", goal, ins, notes,
                      details={"cpu_time_ratio": median(cpu_ratios),
                               "cpu_time_ratio_min_max": [median([min(cpu_ratios)]), median([max(cpu_ratios)])],
                               "loader_construct_s_hot": median(r["construct"])})

    raw_note = ("raw: the shard files read sequentially 1 MiB at a time by one thread, bytes discarded (hot, "
                "a page-cache memcpy); the loader copies each tensor once (os.preadv from the page cache "
                "into its row of the batch tensor; batches over 1 MiB on io_threads=2 threads: see "
                "details.cpu_time_ratio) and reads the shard indexes at start-up (details.loader_construct_s_hot)")
    wds_note = ("WebDataset(shards, shardshuffle=False).map(safetensors load).to_tuple(...).batched(8), "
                "no shuffle buffer")
    files_note = ("files: one safetensors file per sample (same tensors), load_file in a shuffled order, "
                  "torch.stack per batch of 8")
    big_note = "; FLUX.2 dev 1024² samples (family flux2: latents [128, 64, 64], prompt_embeds [512, 15360])"
    figures = [
        fig("1. loader vs raw sequential read (hot)", "raw", "hot", ">= 0.7", raw_note),
        fig("1. loader vs raw sequential read (cold)", "raw", "cold", ">= 0.7", raw_note),
        fig("1. loader vs WebDataset + decode (hot)", "webdataset", "hot", ">= 1.5", wds_note),
        fig("1. loader vs WebDataset + decode (cold)", "webdataset", "cold", ">= 1.5", wds_note),
        fig("2. loader vs one file per sample (hot)", "files", "hot", ">= 1.0", files_note),
        fig("2. loader vs one file per sample (cold)", "files", "cold", ">= 1.5", files_note),
    ]
    for who, mode, goal, note in [("raw", "hot", ">= 0.7", raw_note), ("raw", "cold", ">= 0.7", raw_note),
                                  ("webdataset", "hot", ">= 1.5", wds_note),
                                  ("webdataset", "cold", ">= 1.5", wds_note)]:
        base = "raw sequential read" if who == "raw" else "WebDataset + decode"
        figures.append(fig(f"1c. loader vs {base} ({mode}), FLUX.2 dev 1024² samples", who, mode, goal,
                           note + big_note, big, big_inputs))
    fresh_note = ("raw_fresh: the raw read, each batch's bytes (8 samples, 128 MiB) into a new torch.empty of that "
                  "size, as the loader's batch tensors are: fresh pages, faulted and zeroed by the kernel, then "
                  "written; the cost of the memory a trainer keeps, which the 1 MiB reused buffer of raw skips")
    figures.append(fig("1c. loader vs raw reads into fresh batch-sized buffers (hot), FLUX.2 dev 1024² samples",
                       "raw_fresh", "hot", ">= 0.7", fresh_note + big_note, big, big_inputs))
    r = results[("ours_f32", "hot")]  # here "ours" is the bf16 pass and the baseline the float32 pass
    figures.append(figure("1. loader float32 output (as train() asks on CPU) vs bf16 output (hot)",
                          r["base"], r["ours"], "samples/s", None, inputs,
                          "informational: the cost of the bf16 -> float32 conversion the trainer asks for"))
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return figures


def main(argv=None) -> None:
    run_benchmark("loader", __doc__, run, argv)


if __name__ == "__main__":
    main()
