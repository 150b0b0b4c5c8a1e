"""Training from a snapshot on an object store: the streaming loader vs the same loader on a local copy.

Data: a latent cache of demo-shaped samples (the tiny Flux demo's: latents 16×16×16, text 32×64 + pooled 32,
float32, ~25 KB each), 2,400 of them (100 × the demo's 24; 240 with ``--quick``) in 10 shards, uploaded to a
moto S3 server started on loopback for the run (what the tests use). An epoch of 24 samples reads in
milliseconds, so the demo's own count would time the start-up alone.

Each repetition, side by side (alternating which goes first), one epoch at batch 8, start-up included:

* local: ``LatentLoader`` on the local copy, in the same state as the streamed side: against cold, its tars
  dropped from the page cache first (``drop_cache``: read from the disk); against hot, read once before (in
  the page cache; the cache stage's writer leaves them out of it);
* cold: ``LatentLoader(stream=ShardStream(...))`` into an empty cache folder (every shard downloaded, its
  sha256 checked), the manifest and indexes taken from a local copy of them, as ``latentmill train`` takes
  them from the work folder it pulled them into (``local_copy``: nothing of the tars);
* hot: the same into a cache folder already full, its tars read once before as the local copy's (no tar
  downloaded).

Also, from the cold epochs: HTTP requests per 1,000 samples (counted at the client, botocore's
``before-send`` event: every request s3fs sends) against the shards the epoch touched (and, in the figure's
details, a start-up with no local copy: the manifest, the empty prompt and each index from the store), and tar bytes
downloaded over the snapshot's tar bytes, with no limit and with ``cache_limit`` at 25% of the snapshot (one
rank: its share is the whole snapshot; there, the bytes of two epochs over two, since the prefetch of the next
epoch's first shard falls inside one) under the block shuffle that the start-up warning names for that limit
(``loader.shuffle_block: 1``; in the details, blocks of 2 shards, which leave the next block's first no room
ahead, and of 3, which the limit cannot hold).

Run alone: ``python -m bench.stream --quick``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import (
    drop_cache,
    figure,
    fresh_dir,
    interleave,
    log,
    reps_of,
    run_benchmark,
    setup_env,
    shard_paths,
    warm_cache,
    write_latent_cache,
)

setup_env()

DEMO_SAMPLE = {"latent": [16, 16, 16], "text_len": 32, "text_dim": 64, "pooled_dim": 32, "bucket": [128, 128, 1]}
BATCH = 8


@contextlib.contextmanager
def moto_server():
    """A moto S3 server on a free loopback port, its endpoint in the environment (dummy credentials)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=5).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_ENDPOINT_URL": url,
                       "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def epoch(cache: Path, batches: int, stream=None, shuffle_block=None) -> float:
    """Seconds to build the loader and read one epoch of ``batches`` batches."""
    from latentmill.trainer.loader import LatentLoader

    start = time.perf_counter()
    with LatentLoader(cache, BATCH, seed=0, stream=stream, shuffle_block=shuffle_block) as loader:
        for _ in itertools.islice(iter(loader), batches):
            pass
    return time.perf_counter() - start


def run(args) -> list:
    from latentmill.trainer.stream import ShardStream, cache_fit_warning

    from latentmill.core.store import store_fs

    samples = 240 if args.quick else 2400
    reps = reps_of(args, full=5, quick=2)
    root = fresh_dir("stream")
    local = root / "snapshot"
    manifest = write_latent_cache(local, samples, DEMO_SAMPLE, shard_samples=samples // 10, dtype_name="float32")
    tar_bytes = sum((local / e["path"]).stat().st_size for e in manifest["shards"])
    batches = -(-samples // BATCH)
    with moto_server():
        fs = store_fs("s3://bench")[0]  # the client the stream uses (store_fs's options): its requests are counted
        fs.mkdir("bench")
        fs.put(str(local) + "/", "bench/snap", recursive=True)
        url = "s3://bench/snap"
        sent = [0]
        fs.s3.meta.events.register("before-send.s3", lambda **_: sent.__setitem__(0, sent[0] + 1))
        cold_stats: list[dict] = []

        def cold(_rep: int) -> float:
            folder = root / "cold"
            shutil.rmtree(folder, ignore_errors=True)
            before = sent[0]
            stream = ShardStream(url, folder, local_copy=local)
            assert stream.fs is fs  # the counted client
            seconds = epoch(local, batches, stream)
            cold_stats.append({**stream.counters(), "http": sent[0] - before})
            return samples / seconds

        def hot(_rep: int) -> float:
            folder = root / "hot"
            if not folder.is_dir():
                epoch(local, batches, ShardStream(url, folder, local_copy=local))  # fills it
            warm_cache(sorted(folder.glob("*.tar")))
            return samples / epoch(local, batches, ShardStream(url, folder, local_copy=local))

        def local_cold(_rep: int) -> float:
            drop_cache(shard_paths(local, manifest))
            return samples / epoch(local, batches)

        def local_hot(_rep: int) -> float:
            warm_cache(shard_paths(local, manifest))
            return samples / epoch(local, batches)

        inputs = {"samples": samples, "shards": len(manifest["shards"]), "batch": BATCH, "tar_bytes": tar_bytes,
                  "sample": DEMO_SAMPLE, "store": "moto_server on loopback"}
        cold_v, base_c = interleave(reps, cold, local_cold, "cold")
        hot_v, base_h = interleave(reps, hot, local_hot, "hot")

        quarter, warnings = {}, {}
        for block in (1, 2, 3):
            small = ShardStream(url, root / f"small-{block}", cache_limit=tar_bytes // 4, local_copy=local)
            epoch(local, 2 * batches, small, shuffle_block=block)
            counters = small.counters()
            quarter[block] = {**counters, "bytes_per_epoch": counters["bytes_downloaded"] / 2}
            warnings[block] = cache_fit_warning(small, block)
        warnings[None] = cache_fit_warning(small, None)
        before = sent[0]
        bare = ShardStream(url, root / "bare")  # nothing local: the start-up reads the store too
        epoch(local, batches, bare)
        no_copy = {**bare.counters(), "http": sent[0] - before}
    shards = len(manifest["shards"])  # one bucket, shuffled: an epoch touches every shard
    http = [s["http"] * 1000 / samples for s in cold_stats]
    log(f"cold epochs: {cold_stats}; 25% limit, blocks of 1, 2 and 3 shards: {quarter}; no local copy: {no_copy}")
    return [
        figure("stream_cold_vs_local", cold_v, base_c, "samples/s", ">= 0.5", inputs,
               "one epoch into an empty cache folder (every shard downloaded and hashed) vs the local copy read "
               "from the disk (page cache dropped)",
               details={"cold_vs_local_in_page_cache": [c / h for c, h in zip(cold_v, base_h)]}),
        figure("stream_hot_vs_local", hot_v, base_h, "samples/s", ">= 0.8", inputs,
               "one epoch with the cache folder full (start-up: the manifest read, each index re-hashed)"),
        figure("stream_requests_per_1000_samples", http, [shards * 1000 / samples] * len(http), "requests", "<= 2",
               inputs, "HTTP requests of a cold epoch per 1,000 samples vs shards touched per 1,000 samples "
               "(the manifest, the empty prompt, an index and a tar per shard)",
               details={"cold_counters": cold_stats, "no_local_copy": no_copy,
                        "no_local_copy_per_1000_samples": no_copy["http"] * 1000 / samples}),
        figure("stream_bytes_per_epoch", [s["bytes_downloaded"] for s in cold_stats], [tar_bytes] * len(cold_stats),
               "bytes", "<= 1.05", inputs, "tar bytes downloaded in one epoch, no limit, vs the snapshot's tar bytes"),
        figure("stream_bytes_per_epoch_quarter_limit", [quarter[1]["bytes_per_epoch"]], [tar_bytes], "bytes",
               "<= 1.1", {**inputs, "cache_limit": tar_bytes // 4, "shuffle_block": 1},
               "the same with loader.cache_limit at 25% of the share and loader.shuffle_block 1 (what the start-up "
               "warning names for that limit): a shard at a time (two epochs' bytes over two)",
               details={"counters": quarter[1], **{f"shuffle_block_{b}": {**quarter[b], "ratio": quarter[b][
                   "bytes_per_epoch"] / tar_bytes} for b in (2, 3)}, "warnings": {str(k): v for k, v in warnings.items()}}),
    ]


def main(argv=None) -> None:
    run_benchmark("stream", __doc__, run, argv)


if __name__ == "__main__":
    main()
