"""Training from a snapshot on an object store: ``ShardStream`` downloads the shards a rank's batches read
into a bounded local cache folder, ahead of the step.

At start-up it reads the snapshot's manifest and every shard's index (small files, kept in the cache folder
beside the tars, as the loader expects them) from ``local_copy`` where a copy with the manifest's sha256 is
there (the work folder's, which ``latentmill train`` pulled), else from the store; the tars come later, as
batches need them, one GET each.
``LatentLoader`` (``stream=``) tells it, a few batches ahead of the step, which shards each coming batch reads
(``want``); two background threads download them in that order while they fit under ``cache_limit`` bytes, and
the loader waits (``ready``) only for a shard not there yet. To make room, the shards no coming batch reads
go first (those this rank has finished with for the epoch, then the least recently used), and only for the
batch being read, the shards wanted furthest ahead; a shard the batch being read needs is never evicted. The
download a batch waits for goes ahead even over the limit: the cache holds at most the limit or one batch's
shards, whichever is more.

A download goes to ``<name>.partial`` and is renamed into place only once whole and equal to the manifest's
sha256 (a killed download is never read; leftovers are removed at start-up); a mismatch is fetched once
more, then ``CorruptShardError`` names the shard. Counters (``requests``, ``bytes_downloaded``,
``downloads``, ``evictions``) feed the run summary and the benchmark.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import shutil
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from latentmill.trainer.shard_check import CorruptShardError

from latentmill.core.config import ConfigError
from latentmill.core.hashing import sha256_file

log = logging.getLogger(__name__)

PARTIAL = ".partial"  # suffix of a shard being downloaded: renamed into place once whole and checked
AHEAD_BATCHES = 8  # the loader announces this many of its coming batches (their shards are downloaded first)
DOWNLOAD_THREADS = 2  # downloads at once: one request's latency overlaps another's transfer
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(value: int | str | None, key: str) -> int | None:
    """A size in bytes from an int or a string like ``"20GB"``, ``"512MiB"``, ``"1.5g"`` (None: no limit)."""
    if value is None or isinstance(value, int):
        if value is not None and value < 1:
            raise ConfigError(f"{key}: a size in bytes must be >= 1, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f"{key}: {value!r} is not a size; give bytes (20000000000) or a string like '20GB', "
                          "'512MiB'")
    number, unit = float(match.group(1)), match.group(2).lower()
    binary = "i" in unit
    scale = _UNITS[unit[:1] if unit[:1] != "b" else ""]
    if binary:
        scale = 1024 ** {"k": 1, "m": 2, "g": 3, "t": 4}[unit[0]]
    size = int(number * scale)
    if size < 1:
        raise ConfigError(f"{key}: a size in bytes must be >= 1, got {value!r}")
    return size


class ShardStream:
    """The shards of the snapshot at ``url`` (an fsspec URL of its folder), downloaded into ``cache_dir`` as
    they are wanted; at most ``cache_limit`` bytes of tars kept (None: no limit)."""

    def __init__(self, url: str, cache_dir: str | Path, cache_limit: int | None = None,
                 local_copy: str | Path | None = None, pool: str | Path | None = None) -> None:
        from latentmill.core.store import store_fs

        self.url = url.rstrip("/")
        self.fs, self.root = store_fs(self.url)
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.limit = cache_limit
        self.pool = Path(pool) if pool is not None else None  # the node's tars, shared by its ranks' streams
        if self.pool is not None:
            self.pool.mkdir(parents=True, exist_ok=True)
        self.requests = self.bytes_downloaded = self.downloads = self.evictions = self.shared = 0
        self.local_copy = Path(local_copy) if local_copy is not None else None
        if self.local_copy is not None and (self.local_copy / "manifest.json").is_file():  # a snapshot's name
            self.manifest = json.loads((self.local_copy / "manifest.json").read_text())  # is its content
        else:
            self._get("manifest.json", self.cache_dir / "manifest.json")
            self.manifest = json.loads((self.cache_dir / "manifest.json").read_text())
        entries = self.manifest.get("shards") or []
        self.remote = [self._remote(e["path"]) for e in entries]
        self.local = [self.cache_dir / posixpath.basename(e["path"]) for e in entries]
        self.sizes = [0] * len(entries)
        self._entries = entries
        for leftover in self.cache_dir.glob("*" + PARTIAL):  # a download killed midway: never read
            leftover.unlink()
        for orphan in self.pool.glob("*.tar") if self.pool is not None else ():  # no rank holds it: a crash
            with contextlib.suppress(FileNotFoundError):  # between a rank's two unlinks left it
                if orphan.stat().st_nlink == 1:
                    orphan.unlink()
        for staged in self.pool.glob("*" + PARTIAL) if self.pool is not None else ():  # <tar>.<pid>.partial
            pid = staged.name.removesuffix(PARTIAL).rsplit(".", 1)[-1]
            if not (pid.isdigit() and _pid_alive(int(pid))):
                staged.unlink(missing_ok=True)
        self._present: OrderedDict[int, int] = OrderedDict()  # shard -> bytes, least recently used first
        for shard, path in enumerate(self.local):
            if path.is_file():  # renamed into place only after its sha256 matched
                self._present[shard] = self.sizes[shard] = path.stat().st_size
        self._pins: set[int] = set()  # shards of the batch being read
        self._wanted: dict[int, int] = {}  # shard -> coming batches (announced, not read yet) that read it
        self._finished: set[int] = set()  # shards this rank reads no more in the epoch: evicted first
        self._queue: deque[int] = deque()  # wanted shards in the order of the batches
        self._urgent: set[int] = set()  # shards a batch waits for now: fetched even over the limit
        self._failed: dict[int, str] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.on_evict: Callable[[int], None] | None = None  # the loader closes an evicted shard's file
        self._fetch_indexes(entries)
        self._inflight: dict[int, int] = {}  # shards being downloaded -> their bytes (counted as used)
        self._threads = [threading.Thread(target=self._run, name=f"latent-stream-{i}", daemon=True)
                         for i in range(DOWNLOAD_THREADS)]
        for thread in self._threads:
            thread.start()

    # ---------------------------------------------------------------- start-up: manifest and indexes
    def _remote(self, rel: str) -> str:
        return posixpath.normpath(posixpath.join(self.root, rel))

    def _get(self, rel: str, path: Path) -> None:
        """Download the snapshot's file ``rel`` to ``path`` (one GET), through its ``.partial`` name."""
        tmp = path.with_name(path.name + PARTIAL)
        self.requests += 1
        self.fs.get_file(self._remote(rel), str(tmp))
        os.replace(tmp, path)

    def _fetch_indexes(self, entries: list[dict]) -> None:
        """Every shard's index (and the empty prompt's tensors) beside where its tar will be: kept if a copy
        with the manifest's sha256 is there, else copied from ``local_copy``'s, else downloaded."""
        small = [(posixpath.join(posixpath.dirname(e["path"]), e["index"]["name"]), e["index"]["sha256"])
                 for e in entries if e.get("index")]
        if self.manifest.get("empty_prompt"):
            small.append((self.manifest["empty_prompt"]["path"], self.manifest["empty_prompt"].get("sha256")))
        for rel, sha in small:
            path = self.path_of(rel)
            if path.is_file() and (sha is None or sha256_file(path) == sha):
                continue
            copy = self.local_copy / rel if self.local_copy is not None else None
            if copy is not None and copy.is_file() and (sha is None or sha256_file(copy) == sha):
                shutil.copyfile(copy, path.with_name(path.name + PARTIAL))
                os.replace(path.with_name(path.name + PARTIAL), path)
            else:
                self._get(rel, path)

    def path_of(self, rel: str) -> Path:
        """The local path of the snapshot's file ``rel`` (a path relative to its manifest)."""
        return self.cache_dir / posixpath.basename(rel)

    def expect_sizes(self, sizes: list[int]) -> None:
        """Each tar's size, from its index (read by the loader): a cached copy of another size is dropped."""
        with self._cond:
            for shard, size in enumerate(sizes):
                if shard in self._present and self._present[shard] != size:
                    del self._present[shard]
                    self._drop(shard, self.local[shard])
                self.sizes[shard] = size

    # ---------------------------------------------------------------- the loader's side
    def want(self, shards: Iterable[int]) -> None:
        """A coming batch reads ``shards``: queue those not here for download, in the batches' order."""
        with self._cond:
            queued = len(self._queue)
            for shard in shards:
                self._wanted[shard] = self._wanted.get(shard, 0) + 1
                self._finished.discard(shard)
                if shard not in self._present and shard not in self._queue:
                    self._queue.append(shard)
            if len(self._queue) > queued:  # a wake-up per batch costs the reading thread the GIL
                self._cond.notify_all()

    def ready(self, shards: Iterable[int]) -> None:
        """The batch to be read next reads ``shards`` (the previous one was read): block until each is in the
        cache; ``CorruptShardError`` names one that could not be fetched whole and equal to the manifest."""
        shards = list(shards)
        with self._cond:
            self._pins = set(shards)
            self._urgent.update(s for s in shards if s not in self._present)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._closed or any(s in self._failed for s in shards)
                                or all(s in self._present for s in shards))
            bad = next((s for s in shards if s in self._failed), None)
            if bad is not None:
                raise CorruptShardError(self._failed[bad])
            for shard in shards:
                self._present.move_to_end(shard)

    def release(self, shards: Iterable[int], finished: Iterable[int] = ()) -> None:
        """A wanted batch was read; ``finished``: its shards this rank reads no more this epoch."""
        with self._cond:
            for shard in shards:
                left = self._wanted.get(shard, 0) - 1
                if left > 0:
                    self._wanted[shard] = left
                else:
                    self._wanted.pop(shard, None)
            self._finished.update(finished)
            if self._queue:  # room may have been made for a shard that waits
                self._cond.notify_all()

    def fetch_now(self, shard: int) -> None:
        """Bring shard ``shard`` into the cache in this thread (reading after the loader closed: the model
        card's captions), making room under the limit first."""
        with self._cond:
            if shard in self._present:
                return
            if self.limit is not None:
                self._make_room(self.sizes[shard], force=True)
        problem = self._download(shard)
        if problem is not None:
            raise CorruptShardError(problem)
        with self._cond:
            self._place(shard)

    def cached_bytes(self) -> int:
        with self._cond:
            return sum(self._present.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def counters(self) -> dict[str, int]:
        """What the stream did so far: requests to the store, bytes and tars downloaded, tars evicted, tars
        taken from another rank's download (``shared``)."""
        return {"requests": self.requests, "bytes_downloaded": self.bytes_downloaded, "downloads": self.downloads,
                "evictions": self.evictions, "shared": self.shared}

    # ---------------------------------------------------------------- the download threads
    def _next(self) -> int | None:
        """The next shard to download (under the lock), evicting what must go to make room; None: wait."""
        for shard in list(self._urgent) + list(self._queue):
            if shard in self._inflight:
                continue
            if shard in self._present or shard in self._failed:
                self._urgent.discard(shard)
                if shard in self._queue:
                    self._queue.remove(shard)
                continue
            urgent = shard in self._urgent
            size = self.sizes[shard]
            if self.limit is not None and not self._make_room(size, force=urgent):
                return None
            self._urgent.discard(shard)
            if shard in self._queue:
                self._queue.remove(shard)
            self._inflight[shard] = size
            return shard
        return None

    def _make_room(self, size: int, force: bool) -> bool:
        """Evict shards until ``size`` more bytes fit under the limit: those no coming batch reads (finished
        ones first, then least recently used), then (``force``: for the batch being read) those wanted furthest
        ahead, never one the batch being read needs. False when the bytes do not fit (``force``: go over)."""
        used = sum(self._present.values()) + sum(self._inflight.values())
        candidates = [s for s in self._present if s not in self._pins and s not in self._wanted]
        candidates.sort(key=lambda s: s not in self._finished)  # stable: LRU order within each group
        if force:
            ahead = [s for s in reversed(self._queue_order()) if s in self._present and s not in self._pins]
            candidates += ahead
        while used + size > self.limit and candidates:
            victim = candidates.pop(0)
            used -= self._present.pop(victim)
            self._finished.discard(victim)
            if self.on_evict is not None:
                self.on_evict(victim)
            self._drop(victim, self.local[victim])
            self.evictions += 1
            if victim in self._wanted:  # a coming batch reads it: fetched again when there is room
                self._queue.append(victim)
        return force or used + size <= self.limit

    def _queue_order(self) -> list[int]:
        """Wanted shards in the order the coming batches read them (the download queue's order, then those
        already here, which the queue no longer holds)."""
        queued = list(self._queue)
        return queued + [s for s in self._wanted if s not in queued]

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._next_ready())
                if self._closed:
                    return
                shard = self._next()
            if shard is None:
                continue
            try:
                problem = self._download(shard)
            except OSError as err:  # the local disk (full, removed): the batch that waits says so
                problem = f"cache shard {self.local[shard]}: cannot be written ({err.strerror or err})"
            with self._cond:
                del self._inflight[shard]
                if problem is not None:
                    self._failed[shard] = problem
                elif shard in self._pins or self.limit is None or self._make_room(self.sizes[shard], force=False):
                    self._place(shard)
                else:  # the batches moved on while it downloaded and it no longer fits: fetched again later
                    self._drop(shard, self._partial(shard))
                    if shard in self._wanted:
                        self._queue.append(shard)
                self._cond.notify_all()

    def _partial(self, shard: int) -> Path:
        return self.local[shard].with_name(self.local[shard].name + PARTIAL)

    def _place(self, shard: int) -> None:
        """Rename a checked download into place (under the lock, after room was made for it)."""
        os.replace(self._partial(shard), self.local[shard])
        self._present[shard] = self.sizes[shard]

    def _next_ready(self) -> bool:
        """Whether ``_next`` would find work now (under the lock): a shard to fetch that fits or is urgent."""
        pending = [s for s in list(self._urgent) + list(self._queue)
                   if s not in self._present and s not in self._failed and s not in self._inflight]
        if not pending:
            return False
        if self.limit is None or pending[0] in self._urgent:
            return True
        free = self.limit - sum(self._present.values()) - sum(self._inflight.values())
        evictable = sum(size for s, size in self._present.items() if s not in self._pins and s not in self._wanted)
        return free + evictable >= self.sizes[pending[0]]

    def _drop(self, shard: int, path: Path) -> None:
        """Delete this rank's copy of ``shard`` at ``path``, and the node's when no other rank holds it (a
        hard link: the last rank to let a tar go frees its bytes)."""
        path.unlink(missing_ok=True)
        if self.pool is not None:
            pooled = self.pool / self.local[shard].name
            with contextlib.suppress(FileNotFoundError):
                if pooled.stat().st_nlink == 1:
                    pooled.unlink()

    def _download(self, shard: int) -> str | None:
        """Bring shard ``shard`` to its ``.partial`` name (the caller renames it into place: ``_place``): a hard
        link to the node's copy when another rank of the node has it (``pool``; one rank downloads a tar that
        several want at once, the others wait for it), else fetched from the store. None when done, else the
        error naming the shard."""
        if self.pool is None:
            return self._fetch(shard)
        pooled, tmp = self.pool / self.local[shard].name, self._partial(shard)
        claim = pooled.with_name(pooled.name + ".claim")
        tmp.unlink(missing_ok=True)  # a link is made only to a free name
        while True:
            try:
                os.link(pooled, tmp)  # renamed into the pool only after its sha256 matched
                with self._cond:
                    self.shared += 1
                self.sizes[shard] = tmp.stat().st_size
                return None
            except FileNotFoundError:
                pass
            except OSError as err:  # a file system without hard links: every rank downloads its own
                self._no_pool(err)
                return self._fetch(shard)
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:  # another rank downloads it: wait for its copy, or take over from a dead rank
                if not _alive(claim):
                    claim.unlink(missing_ok=True)
                time.sleep(0.05)
                continue
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            break
        try:
            problem = self._fetch(shard)
            if problem is None:
                staging = pooled.with_name(f"{pooled.name}.{os.getpid()}{PARTIAL}")
                try:
                    os.link(tmp, staging)
                    os.replace(staging, pooled)
                except OSError as err:
                    self._no_pool(err)
            return problem
        finally:
            claim.unlink(missing_ok=True)

    def _no_pool(self, err: OSError) -> None:
        with self._cond:  # said once, by the first download thread that finds it
            if self.pool is not None:
                log.warning("%s: no hard links here (%s): each rank of the node downloads its own tars", self.pool,
                            err)
                self.pool = None

    def _fetch(self, shard: int) -> str | None:
        """Fetch shard ``shard`` from the store to its ``.partial`` name and check its sha256 against the
        manifest; a mismatch is fetched once more. None when done, else the error naming the shard."""
        remote, tmp = self.remote[shard], self._partial(shard)
        expected = self._entries[shard].get("sha256")
        actual = ""
        for _attempt in range(2):
            try:
                with self._cond:
                    self.requests += 1
                self.fs.get_file(remote, str(tmp))
            except Exception as err:  # the store failed the request: a second try, then the error
                actual = f"unreadable ({type(err).__name__}: {err})"
                continue
            size = tmp.stat().st_size
            with self._cond:
                self.bytes_downloaded += size
                self.downloads += 1
            actual = sha256_file(tmp)
            if not expected or actual == expected:
                self.sizes[shard] = size
                return None
            log.warning("shard %s: sha256 differs from the manifest; fetching it once more", remote)
        tmp.unlink(missing_ok=True)
        return (f"cache shard {self.fs.unstrip_protocol(remote)} differs from the snapshot's manifest after two "
                f"downloads (expected sha256 {expected}, actual {actual}); run `latentmill verify "
                f"{self.url}` and re-run the prep to rebuild it")


CLAIM_WRITE_S = 10.0  # a claim still without its PID after this long: its process died between create and write


def _alive(claim: Path) -> bool:
    """Whether the process that wrote ``claim`` (its PID, on this node) still runs."""
    try:
        text = claim.read_text()
        if not text.isdigit():  # being written, or never will be
            return time.time() - claim.stat().st_mtime < CLAIM_WRITE_S
    except FileNotFoundError:
        return True  # gone meanwhile: the pool has the tar, or the next try claims it
    return _pid_alive(int(text))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def cache_fit_warning(stream: ShardStream, shuffle_block: int | None) -> str | None:
    """One line when the stream's ``loader.cache_limit`` holds less than the epoch's order reads at a time, else
    None: below the snapshot's tars with each bucket shuffled whole (each rank reads every shard: ranks take
    slices of the same batches), below a block's shards with ``shuffle_block``.
    Call it once the loader has read the indexes (they give the tars' sizes)."""
    limit, sizes = stream.limit, stream.sizes
    if limit is None or not sizes or limit >= sum(sizes):
        return None
    largest = max(sizes)
    fits = max(1, limit // largest - 1)  # leaves room for the next block's first shard, fetched while a block is read
    if shuffle_block is None:
        return (f"loader.cache_limit: {limit} bytes hold {limit // largest} of the snapshot's {len(sizes)} shards "
                f"({sum(sizes)} bytes) and each bucket is shuffled whole, so an epoch downloads the snapshot many "
                f"times over; set loader.shuffle_block={fits} (shards per shuffle block) to fetch each shard about "
                "once per epoch")
    if shuffle_block * largest <= limit:
        return None
    fix = f"set loader.shuffle_block={fits} or " if fits < shuffle_block else ""
    return (f"loader.shuffle_block: a block of {shuffle_block} shards takes up to {shuffle_block * largest} bytes, "
            f"more than loader.cache_limit ({limit}): the cache goes over it for a batch's shards or fetches shards "
            f"again within a block; {fix}raise loader.cache_limit to {(shuffle_block + 1) * largest} (a block and "
            "the next block's first shard)")


@dataclass(frozen=True)
class StreamSource:
    """Where a run streams its snapshot from: the snapshot folder's URL on the store, the local cache folder
    (each rank streams into its own ``rank-<r>`` subfolder, hard links to the node's copies in ``shared``: a
    node downloads a tar once for its ranks) and its limit in bytes per rank."""

    url: str
    cache_dir: str
    cache_limit: int | None = None
    local_copy: str | None = None  # the snapshot's folder in the work folder: its manifest and indexes

    def open(self, rank: int) -> ShardStream:
        return ShardStream(self.url, Path(self.cache_dir) / f"rank-{rank}", self.cache_limit, self.local_copy,
                           pool=Path(self.cache_dir) / "shared")
