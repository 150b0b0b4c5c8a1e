"""Near-duplicate dedup (issue 18): time per new sample as the index grows, 100,000 vs 10,000 embeddings.

What one measurement is: a refresh's near-duplicate step as the prep runs it (``stages/neardup.py``): open
the persistent index of ``N`` decided 768-dim embeddings from disk (the width of CLIP L/14's), enter a batch
of ``BATCH`` (1,000) new embeddings, decide them (search, exact cosine re-check, keep rule, decisions
written to SQLite) and close it (usearch saves its graph). Wall seconds / ``BATCH`` = time per new sample.
Each repetition starts from a copy of the same index folder (warm page cache for both sizes), with a fresh
batch: 10% of it are near copies (cosine ~0.95) of indexed embeddings, the rest random; every figure's
details say how many of the planted copies were found (all, when the search misses none).

Figures (ours: N = 100,000; baseline: N = 10,000; ``--quick``: 20,000 vs 2,000):

1. ``18.`` with the numpy LSH (random hyperplanes, multi-probe, bucket bits growing with N, candidates
   ranked by Hamming distance): what ``curate.dedup_index: auto`` uses from 4,096 vectors on, with or without
   the optional library. Goal <= 2.0.
2. ``18b.`` with usearch's HNSW (``curate.dedup_index: usearch``, ``pip install 'latentmill[dedup]'``).
   Goal <= 2.0. Measured here to decide whether ``auto`` should use it (it does not: slower than the LSH on
   this machine, and its recall of the planted copies falls at 100k on random vectors).

The details also hold brute force (``exact``) at both sizes, for scale: it grows linearly. The index of N
is built once per size and search (entered in batches of 10,000, marked decided without deciding it:
random vectors have no near duplicates, so that is the state deciding would leave). The vectors are
random, so LSH buckets are as even as they get; real embeddings cluster, and their buckets are less even.
1M: ``LATENTMILL_DEDUP_SIZES=100000,1000000 LATENTMILL_DEDUP_KINDS=lsh ... --reps 1`` measures it (minutes;
3 GB of vectors); by default the details give the extrapolation from the measured growth.

Run alone: ``python -m bench.dedup [--quick]``.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from bench.common import figure, fresh_dir, log, run_benchmark, setup_env

setup_env()

DIM = 768
BATCH = 1000
PLANTED = 100  # near copies per batch
THRESHOLD = 0.92


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def build(folder: Path, n: int, kind: str) -> None:
    """An index of ``n`` random embeddings, decided at ``THRESHOLD`` (none is a near duplicate)."""
    from latentmill.stages import neardup

    index = neardup.NearDupIndex(folder, DIM, kind)
    rng = np.random.default_rng(0)
    for start in range(0, n, 10000):
        count = min(10000, n - start)
        index.enter([f"base{i}" for i in range(start, start + count)], _unit(rng.standard_normal((count, DIM))),
                    [None] * count, [f"base-unit-{start}"])
    # hash / insert every vector and sort the LSH tables now, as the updates of a real index did batch by batch
    index.searcher().search(_unit(rng.standard_normal((1, DIM))), 1)
    with index.db:
        index.db.execute("INSERT OR REPLACE INTO decided VALUES (?, ?)", (THRESHOLD, n))
    index.close()


def batch(folder: Path, n: int, seed: int) -> tuple[list[str], np.ndarray, dict[str, str]]:
    """``BATCH`` new embeddings: ``PLANTED`` near copies (cosine ~0.95) of indexed ones, the rest random."""
    rng = np.random.default_rng(1000 + seed)
    sources = rng.choice(n, PLANTED, replace=False)
    store = np.memmap(folder / "vectors.f32", np.float32, "r", shape=(n, DIM))
    near = _unit(np.asarray(store[np.sort(sources)]) * 0.95 +
                 _unit(rng.standard_normal((PLANTED, DIM))) * np.sqrt(1 - 0.95 ** 2))
    vectors = np.concatenate([near, _unit(rng.standard_normal((BATCH - PLANTED, DIM)))])
    order = rng.permutation(BATCH)
    keys = [f"new{seed}-{i}" for i in range(BATCH)]
    expected = {keys[int(np.where(order == i)[0][0])]: f"base{s}" for i, s in enumerate(np.sort(sources))}
    return keys, vectors[order], expected


def refresh(folder: Path, kind: str, keys: list[str], vectors: np.ndarray) -> tuple[float, float, dict[str, str]]:
    """Open, enter, decide, close: (wall seconds, CPU seconds of this process, found near duplicates
    key -> owner)."""
    from latentmill.stages import neardup

    start, cpu = time.perf_counter(), time.process_time()
    index = neardup.NearDupIndex(folder, DIM, kind)
    index.enter(keys, vectors, [None] * len(keys), ["new-unit"])
    index.decide(THRESHOLD)
    found = index.duplicates(THRESHOLD, keys)
    index.close()
    return time.perf_counter() - start, time.process_time() - cpu, {k: o for k, (o, _) in found.items()}


def measure(work: Path, n: int, kind: str, reps: int) -> tuple[list[float], dict]:
    """Per-sample seconds of ``reps`` refreshes of an index of ``n``, and what they found."""
    base = work / f"{kind}-{n}"
    if not base.is_dir():
        start = time.perf_counter()
        build(base, n, kind)
        log(f"built {kind} index of {n} in {time.perf_counter() - start:.1f} s")
    per_sample, cpu_per_sample, recall = [], [], []
    for rep in range(reps):
        folder = work / "run"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(base, folder)
        keys, vectors, expected = batch(base, n, rep)
        seconds, cpu, found = refresh(folder, kind, keys, vectors)
        per_sample.append(seconds / BATCH)
        cpu_per_sample.append(cpu / BATCH)
        recall.append(sum(found.get(k) == o for k, o in expected.items()) / len(expected))
        extra = len(set(found) - set(expected))
        log(f"{kind} N={n} rep {rep + 1}/{reps}: {1000 * seconds / BATCH:.3f} ms/sample, found "
            f"{recall[-1]:.0%} of the planted copies, {extra} others")
    shutil.rmtree(work / "run", ignore_errors=True)
    return per_sample, {"recall": recall, "ms_per_sample": [round(1000 * s, 4) for s in per_sample],
                        "cpu_ms_per_sample": [round(1000 * s, 4) for s in cpu_per_sample]}


def run(args) -> list:
    from latentmill.stages import neardup

    sizes = os.environ.get("LATENTMILL_DEDUP_SIZES")
    small, large = (int(s) for s in sizes.split(",")) if sizes else ((2000, 20000) if args.quick else (10000, 100000))
    reps = args.reps or (2 if args.quick else 5)
    work = fresh_dir("dedup")
    kinds = os.environ.get("LATENTMILL_DEDUP_KINDS", "lsh,usearch,exact").split(",")
    kinds = [k for k in kinds if k != "usearch" or neardup.usearch_available()]
    results: dict[str, dict[int, tuple[list[float], dict]]] = {}
    old_exact = neardup.EXACT_BELOW
    neardup.EXACT_BELOW = 0  # lsh means lsh here, even on a small index
    try:
        for kind in kinds:
            results[kind] = {n: measure(work, n, kind, 1 if kind == "exact" else reps) for n in (small, large)}
            for n in (small, large):
                shutil.rmtree(work / f"{kind}-{n}", ignore_errors=True)
    finally:
        neardup.EXACT_BELOW = old_exact
        shutil.rmtree(work, ignore_errors=True)
    inputs = {"dim": DIM, "indexed": [small, large], "new_per_refresh": BATCH, "planted_near_copies": PLANTED,
              "threshold": THRESHOLD, "neighbours": neardup.NEIGHBOURS, "reps": reps,
              "lsh": {"tables": neardup.LshSearch.TABLES, "bits": neardup.LshSearch.BITS,
                      "per_bucket": neardup.LshSearch.PER_BUCKET},
              "usearch": {"dtype": "f16", "connectivity": 16, "expansion_add": 64, "expansion_search": 128}}
    details = {kind: {str(n): d for n, (_, d) in by_n.items()} for kind, by_n in results.items()}
    for kind, by_n in results.items():  # t(N) ~ N^a from the two sizes: t(10 N) = t(N) * ratio
        ratio = np.median(by_n[large][0]) / np.median(by_n[small][0])
        details[kind]["extrapolated_ms_per_sample_at_10x_large"] = round(
            1000 * float(np.median(by_n[large][0])) * ratio ** (np.log10(10) / np.log10(large / small)), 4)
    figures = []
    names = {"lsh": "18. near-dup dedup time per new sample at 100k vs 10k indexed embeddings",
             "usearch": "18b. near-dup dedup time per new sample at 100k vs 10k indexed embeddings (usearch "
                        "HNSW, optional)"}
    for kind, name in names.items():
        if kind not in results:
            continue
        ours, base = results[kind][large][0], results[kind][small][0]
        figures.append(figure(
            name if (small, large) == (10000, 100000) else name.replace("100k vs 10k",
                                                                        f"{large // 1000}k vs {small // 1000}k"),
            [1000 * s for s in ours], [1000 * s for s in base], "ms/sample", "<= 2.0", {**inputs, "search": kind},
            f"open the index of N from disk, enter {BATCH} new embeddings (10% near copies), decide, close; "
            f"per new sample. Brute force for scale in details (exact); the 10x-larger extrapolation assumes "
            f"the growth measured here continues.", details=details))
    return figures


def main(argv=None) -> None:
    run_benchmark("dedup", __doc__, run, argv)


if __name__ == "__main__":
    main()
