"""The streaming loader (latentmill.trainer.stream): a snapshot's shards read from a real S3 server (moto's,
tests/conftest.py) through a bounded local cache give the very batches the local loader gives; a damaged
object is fetched again once, then named; a killed download is never read."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import pytest
import torch
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.shard_check import CorruptShardError
from latentmill.trainer.stream import PARTIAL, ShardStream, parse_bytes

from latentmill.core.config import ConfigError
from tests.helpers import store
from tests.trainer_helpers import write_fake_cache

BUCKETS = {(16, 16, 1): 12, (32, 16, 1): 8}  # 20 samples in 6 shards (3 per bucket)


def _snapshot_on_store(root: Path, bucket: str) -> tuple[str, dict]:
    """A cache written locally, then uploaded as it is: its URL on the store and its manifest."""
    manifest = write_fake_cache(root, BUCKETS, shards_per_bucket=3, seed=3)
    store("s3").put(str(root) + "/", f"{bucket}/snap", recursive=True)
    return f"s3://{bucket}/snap", manifest


def _batches(loader: LatentLoader, n: int) -> list[dict]:
    with loader:
        return list(itertools.islice(iter(loader), n))


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"] and x["bucket"] == y["bucket"] and x["ordinals"] == y["ordinals"]
        for name in ("latents", "prompt_embeds", "pooled_prompt_embeds"):
            assert torch.equal(x[name], y[name]), name


def _tar_bytes(root: Path, manifest: dict) -> list[int]:
    return [(root / e["path"]).stat().st_size for e in manifest["shards"]]


def test_sizes_parse_from_ints_and_strings():
    assert parse_bytes(None, "k") is None
    assert parse_bytes(1234, "k") == 1234
    assert parse_bytes("20GB", "k") == 20 * 10**9
    assert parse_bytes("512MiB", "k") == 512 * 2**20
    assert parse_bytes("1.5k", "k") == 1500
    with pytest.raises(ConfigError, match=r"^loader.cache_limit: 'lots' is not a size"):
        parse_bytes("lots", "loader.cache_limit")
    with pytest.raises(ConfigError, match=r"^loader.cache_limit: a size in bytes must be >= 1, got 0"):
        parse_bytes(0, "loader.cache_limit")


def test_streamed_batches_equal_local_ones_with_and_without_evictions(s3_bucket, tmp_path):
    local = tmp_path / "cache"
    url, manifest = _snapshot_on_store(local, s3_bucket)
    sizes = _tar_bytes(local, manifest)
    steps = 15  # three epochs of 5 batches (batch 4: 3 + 2 batches)
    expected = _batches(LatentLoader(local, 4, seed=7), steps)

    # no limit: every shard downloaded once, whatever the epochs; one request for the manifest, the empty
    # prompt, each index and each tar
    stream = ShardStream(url, tmp_path / "hot")
    _same(_batches(LatentLoader(local, 4, seed=7, stream=stream), steps), expected)
    counters = stream.counters()
    assert counters["downloads"] == len(sizes) and counters["bytes_downloaded"] == sum(sizes)
    assert counters["evictions"] == 0 and counters["requests"] == 2 + 2 * len(sizes)
    assert sorted(p.name for p in (tmp_path / "hot").glob("*.tar")) == sorted(
        Path(e["path"]).name for e in manifest["shards"])

    # a second run on the full cache downloads no tar
    again = ShardStream(url, tmp_path / "hot")
    _same(_batches(LatentLoader(local, 4, seed=7, stream=again), steps), expected)
    assert again.counters()["downloads"] == 0 and again.counters()["requests"] == 1

    # a limit of three shards (what one batch may read): shards are evicted and fetched again, the batches
    # stay the same, and the cache never holds more
    limit = 3 * max(sizes)
    small = ShardStream(url, tmp_path / "small", cache_limit=limit)
    seen = []
    loader = LatentLoader(local, 4, seed=7, stream=small)
    with loader:
        for batch in itertools.islice(iter(loader), steps):
            seen.append(batch)
            assert sum(p.stat().st_size for p in (tmp_path / "small").glob("*.tar")) <= limit
    _same(seen, expected)
    assert small.counters()["evictions"] > 0 and small.counters()["bytes_downloaded"] > sum(sizes)


def test_a_damaged_object_is_fetched_again_once_then_named(s3_bucket, tmp_path):
    local = tmp_path / "cache"
    url, manifest = _snapshot_on_store(local, s3_bucket)
    fs = store("s3")
    damaged = f"{s3_bucket}/snap/{manifest['shards'][0]['path']}"
    data = bytearray(fs.cat_file(damaged))
    data[700] ^= 0xFF
    fs.pipe_file(damaged, bytes(data))
    stream = ShardStream(url, tmp_path / "stream")
    loader = LatentLoader(local, 4, seed=7, stream=stream)
    with pytest.raises(CorruptShardError) as err, loader:
        list(itertools.islice(iter(loader), 15))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    assert str(err.value) == (
        f"cache shard s3://{damaged} differs from the snapshot's manifest after two downloads (expected sha256 "
        f"{manifest['shards'][0]['sha256']}, actual {actual}); run `latentmill verify {url}` and re-run the "
        "prep to rebuild it")
    assert not (tmp_path / "stream" / Path(damaged).name).exists()  # never renamed into place
    assert stream.counters()["downloads"] >= 2


def test_a_killed_download_is_never_read(s3_bucket, tmp_path):
    local = tmp_path / "cache"
    url, manifest = _snapshot_on_store(local, s3_bucket)
    cache = tmp_path / "stream"
    cache.mkdir()
    names = [Path(e["path"]).name for e in manifest["shards"]]
    # a download killed midway (its first half under the temporary name), and a tar of the wrong size
    first = (local / manifest["shards"][0]["path"]).read_bytes()
    (cache / (names[0] + PARTIAL)).write_bytes(first[: len(first) // 2])
    (cache / names[1]).write_bytes(b"\0" * 100)
    stream = ShardStream(url, cache)
    assert not (cache / (names[0] + PARTIAL)).exists()
    expected = _batches(LatentLoader(local, 4, seed=7), 5)
    _same(_batches(LatentLoader(local, 4, seed=7, stream=stream), 5), expected)
    assert stream.counters()["downloads"] == len(names)  # both fetched whole, from the store
    assert (cache / names[0]).read_bytes() == first
    # the model card's captions, read after the loader closed, come through the stream's cache too
    captions = list(LatentLoader(local, 4, seed=7).captions())
    assert len(captions) == 20 and captions == list(LatentLoader(local, 4, seed=7, stream=ShardStream(url, cache)).captions())


def test_a_block_shuffle_fetches_each_shard_about_once_under_a_quarter_limit(s3_bucket, tmp_path):
    """With the cache limit at 25% of the snapshot (2 of 8 shards), the whole-bucket shuffle downloads the
    snapshot many times over an epoch; ``shuffle_block=1`` reads a shard at a time and downloads it once, with
    the batches of the same order on the local copy. The start-up says which block fits."""
    from latentmill.trainer.stream import cache_fit_warning

    local = tmp_path / "cache"
    manifest = write_fake_cache(local, {(16, 16, 1): 32}, shards_per_bucket=8, seed=5)
    store("s3").put(str(local) + "/", f"{s3_bucket}/blocks", recursive=True)
    url, sizes = f"s3://{s3_bucket}/blocks", _tar_bytes(local, manifest)
    limit, steps = sum(sizes) // 4, 8  # one epoch of global batches of 4

    whole = ShardStream(url, tmp_path / "whole", cache_limit=limit)
    _batches(LatentLoader(local, 4, seed=7, stream=whole), steps)
    assert whole.counters()["bytes_downloaded"] > 2 * sum(sizes)
    assert cache_fit_warning(whole, None) == (
        f"loader.cache_limit: {limit} bytes hold 2 of the snapshot's 8 shards ({sum(sizes)} bytes) and each bucket "
        "is shuffled whole, so an epoch downloads the snapshot many times over; set loader.shuffle_block=1 (shards "
        "per shuffle block) to fetch each shard about once per epoch")

    blocks = ShardStream(url, tmp_path / "blocks", cache_limit=limit)
    expected = _batches(LatentLoader(local, 4, seed=7, shuffle_block=1), 2 * steps)
    _same(_batches(LatentLoader(local, 4, seed=7, stream=blocks, shuffle_block=1), 2 * steps), expected)
    # two epochs: each shard once per epoch, and at most the next epoch's first, prefetched before the loader closed
    counters = blocks.counters()
    assert counters["bytes_downloaded"] <= 1.1 * 2 * sum(sizes) and counters["downloads"] <= 2 * len(sizes) + 1
    assert cache_fit_warning(blocks, 1) is None
    assert cache_fit_warning(blocks, 2) is None  # 2 shards fit: the next block waits for room
    assert cache_fit_warning(blocks, 3) == (
        f"loader.shuffle_block: a block of 3 shards takes up to {3 * max(sizes)} bytes, more than loader.cache_limit "
        f"({limit}): the cache goes over it for a batch's shards or fetches shards again within a block; set "
        f"loader.shuffle_block=1 or raise loader.cache_limit to {4 * max(sizes)} (a block and the next block's "
        "first shard)")


def test_the_ranks_of_a_node_download_each_tar_once_and_the_last_to_let_it_go_frees_it(s3_bucket, tmp_path):
    """Two ranks in lockstep (threads, as torchrun's processes on one node) stream into their own folders of one
    cache folder: each tar is downloaded once for both (the other rank links the node's copy), each rank reads
    the batches of the same rank on the local copy; under a limit, a tar a rank evicts stays while the other
    holds it, and the last rank to let it go deletes the node's copy."""
    import threading

    from latentmill.trainer.stream import StreamSource

    local = tmp_path / "cache"
    url, manifest = _snapshot_on_store(local, s3_bucket)
    sizes, steps = _tar_bytes(local, manifest), 10

    def two_ranks(source: StreamSource) -> tuple[list[ShardStream], list[list[dict]]]:
        streams = [source.open(rank) for rank in range(2)]
        got: list[list[dict]] = [[], []]
        barrier = threading.Barrier(2)

        def rank(r: int) -> None:
            with LatentLoader(local, 4, seed=7, rank=r, world_size=2, stream=streams[r]) as loader:
                for batch in itertools.islice(iter(loader), steps):
                    got[r].append(batch)
                    barrier.wait(timeout=60)  # the step's all-reduce

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        for r in range(2):
            _same(got[r], _batches(LatentLoader(local, 4, seed=7, rank=r, world_size=2), steps))
        return streams, got

    streams, _ = two_ranks(StreamSource(url, str(tmp_path / "node")))
    counters = [s.counters() for s in streams]
    assert sum(c["downloads"] for c in counters) == len(sizes)  # each tar once for the node, not once per rank
    assert sum(c["bytes_downloaded"] for c in counters) == sum(sizes)
    assert sum(c["shared"] for c in counters) == len(sizes)  # and linked into the other rank's folder
    pool = tmp_path / "node" / "shared"
    assert sorted(p.name for p in pool.iterdir()) == sorted(Path(e["path"]).name for e in manifest["shards"])
    assert all(p.stat().st_nlink == 3 for p in pool.iterdir())  # the node's copy and both ranks' links

    # a limit of three shards: evictions, and no tar left in the node's folder that no rank holds
    streams, _ = two_ranks(StreamSource(url, str(tmp_path / "small"), cache_limit=3 * max(sizes)))
    assert all(s.counters()["evictions"] > 0 for s in streams)
    held = {p.name for r in range(2) for p in (tmp_path / "small" / f"rank-{r}").glob("*.tar")}
    pooled = {p.name for p in (tmp_path / "small" / "shared").glob("*.tar")}
    assert pooled == held and all(p.stat().st_nlink >= 2 for p in (tmp_path / "small" / "shared").glob("*.tar"))
    alone = ShardStream(url, tmp_path / "alone", cache_limit=3 * max(sizes))  # one rank's share, no node folder
    _batches(LatentLoader(local, 4, seed=7, rank=0, world_size=2, stream=alone), steps)
    node = sum(s.counters()["bytes_downloaded"] for s in streams)
    # measured: the node 1.25-1.29 x one rank alone (two ranks without the node folder: 2 x); each rank evicts
    # on its own, so a tar one let go and the other still wants is fetched again at times
    assert node < 1.6 * alone.counters()["bytes_downloaded"]


def test_without_hard_links_each_rank_downloads_its_own_tars(s3_bucket, tmp_path, monkeypatch, caplog):
    """A cache folder on a file system that refuses hard links (some network and FUSE mounts): the node's
    sharing is dropped with one warning, and the rank streams as before."""
    import logging
    import os

    from latentmill.trainer.stream import StreamSource

    local = tmp_path / "cache"
    url, manifest = _snapshot_on_store(local, s3_bucket)

    def refuse(src, dst):  # what such a mount answers
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    stream = StreamSource(url, str(tmp_path / "node")).open(0)
    with caplog.at_level(logging.WARNING, logger="latentmill.trainer.stream"):
        _same(_batches(LatentLoader(local, 4, seed=7, stream=stream), 5), _batches(LatentLoader(local, 4, seed=7), 5))
    assert stream.counters()["downloads"] == len(manifest["shards"]) and stream.counters()["shared"] == 0
    assert [r.message for r in caplog.records if "no hard links" in r.message] == [
        f"{tmp_path / 'node' / 'shared'}: no hard links here ([Errno 1] Operation not permitted): each rank of the "
        "node downloads its own tars"]
    assert list((tmp_path / "node" / "shared").iterdir()) == []


def test_a_claim_left_by_a_dead_rank_is_taken_over(s3_bucket, tmp_path):
    """A rank killed while it downloaded a tar for the node leaves its claim: the next rank that wants the tar
    takes it over (a claim naming a dead process, or one whose PID was never written), instead of waiting."""
    import os
    import subprocess
    import sys

    from latentmill.trainer.stream import CLAIM_WRITE_S, StreamSource

    local = tmp_path / "cache"
    url, manifest = _snapshot_on_store(local, s3_bucket)
    names = [Path(e["path"]).name for e in manifest["shards"]]
    pool = tmp_path / "node" / "shared"
    pool.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (pool / f"{names[0]}.claim").write_text(dead.stdout.strip())
    (pool / f"{names[1]}.claim").write_text("")  # killed between creating the claim and writing its PID
    old = os.stat(pool / f"{names[1]}.claim").st_mtime - CLAIM_WRITE_S - 1
    os.utime(pool / f"{names[1]}.claim", (old, old))
    stream = StreamSource(url, str(tmp_path / "node")).open(0)
    _same(_batches(LatentLoader(local, 4, seed=7, stream=stream), 5), _batches(LatentLoader(local, 4, seed=7), 5))
    assert stream.counters()["downloads"] == len(names)
    assert sorted(p.name for p in pool.iterdir()) == sorted(names)  # the tars, no claim left
