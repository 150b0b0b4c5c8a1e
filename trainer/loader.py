"""``LatentLoader``: batches of cached latents and text embeddings from the cache stage's shards.

Contract read (``<cache_dir>/manifest.json``, written by the cache stage; docs/cache-format.md, format 3
only): a list of uncompressed webdataset tar shards, each with an index file beside it, named in its
manifest entry, that gives every sample's key, bucket and members; per sample ``k.vae.safetensors`` (``latents``, and ``latents_std`` when the
manifest says ``"latents": "distribution"``), ``k.text.safetensors`` (``prompt_embeds``, and
``pooled_prompt_embeds`` for Flux) and ``k.json``; ``empty_prompt.safetensors`` holds the text tensors of
the empty caption.

Design choices:

* One bucket per batch, never mixed shapes. The order is a pure function of (seed, epoch, manifest, global
  batch size, ``shuffle_block``): shuffle each bucket's samples, chunk them into global batches of
  ``batch_size`` x ``world_size`` samples, shuffle the list of batches; rank r reads the r-th slice of each
  global batch. The number of ranks enters only through the global batch size, so a run resumed on other
  ranks with the same global batch continues the same sequence (docs/training.md, "Resume on another number
  of GPUs").
* ``shuffle_block`` (N shards, ``loader.shuffle_block``): a block shuffle, as mosaicml-streaming's, for a
  streamed snapshot whose local cache holds only a few shards: per bucket the shards are shuffled and cut
  into blocks of N, samples are shuffled within a block, and the blocks are read one after another, so the
  shards a rank reads at any time are about one block's (``global_batches``).
* Start-up reads the shard indexes, each whole and in order, and no tar (samples are grouped by bucket with
  numpy over the index columns; a sample's ``SampleRef`` is built when a batch needs it), so it costs about
  the time to read the index files (~100 bytes per sample; every rank reads all of them). A cache of format
  1 or 2 (no indexes) is refused with one line (``CacheFormatError``): re-running the prep indexes it
  without re-encoding. The epoch's order is kept as arrays (``BatchPlan``), not a list per batch.
* Memory: the index columns per sample member. A batch reads its members from
  the shard files, so RAM holds one batch, whatever the dataset size, and each member is read exactly once
  per epoch. This needs local, uncompressed tars (what the cache stage writes); remote (fsspec) caches are
  not supported yet.
* One copy per tensor: a member's safetensors header (8-byte little-endian length + JSON with dtype, shape
  and ``data_offsets``) is read and checked first (from the shard index, else
  :mod:`latentmill.trainer.shard_index`), then ``os.preadv`` reads each tensor's payload straight into its row of a preallocated batch
  tensor (``[B, ...]``, the stored dtype; :mod:`latentmill.trainer.batch_reader`). No per-sample decode, no
  ``torch.stack``; a different output ``dtype`` is one conversion per batch column.
* Shards on disk: the kernel is asked (``POSIX_FADV_WILLNEED``) for the members of the next
  ``ADVISE_AHEAD_BATCHES`` batches before a batch is read, so reads of a shuffled epoch overlap (cold
  epochs ~1.2x as fast here). A sample already in the page cache (a 1-byte ``RWF_NOWAIT`` probe) is not
  advised: a second epoch of a dataset that fits in RAM pays only the probes.
* ``state_dict()`` is (epoch, index of the next global batch): restoring it yields the very same next
  batches, on any number of ranks that splits the same global batch.
* Every batch carries its samples' epoch ordinals (their places in the epoch's global sequence), which key
  the trainer's per-sample noise draws.
* Trimmed text (``text.trimmed``): ``prompt_embeds`` hold only the real tokens and are zero-padded to
  ``text.pad_to`` when a batch is assembled, which is what ``WanPipeline`` feeds its transformer.
* Held-out samples (a snapshot's ``held_out`` places per shard entry, ``prep.eval_fraction``) are skipped
  as the indexes are read: training never sees them; ``held_out="only"`` reads nothing else (the evaluation).
* Caption dropout: a sample trains on the empty prompt's tensors with probability ``caption_dropout``; the
  decision is a pure function of (seed, epoch, sample key), so a resumed run drops the very same captions.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

import torch
from latentmill.trainer.batch_reader import META_MEMBER, TEXT_MEMBER, VAE_MEMBER, SampleRef, ShardReader
from latentmill.trainer.shard_check import LazyShardCheck
from latentmill.trainer.shard_index import (
    MemberLayout,
    ShardIndex,
    ShardIndexError,
    layout_from_index,
    load_shard_index,
    verify_index,
)
from safetensors.torch import load as load_safetensors

from latentmill.core.config import ConfigError
from latentmill.models import CacheMismatchError

if TYPE_CHECKING:
    from latentmill.trainer.stream import ShardStream

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # the one cache format read: every shard has an index (docs/cache-format.md, "Shard index")

PREFETCH_MIN_CONSUMER_S = 200e-6  # read ahead only for a consumer this slow per batch (a hand-off: ~50-100µs)
PREFETCH_DELAY_SHARE = 0.1  # the read-ahead starts this share of the consumer's time per batch later...
PREFETCH_DELAY_MAX_S = 0.001  # ...and at most this much later
INDEX_FILE_COLD_S = 0.002  # the first index file read slower than this (+ INDEX_FILE_COLD_S_PER_BYTE per
INDEX_FILE_COLD_S_PER_BYTE = 2e-9  # byte): shards are on disk (see _on_disk_now)
ADVISE_AHEAD_BATCHES = 2  # shards on disk: the kernel is asked to read this many batches ahead (WILLNEED)


class CacheFormatError(CacheMismatchError, ValueError):
    """A cache written in a format this trainer no longer reads (1 or 2: no shard indexes). A
    ``CacheMismatchError``, so the command line prints it as one line."""


class CacheFamilyError(CacheMismatchError, ValueError):
    """A cache made for another model family, or without a stream the model reads (one line too)."""


def read_manifest(cache_dir: str | Path) -> dict:
    """Load ``<cache_dir>/manifest.json`` and check that it is a cache-stage manifest this trainer reads:
    format 3, an index named for every shard. An older cache raises ``CacheFormatError``, one line that
    says how to upgrade it."""
    path = Path(cache_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"no cache manifest at {path}: run the cache stage first")
    manifest = json.loads(path.read_text())
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: dict, path: str | Path) -> None:
    """Raise what ``read_manifest`` raises for the manifest read from ``path`` (``ValueError``,
    ``CacheFormatError``)."""
    if manifest.get("stage") != "cache":
        raise ValueError(
            f"{path} is a {manifest.get('stage')!r} manifest, the trainer needs the 'cache' stage's"
        )
    version = manifest.get("format_version", 1)
    if version in (1, 2):
        raise CacheFormatError(f"{path}: cache format {version} is no longer read; re-run `latentmill prep "
                               "<recipe>` to index it (nothing is re-encoded)")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version!r}, this trainer reads {FORMAT_VERSION}")
    if not manifest.get("shards"):
        raise ValueError(f"{path} lists no shards: nothing to train on")
    missing = next((e for e in manifest["shards"] if not e.get("index")), None)
    if missing is not None:
        raise CacheFormatError(f"{path}: shard {missing.get('path')} has no index entry; re-run `latentmill "
                               "prep <recipe>` to index it (nothing is re-encoded)")
    if manifest.get("latents", "mean") not in ("mean", "sample", "distribution"):
        raise ValueError(f"{path}: latents {manifest['latents']!r} is not one of mean, sample, distribution")


def manifest_family(manifest: dict) -> str:
    """The model family that produced the cache (``flux`` when the manifest does not say)."""
    return manifest.get("family") or "flux"


def manifest_streams(manifest: dict) -> list[dict[str, Any]]:
    """The streams of the cache's samples (``docs/cache-format.md``, "Streams"): the manifest's, or, for a
    manifest written before streams were recorded, those its family (FLUX.1 or Wan 2.1) always cached."""
    if manifest.get("streams"):
        return list(manifest["streams"])
    family = manifest_family(manifest)
    streams = [{"name": "latents", "component": "vae", "pad": "none"},
               {"name": "prompt_embeds", "component": "text", "pad": "zeros" if family == "wan" else "keep"}]
    if family == "flux":
        streams.append({"name": "pooled_prompt_embeds", "component": "text", "pad": "none"})
    return streams


def check_streams(manifest: dict, family: str, needed: tuple[str, ...], where: str) -> None:
    """Refuse a cache made for another family, or one that lacks a stream the model reads, in one line."""
    have = manifest_family(manifest)
    if have != family:
        raise CacheFamilyError(f"{where}: this cache was made for the {have!r} family, the recipe trains "
                               f"{family!r}; prep a cache with the recipe's model (latentmill prep <recipe>)")
    names = {s["name"] for s in manifest_streams(manifest)}
    missing = [name for name in needed if name not in names]
    if missing:
        raise CacheFamilyError(f"{where}: the cache holds the streams {sorted(names)}, the {family!r} model "
                               f"reads {list(needed)}: {', '.join(missing)} missing; re-run latentmill prep")


def resume_batch_size(saved: dict[str, Any], batch_size: int, world_size: int, where: str) -> int:
    """The per-rank batch size of a run that resumes the loader state ``saved`` on ``world_size`` ranks.

    A run keeps its global batch (per-rank ``batch_size`` x ranks) whatever its number of ranks: on the ranks it
    was saved on, or with a ``batch_size`` other than the saved one (a new global batch, on purpose),
    ``batch_size`` as given; on other ranks, the saved global batch split over them, which must divide evenly:
    else a ``ConfigError`` that lists the numbers of ranks that can continue it (``where``: the checkpoint).
    """
    saved_batch, saved_world = int(saved.get("batch_size", batch_size)), int(saved.get("world_size", 1))
    if saved_world == world_size or saved_batch != batch_size:
        return batch_size
    global_batch = saved_batch * saved_world
    if global_batch % world_size == 0:
        return global_batch // world_size
    fits = [f"{n} ({global_batch // n} per rank)" for n in range(1, global_batch + 1) if global_batch % n == 0]
    listed = fits[0] if len(fits) == 1 else ", ".join(fits[:-1]) + " or " + fits[-1]
    raise ConfigError(
        f"trainer.resume: {where} trains global batches of {global_batch} samples ({saved_batch} per rank x "
        f"{saved_world} ranks), which {world_size} ranks cannot split evenly; resume it on {listed} data-parallel "
        "ranks, or set another trainer.batch_size to start a new epoch with a new global batch"
    )


def _unit_interval(*parts: object) -> float:
    """A number in [0, 1) that is a pure function of ``parts`` (same on every process and platform)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def caption_dropped(seed: int, epoch: int, key: str, probability: float) -> bool:
    """Whether sample ``key`` trains on the empty prompt in ``epoch`` (probability ``probability``)."""
    return probability > 0 and _unit_interval("latentmill-caption-dropout", seed, epoch, key) < probability


def caption_choice(seed: int, epoch: int, key: str, count: int) -> int:
    """Which of a sample's ``count`` cached captions it trains on in ``epoch`` (uniform, seeded)."""
    return min(count - 1, int(_unit_interval("latentmill-caption-choice", seed, epoch, key) * count))


def text_members(members: dict[str, Any]) -> list[str]:
    """A sample's caption members in order: ``text.safetensors``, ``text.1.safetensors``, ..."""
    alternatives = sorted((int(ext.split(".")[1]), ext) for ext in members
                          if ext.startswith("text.") and ext.count(".") == 2 and ext.split(".")[1].isdigit())
    return [TEXT_MEMBER, *(ext for _, ext in alternatives)]


def pad_tokens(embeds_LD: torch.Tensor, pad_to: int) -> torch.Tensor:
    """Zero-pad [n, D] token embeddings to [pad_to, D] (as ``WanPipeline._get_t5_prompt_embeds`` does)."""
    n = embeds_LD.shape[0]
    if n > pad_to:
        raise ValueError(f"prompt_embeds hold {n} tokens, more than the manifest's text.pad_to ({pad_to})")
    if n == pad_to:
        return embeds_LD
    return torch.cat([embeds_LD, embeds_LD.new_zeros(pad_to - n, *embeds_LD.shape[1:])])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_problems(cache_dir: Path, entry: dict) -> list[str]:
    """What is wrong with one shard against its manifest ``entry``: its tar's sha256 (an unreadable tar counts
    as a mismatch) and, format 3, its index file; each problem a line that names the file. Empty: intact,
    or the entry records no sha256."""
    expected = entry.get("sha256")
    if not expected:
        return []
    path = cache_dir / entry["path"]
    try:
        actual = _sha256(path)
    except OSError as exc:
        actual = f"unreadable ({exc.strerror or exc})"
    problems = [f"{path}: expected sha256 {expected}, actual {actual}"] if actual != expected else []
    problem = verify_index(path, entry)
    return problems + ([problem] if problem is not None else [])


def _verify_group(world_size: int) -> tuple[int, int]:
    """(rank, size) among the processes that share the shard check: the default process group when one is
    initialised and the loader was told it is one of its ``world_size`` ranks (every rank builds a loader,
    so every rank reaches the collective), else (0, 1): this process checks every shard."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        return dist.get_rank(), world_size
    return 0, 1


def verify_shards(cache_dir: Path, entries: list[dict], world_size: int = 1) -> list[int]:
    """Check the cache shards' sha256 against the manifest ``entries``; raise ``ValueError`` naming every bad
    shard (path, expected and actual sha256). Returns the indices of the shards this process hashed.

    Under a process group of ``world_size`` ranks, rank r hashes shards r, r + N, ... (shards are sized by
    bytes, so the shares are balanced) and the bad shards every rank found are gathered, so every rank
    raises the same error: hashing a large cache costs each rank 1/N of it, not all of it. The gather is one
    ``all_gather_object`` at start-up (on NCCL it uses the current CUDA device, which ``parallel`` sets).
    An unreadable shard counts as bad (a rank that raised alone would leave the others waiting).
    """
    rank, size = _verify_group(world_size)
    hashed: list[int] = []
    bad: list[tuple[int, str]] = []
    for index in range(rank, len(entries), size):
        if not entries[index].get("sha256"):
            continue
        hashed.append(index)
        bad += [(index, problem) for problem in shard_problems(cache_dir, entries[index])]
    if size > 1:
        import torch.distributed as dist

        gathered: list[list[tuple[int, str]] | None] = [None] * size
        dist.all_gather_object(gathered, bad)
        bad = sorted(found for part in gathered for found in part or [])
    if bad:
        lines = "\n  ".join(message for _, message in bad)
        raise ValueError(
            f"{len(bad)} of {len(entries)} cache shards: sha256 differs from the manifest (corrupt or replaced "
            f"shard):\n  {lines}"
        )
    return hashed


class _IndexedRefs(Sequence[SampleRef]):
    """One bucket's samples of an indexed cache: global sample ids, each turned into its ``SampleRef`` when
    asked for (a batch, ``read_metadata``), so start-up builds no Python object per sample."""

    def __init__(self, loader: "LatentLoader", samples: Any) -> None:
        self._loader, self.samples = loader, samples  # global sample ids: an int64 numpy array or a range

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._loader._indexed_ref(int(s)) for s in self.samples[i]]
        return self._loader._indexed_ref(int(self.samples[i]))


class BatchPlan(Sequence[tuple[tuple[int, ...], list[int]]]):
    """An epoch's batches, (bucket, sample indices within the bucket) each, held as arrays: per bucket its
    shuffled samples, per batch its bucket's number, its first position in that shuffle, its size, and the
    epoch ordinal of its first sample (``first``: the sample's place in the epoch's global sequence, which keys
    its noise draws). Indexing gives the batch (indices as a list); slicing gives a ``BatchPlan``; equal to any
    sequence of the same batches.
    """

    def __init__(self, buckets: list[tuple[int, ...]], perms: list[Any], which: Any, starts: Any, sizes: Any,
                 first: Any) -> None:
        self.buckets, self.perms = buckets, perms
        # numpy int64 arrays, one value per batch
        self.which, self.starts, self.sizes, self.first = which, starts, sizes, first

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return BatchPlan(self.buckets, self.perms, self.which[i], self.starts[i], self.sizes[i], self.first[i])
        number, start = int(self.which[i]), int(self.starts[i])
        return self.buckets[number], self.perms[number][start : start + int(self.sizes[i])].tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


class Position(NamedTuple):
    """Where one of this rank's batches sits in the data."""

    epoch: int
    index: int  # of its global batch in the epoch
    bucket: tuple[int, ...]
    indices: list[int]  # its samples within the bucket
    first: int  # the epoch ordinal of its first sample
    after: tuple[int, int]  # (epoch, index) of the batch this rank reads next: the state once this one is out


def _stamp(batch: dict[str, Any], at: Position) -> None:
    """Mark a batch with where it sits: its epoch, its global batch's index, its samples' epoch ordinals."""
    batch["epoch"], batch["index"] = at.epoch, at.index
    batch["ordinals"] = list(range(at.first, at.first + len(batch["keys"])))


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator seeded from (seed, epoch) alone, stable across processes and platforms."""
    digest = hashlib.sha256(f"latentmill-loader:{seed}:{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class LatentLoader:
    """Infinite iterator of single-bucket batches; deterministic in (seed, epoch, manifest); resumable.

    Each batch is a dict: ``latents`` [B, 16, H/8, W/8] (images) or [B, 16, F', H/8, W/8] (videos),
    ``latents_std`` (same shape, ``"latents": "distribution"`` caches only), ``prompt_embeds`` [B, L, D]
    (zero-padded to ``text.pad_to`` when trimmed), ``pooled_prompt_embeds`` [B, D_pooled] (Flux) (all
    ``dtype``), ``caption_dropped`` (bool [B]), ``keys`` (list of sample keys), ``bucket``
    ([width, height, frames]), ``epoch`` and ``index`` (position of the batch's global batch in its epoch),
    ``ordinals`` (each sample's place in the epoch's global sequence: the same for any number of ranks).

    ``prefetch``: read the next batch in a background thread while the consumer works on this one (see
    ``__iter__``); ``io_threads``: threads that copy the members of one batch (``ShardReader``).
    ``verify``: check each shard's sha256 against the manifest first (``verify_shards``: under a process
    group each rank hashes its share, and every rank raises when any rank found a bad shard).
    ``check_on_read`` (without ``verify``): check each shard the first time a batch reads from it, in a
    background thread (``shard_check``, a ``LazyShardCheck``; the loader itself never raises for it: the
    trainer reads ``shard_check.failure``). Under a process group of ``world_size`` ranks, rank r checks the
    shards ``s % world_size == r`` that any rank's batch reads, so each shard is hashed once per run.
    ``shuffle_block``: shards per shuffle block (``global_batches``); None: each bucket shuffled whole.
    """

    def __init__(
        self,
        cache_dir: str | Path,
        batch_size: int,
        seed: int = 0,
        *,
        dtype: torch.dtype = torch.float32,
        drop_last: bool = False,
        verify: bool = False,
        manifest: dict | None = None,
        rank: int = 0,
        world_size: int = 1,
        caption_dropout: float = 0.0,
        prefetch: bool = True,
        io_threads: int = 2,
        check_on_read: bool = False,
        held_out: str = "skip",
        stream: "ShardStream | None" = None,
        shuffle_block: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if shuffle_block is not None and shuffle_block < 1:
            raise ValueError(f"shuffle_block must be a number of shards >= 1 or None, got {shuffle_block}")
        self.shuffle_block = shuffle_block
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if held_out not in ("skip", "only"):
            raise ValueError(f"held_out must be 'skip' or 'only', got {held_out!r}")
        self.rank, self.world_size, self.held_out = rank, world_size, held_out
        self.cache_dir = Path(cache_dir)
        self.stream = stream  # a snapshot on a store: its shards come through this local cache (trainer.stream)
        if stream is not None:  # each download is checked against the manifest's sha256 (ShardStream)
            verify = check_on_read = False
        if manifest is None:
            manifest = read_manifest(self.cache_dir)
        else:
            check_manifest(manifest, self.cache_dir / "manifest.json")
        self.manifest = manifest
        self.batch_size, self.seed, self.dtype, self.drop_last = batch_size, seed, dtype, drop_last
        self.family = manifest_family(self.manifest)
        streams = manifest_streams(self.manifest)
        self.distribution = self.manifest.get("latents", "mean") == "distribution"
        text = self.manifest.get("text") or {}
        self.pad_to: int | None = int(text["pad_to"]) if text.get("trimmed") else None
        # a trimmed cache's token-axis streams, zero-padded to pad_to tokens in a batch; a "mask" stream also
        # gets a "<name>_mask" column (True on real tokens)
        token_streams = [s for s in streams if s["component"] == "text" and s.get("pad", "none") != "none"]
        self.pad = ({s["name"]: s.get("pad_to") or self.pad_to for s in token_streams} if self.pad_to is not None
                    else {})
        self.masked = [s["name"] for s in streams if s.get("pad") == "mask"]
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1], got {caption_dropout}")
        self.caption_dropout = caption_dropout
        self.prefetch = prefetch  # read the next batch while the current one trains
        self.io_threads = io_threads  # threads that copy one batch's members (os.preadv releases the GIL)
        self.shard_paths: list[Path] = []  # filled below; the reader holds this very list
        self._reader = ShardReader(self.shard_paths, io_threads)  # open files, batch assembly
        if stream is not None:  # an evicted shard's file is closed, so its disk space is freed
            stream.on_evict = self._reader.forget
        self.empty_prompt = self._load_empty_prompt() if caption_dropout > 0 else None
        # What the sample order depends on: the shard list (content-addressed), not the stage config.
        shard_ids = [
            (e["path"], e.get("sha256"), e.get("samples"), e.get("bucket"), *([e["held_out"]] if "held_out" in e else []))
            for e in self.manifest["shards"]
        ]
        if held_out == "only":
            shard_ids.append("held_out")
        self.dataset_id = hashlib.sha256(json.dumps(shard_ids, sort_keys=True).encode()).hexdigest()

        # --- every shard's index read, samples grouped by bucket (manifest order, then tar order) ---
        self._on_disk = False  # set by _buckets_from_indexes: the shards were not in the page cache
        self._nowait = hasattr(os, "RWF_NOWAIT")  # page-cache probes (Linux >= 4.14), see _on_disk_now
        self._probe = bytearray(1)
        for number, entry in enumerate(self.manifest["shards"]):
            path = self.cache_dir / entry["path"] if stream is None else stream.local[number]
            if path.suffix != ".tar":
                raise ValueError(f"{path}: only uncompressed .tar shards are supported")
            self.shard_paths.append(path)
        # the shards this rank hashed (its share under a process group, see verify_shards)
        self.verified_shards = verify_shards(self.cache_dir, self.manifest["shards"], world_size) if verify else []
        entries = self.manifest["shards"]
        self.shard_check: LazyShardCheck | None = None
        if check_on_read and not verify and any(e.get("sha256") for e in entries):
            check_rank, check_size = _verify_group(world_size)
            self._check_owner = (check_rank, check_size)
            self._owned = sum(1 for s, e in enumerate(entries) if e.get("sha256") and s % check_size == check_rank)
            self.shard_check = LazyShardCheck(self._check_shard)
        self._indexes: list[ShardIndex] = []
        self._shard_layouts: list[list[MemberLayout]] = []  # per shard: its index's layouts table
        self._shard_base: list[int] = []  # per shard: the global id of its first sample
        self.buckets = self._buckets_from_indexes(entries)
        if stream is not None:
            stream.expect_sizes([index.tar_size for index in self._indexes])
        self.num_samples = sum(len(refs) for refs in self.buckets.values())

        self.epoch, self.batch_index = 0, 0
        self._order_epoch: int | None = None
        self._order: BatchPlan | list = []
        self._global_epoch: int | None = None  # the global plan of that epoch (shard checks under a group)
        self._global: BatchPlan | list = []
        self._last_use: tuple[int, dict[int, int]] | None = None  # (epoch, shard -> its last batch there)
        import numpy as np

        self._shard_base_np = np.asarray(self._shard_base, dtype=np.int64)

    def _buckets_from_indexes(self, entries: list[dict]) -> dict[tuple[int, ...], "_IndexedRefs"]:
        """Every shard's index read whole, in manifest order, and no tar opened; samples grouped by their own
        bucket (the index's; the entry's for a sample without one), manifest order then tar order within a
        bucket. Checked here, vectorised: each index against its
        manifest entry and its tar's size (``os.stat``), every sample holding a VAE and a text member."""
        import numpy as np

        interned: dict[str, MemberLayout] = {}  # equal layouts share one object (batch plans go by identity)
        bucket_ids: dict[tuple[int, ...], int] = {}
        segments: dict[int, list[Any]] = {}  # global bucket id -> arrays of global sample ids
        base = 0
        for shard_id, entry in enumerate(entries):
            path = self.shard_paths[shard_id]
            start = time.perf_counter()
            index = load_shard_index(path, entry["index"])
            if shard_id == 0:
                elapsed = time.perf_counter() - start
                self._on_disk = elapsed > INDEX_FILE_COLD_S + INDEX_FILE_COLD_S_PER_BYTE * entry["index"]["size"]
            where = f"{path} (index {entry['index']['name']})"
            try:  # a streamed shard is checked whole when it arrives (ShardStream)
                tar_size = os.stat(path).st_size if self.stream is None else index.tar_size
            except OSError as err:
                raise ValueError(f"{path}: cannot read the shard ({err.strerror or err})") from None
            if tar_size != index.tar_size:
                raise ValueError(
                    f"{where}: the tar holds {tar_size} bytes, its index describes one of {index.tar_size} "
                    "(a replaced or truncated shard); re-run the prep, or `latentmill verify` the cache"
                )
            n, c = index.num_samples, index.columns
            if "samples" in entry and entry["samples"] != n:
                raise ValueError(f"{where}: manifest says {entry['samples']} samples, the index holds {n}")
            for member in (VAE_MEMBER, TEXT_MEMBER):  # a sample's extensions are distinct: a count will do
                wanted = index.names.index(member) if member in index.names else -1
                if n and int(np.count_nonzero(c["member_name"] == wanted)) != n:
                    starts = np.concatenate(([0], c["sample_member_end"][:-1]))
                    has = np.add.reduceat(c["member_name"] == wanted, starts, dtype=np.int64)
                    key = index.key(int(np.argmin(has))) if not has.all() else "?"
                    raise ValueError(f"{where}: sample {key!r} lacks {member} (or holds it twice)")
            try:
                layouts = []
                for table in index.layouts:
                    text = json.dumps(table, sort_keys=True)
                    if text not in interned:
                        interned[text] = layout_from_index(table)
                    layouts.append(interned[text])
            except (KeyError, TypeError, ValueError) as err:
                raise ShardIndexError(f"{where}: a layout of the index is invalid ({err!r})") from None
            fallback = tuple(entry["bucket"]) if entry.get("bucket") else None
            lut = [bucket_ids.setdefault(tuple(b), len(bucket_ids)) for b in index.buckets]
            lut.append(-1 if fallback is None else bucket_ids.setdefault(fallback, len(bucket_ids)))
            buckets_of = np.asarray(lut, dtype=np.int64)[c["sample_bucket"]]  # -1 (no bucket) -> the last
            if n and int(buckets_of.min()) < 0:
                key = index.key(int(np.argmin(buckets_of)))
                raise ValueError(f"{where}: sample {key!r} has no bucket (neither in the index nor the manifest)")
            keep = None
            if "held_out" in entry or self.held_out == "only":
                keep = np.zeros(n, dtype=bool)
                keep[np.asarray(entry.get("held_out", []), dtype=np.int64)] = True
                keep = keep if self.held_out == "only" else ~keep
            if keep is not None:
                kept = np.flatnonzero(keep)
                order = kept[np.argsort(buckets_of[kept], kind="stable")]
                cuts = np.flatnonzero(np.diff(buckets_of[order])) + 1
                for part in np.split(order, cuts) if len(order) else []:
                    segments.setdefault(int(buckets_of[part[0]]), []).append(part + base)
            elif n and int(buckets_of.min()) == int(buckets_of.max()):  # a single-bucket shard: a range
                parts = segments.setdefault(int(buckets_of[0]), [])
                if parts and isinstance(parts[-1], range) and parts[-1].stop == base:
                    parts[-1] = range(parts[-1].start, base + n)  # follows the bucket's previous shard
                else:
                    parts.append(range(base, base + n))
            elif n:
                order = np.argsort(buckets_of, kind="stable")
                sorted_ids = buckets_of[order]
                cuts = np.flatnonzero(np.diff(sorted_ids)) + 1
                for part in np.split(order, cuts):
                    segments.setdefault(int(buckets_of[part[0]]), []).append(part + base)
            self._indexes.append(index)
            self._shard_layouts.append(layouts)
            self._shard_base.append(base)
            base += n
        def ids(parts: list) -> Any:  # one range stays a range (no array per sample)
            if len(parts) == 1 and isinstance(parts[0], range):
                return parts[0]
            return np.concatenate([np.arange(p.start, p.stop, dtype=np.int64) if isinstance(p, range) else p
                                   for p in parts])

        by_tuple = {bucket: gid for bucket, gid in bucket_ids.items() if gid in segments}
        return {bucket: _IndexedRefs(self, ids(segments[by_tuple[bucket]])) for bucket in sorted(by_tuple)}

    def _indexed_ref(self, sample: int) -> SampleRef:
        """The ``SampleRef`` of global sample ``sample`` of an indexed cache, from its shard's index columns."""
        shard = bisect.bisect_right(self._shard_base, sample) - 1
        local = sample - self._shard_base[shard]
        index, layouts = self._indexes[shard], self._shard_layouts[shard]
        c = index.columns
        start = int(c["sample_member_end"][local - 1]) if local else 0
        end = int(c["sample_member_end"][local])
        names = c["member_name"][start:end].tolist()
        offsets = c["member_offset"][start:end].tolist()
        sizes = c["member_size"][start:end].tolist()
        layout_ids = c["member_layout"][start:end].tolist()
        members, found = {}, {}
        largest = (0, 0)  # (size, offset) of the largest member
        for name, offset, size, layout in zip(names, offsets, sizes, layout_ids):
            ext = index.names[name]
            members[ext] = (offset, size)
            largest = max(largest, (size, offset))
            if layout >= 0:
                found[ext] = layouts[layout]
        others = len(members) - 2 - (META_MEMBER in members)  # members beside vae, text and json
        texts = tuple(text_members(members)) if others else (TEXT_MEMBER,)
        return SampleRef(shard, index.key(local), members, texts, found, largest[1] + largest[0] // 2)

    def _load_empty_prompt(self) -> dict[str, torch.Tensor]:
        """The text tensors of the empty caption (``manifest["empty_prompt"]``), checked against its sha256."""
        entry = self.manifest.get("empty_prompt")
        if not entry:
            raise ValueError(
                f"{self.cache_dir}: trainer.caption_dropout needs the empty prompt's embeddings, and the cache "
                "manifest has no empty_prompt entry; re-run the cache stage"
            )
        path = self.cache_dir / entry["path"] if self.stream is None else self.stream.path_of(entry["path"])
        data = path.read_bytes()
        if entry.get("sha256") and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from the manifest")
        return load_safetensors(data)

    # --- order: a pure function of (seed, epoch, manifest, global batch size) ---
    @property
    def global_batch_size(self) -> int:
        """Samples of one batch of every rank together (a training step's global batch is this times
        ``trainer.grad_accum_steps``): the size the epoch is cut into, whatever the number of ranks."""
        return self.batch_size * self.world_size

    def global_batches(self, epoch: int) -> "BatchPlan":
        """The epoch's global batches (every rank's batch at one position together) as (bucket, sample indices
        within that bucket), in order.

        Shuffle each bucket's samples (``torch.randperm``, buckets in order), chunk them into batches of
        ``global_batch_size``, shuffle the list of batches (one more ``randperm``). The plan depends on the
        number of ranks only through ``global_batch_size``, so a run resumed on other ranks with the same
        global batch continues the very same sequence. Kept as arrays (``BatchPlan``: a batch's indices
        become a list when it is asked for), so a million samples cost milliseconds.

        With ``shuffle_block`` (N): each bucket's samples in blocks (``_block_perm``: its shards shuffled, N
        per block, samples shuffled within a block, no batch across two blocks), chunked as above; the
        batches are not shuffled across the epoch (which would make every batch read anywhere) but read
        block after block: the blocks of all buckets in a random interleaving that keeps each bucket's blocks
        in their shuffled order, a block's batches in a row (``_block_order``)."""
        import numpy as np

        gen = _epoch_generator(self.seed, epoch)
        size = self.global_batch_size
        buckets, perms, which, starts, sizes, ends = list(self.buckets), [], [], [], [], []
        for number, bucket in enumerate(buckets):
            n = len(self.buckets[bucket])
            if self.shuffle_block is None:
                perms.append(torch.randperm(n, generator=gen).numpy())
            else:
                perm, block_ends = self._block_perm(bucket, gen)
                perms.append(perm)
                ends.append(block_ends)
            first = np.arange(0, n, size, dtype=np.int64)
            if self.drop_last:
                first = first[first + size <= n]
            which.append(np.full(len(first), number, dtype=np.int64))
            starts.append(first)
            sizes.append(np.minimum(n - first, size))
        which_, starts_, sizes_ = (np.concatenate(a) if a else np.zeros(0, np.int64) for a in (which, starts, sizes))
        if self.shuffle_block is None:
            order = torch.randperm(len(which_), generator=gen).numpy()
        else:
            order = self._block_order(which_, starts_, ends, gen)
        sizes_ = sizes_[order]
        first = np.concatenate(([0], np.cumsum(sizes_)[:-1])).astype(np.int64) if len(sizes_) else sizes_
        return BatchPlan(buckets, perms, which_[order], starts_[order], sizes_, first)

    def _block_perm(self, bucket: tuple[int, ...], gen: torch.Generator) -> tuple[Any, Any]:
        """One bucket's samples in shuffle blocks: (its indices in block order, each block's end in that order).

        The bucket's samples of one shard stay together while its shards are shuffled; every ``shuffle_block``
        of them make a block, whose end moves up to the next multiple of the global batch (so that no batch reads
        two blocks: a block reads its shards and, up to that boundary, the head of the shard after them);
        samples are shuffled within each block."""
        import numpy as np

        samples = self.buckets[bucket].samples
        ids = np.arange(samples.start, samples.stop, dtype=np.int64) if isinstance(samples, range) else samples
        n, size = len(ids), self.global_batch_size
        shard = np.searchsorted(self._shard_base_np, ids, side="right") - 1  # ascending: a shard's run is whole
        bounds = np.concatenate(([0], np.flatnonzero(np.diff(shard)) + 1, [n])).astype(np.int64)
        pieces = torch.randperm(len(bounds) - 1, generator=gen).numpy()
        lengths = np.diff(bounds)[pieces]
        placed = np.cumsum(lengths) - lengths  # where each piece starts in the block order
        seq = np.arange(n, dtype=np.int64) + np.repeat(bounds[pieces] - placed, lengths)
        ends = np.cumsum(lengths)[self.shuffle_block - 1 :: self.shuffle_block]
        ends = np.unique(np.append(np.minimum(n, -(-ends // size) * size), n))
        start = 0
        for end in ends.tolist():
            seq[start:end] = seq[start:end][torch.randperm(end - start, generator=gen).numpy()]
            start = end
        return seq, ends

    @staticmethod
    def _block_order(which: Any, starts: Any, ends: list[Any], gen: torch.Generator) -> Any:
        """The order of the batches (bucket number ``which``, first place ``starts`` in its bucket's block order)
        that reads block after block: the blocks of all buckets (``ends``: per bucket, its blocks' ends)
        interleaved at random, each bucket's in order, and a block's batches in a row."""
        import numpy as np

        counts = np.asarray([len(e) for e in ends], dtype=np.int64)
        labels = np.repeat(np.arange(len(ends), dtype=np.int64), counts)[
            torch.randperm(int(counts.sum()), generator=gen).numpy()]
        # the k-th block of bucket b is read at the k-th place that holds b
        place = np.argsort(labels, kind="stable")
        block = np.zeros(len(which), dtype=np.int64)
        for number, bucket_ends in enumerate(ends):
            mask = which == number
            block[mask] = np.searchsorted(bucket_ends, starts[mask], side="right")
        offsets = np.cumsum(counts) - counts
        return np.lexsort((starts, place[offsets[which] + block]))

    def epoch_batches(self, epoch: int) -> "BatchPlan":
        """This rank's batches of ``epoch``: its slice of every global batch, rank r the r-th of ``world_size``
        equal slices.

        Every rank gets the same count and sizes. A bucket's last, partial global batch (``drop_last``
        false) is split evenly too: the rest of its samples over a multiple of ``world_size`` is skipped this
        epoch, and one of fewer samples than ranks leaves an empty batch, which iteration passes over.
        """
        plan = self.global_batches(epoch)
        share = plan.sizes // self.world_size
        offset = self.rank * share
        return BatchPlan(plan.buckets, plan.perms, plan.which, plan.starts + offset, share, plan.first + offset)

    def __len__(self) -> int:
        """Batches per epoch on this rank (global batches: an empty slice counts)."""
        return len(self.epoch_batches(0))

    # --- resumable state ---
    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch (plain JSON data): the epoch and the index of the next global batch,
        the same on every rank and for any number of ranks."""
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_id": self.dataset_id,
            "world_size": self.world_size,
            "shuffle_block": self.shuffle_block,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken, on this loader's ranks: a state of
        the same global batch size (per-rank ``batch_size`` x ``world_size``) continues the same sequence."""
        saved_global = int(state.get("batch_size", 0)) * int(state.get("world_size", 1))
        same = (state.get("seed"), saved_global, state.get("dataset_id"), state.get("shuffle_block")) == (
            self.seed,
            self.global_batch_size,
            self.dataset_id,
            self.shuffle_block,
        )
        if same:
            self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        else:
            # A refreshed dataset or changed batch size or shuffle: the old position means nothing, start a new epoch.
            log.warning(
                "loader state is for another dataset/seed/global batch size/shuffle block; starting epoch %d from "
                "its first batch",
                int(state["epoch"]) + 1,
            )
            self.epoch, self.batch_index = int(state["epoch"]) + 1, 0
        self._order_epoch = None

    # --- iteration ---
    def _positions(self) -> Iterator[Position]:
        """Every batch this rank reads from the current position on (an empty slice of a short partial batch is
        passed over, alike on every rank)."""
        epoch, index = self.epoch, self.batch_index
        while True:
            if self._order_epoch != epoch:
                self._order, self._order_epoch = self.epoch_batches(epoch), epoch
            if not self._order or not self._order.sizes.any():
                raise ValueError(f"no batch of {self.batch_size} per rank x {self.world_size} ranks in any bucket: "
                                 "lower batch_size or set drop_last false")
            if index >= len(self._order):
                epoch, index = epoch + 1, 0
                continue
            bucket, indices = self._order[index]
            if not indices:
                index += 1
                continue
            if self.shard_check is not None and self.shard_check.touched < self._owned:
                self._touch(epoch, index)
            after = index + 1
            while after < len(self._order) and not self._order.sizes[after]:
                after += 1
            yield Position(epoch, index, bucket, indices, int(self._order.first[index]),
                           (epoch, after) if after < len(self._order) else (epoch + 1, 0))
            index += 1

    def _touch(self, epoch: int, index: int) -> None:
        """Hand the shards read at this rank's batch ``index`` of ``epoch`` to the shard check: this batch's
        (alone), or under a process group those of every rank's batch at this position that this rank owns."""

        rank, size = self._check_owner
        if size == 1:
            batches = [self._order[index]]
        else:  # every rank's slice at this position: the whole global batch
            if self._global_epoch != epoch:
                self._global, self._global_epoch = self.global_batches(epoch), epoch
            batches = [self._global[index]]
        shards = {s for bucket, indices in batches for s in self._shards_of(bucket, indices)}
        entries = self.manifest["shards"]
        self.shard_check.touch(sorted(s for s in shards if s % size == rank and entries[s].get("sha256")))

    def _shards_of(self, bucket: tuple[int, ...], indices: list[int]) -> list[int]:
        """The shard numbers a batch of ``indices`` within ``bucket`` reads (global sample ids -> shards, no
        ``SampleRef`` built)."""
        import numpy as np

        samples = self.buckets[bucket].samples
        ids = np.asarray(indices, dtype=np.int64) + samples.start if isinstance(samples, range) else samples[indices]
        return np.unique(np.searchsorted(self._shard_base_np, ids, side="right") - 1).tolist()

    def _streamed(self, positions: Iterator[Position]) -> Iterator[Position]:
        """``positions``, each yielded once its shards are in the stream's cache: the stream is told the
        shards of the next ``AHEAD_BATCHES`` batches (downloaded in that order), and when a position is asked
        for, the batch of the one before it was read (both ``__iter__`` paths read a batch before asking for
        the next position): its shards are released, those this rank has finished with for the epoch marked
        for eviction first."""
        from latentmill.trainer.stream import AHEAD_BATCHES

        ahead: deque[tuple[Position, list[int]]] = deque()
        read: tuple[Position, list[int]] | None = None
        for position in positions:
            shards = self._shards_of(position.bucket, position.indices)
            self.stream.want(shards)
            ahead.append((position, shards))
            if len(ahead) < AHEAD_BATCHES:
                continue
            if read is not None:
                last = self._last_uses(read[0].epoch)
                self.stream.release(read[1], [s for s in read[1] if last.get(s, -1) <= read[0].index])
            read = ahead.popleft()
            self.stream.ready(read[1])
            yield read[0]

    def _last_uses(self, epoch: int) -> dict[int, int]:
        """Per shard, the index of this rank's last batch of ``epoch`` that reads it (over the plan's arrays:
        no Python step per batch)."""
        import numpy as np

        if self._last_use is None or self._last_use[0] != epoch:
            plan = self.epoch_batches(epoch)
            sizes = np.asarray(plan.sizes, dtype=np.int64)
            batch_of = np.repeat(np.arange(len(plan), dtype=np.int64), sizes)
            where = np.repeat(np.asarray(plan.starts, dtype=np.int64), sizes) + (
                np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes))
            number = np.repeat(np.asarray(plan.which, dtype=np.int64), sizes)
            shard = np.empty(len(batch_of), dtype=np.int64)
            for b, bucket in enumerate(plan.buckets):
                mask = number == b
                local = np.asarray(plan.perms[b])[where[mask]]
                samples = self.buckets[bucket].samples
                ids = local + samples.start if isinstance(samples, range) else samples[local]
                shard[mask] = np.searchsorted(self._shard_base_np, ids, side="right") - 1
            last = np.full(len(self._indexes), -1, dtype=np.int64)
            np.maximum.at(last, shard, batch_of)
            self._last_use = (epoch, {s: int(i) for s, i in enumerate(last.tolist()) if i >= 0})
        return self._last_use[1]

    def captions(self) -> Iterator[str]:
        """Every sample's caption (its ``json`` member), shard after shard, read through the shard indexes."""
        for shard, index in enumerate(self._indexes):
            if self.stream is not None:
                self.stream.fetch_now(shard)
            for local in range(index.num_samples):
                ref = self._indexed_ref(self._shard_base[shard] + local)
                if META_MEMBER in ref.members:
                    yield str(json.loads(self._read(ref, META_MEMBER)).get("caption", ""))

    def _check_shard(self, shard: int) -> str | None:
        """The shard check's verdict on shard number ``shard`` (``shard_problems``), as one error message."""
        problems = shard_problems(self.cache_dir, self.manifest["shards"][shard])
        if not problems:
            return None
        lines = "\n  ".join(problems)
        return (f"cache shard {self.shard_paths[shard].name} is damaged (its bytes differ from the cache "
                f"manifest):\n  {lines}\nRun `latentmill verify` on the cache ({self.cache_dir}) to list every "
                "damaged shard, and re-run the prep to rebuild them before training again")

    def _advised(self, positions: Iterator[Position]) -> Iterator[Position]:
        """``positions``, each yielded once the kernel was asked (``POSIX_FADV_WILLNEED``) to read the
        members of the next ``ADVISE_AHEAD_BATCHES`` batches that are not in the page cache: with shards on
        disk that keeps several reads in flight while this batch is copied (the kernel's own read-ahead only
        helps sequential reads, and a shuffled epoch jumps between members). Advice on cached pages is not
        free (a hot epoch took 1.2x as long with it), so each sample is checked first (``_on_disk_now``)."""
        if not hasattr(os, "posix_fadvise"):
            yield from positions
            return
        ahead: list[Position] = []
        for position in positions:
            ahead.append(position)
            epoch, bucket = position.epoch, position.bucket
            for ref in (self.buckets[bucket][i] for i in position.indices):
                if self._on_disk_now(ref):
                    for member in (VAE_MEMBER, self._text_member(ref, epoch)):
                        if member is not None:
                            offset, size = ref.members[member]
                            os.posix_fadvise(self._reader.fd(ref.shard), offset, size, os.POSIX_FADV_WILLNEED)
            if len(ahead) > ADVISE_AHEAD_BATCHES:
                yield ahead.pop(0)

    def _on_disk_now(self, ref: SampleRef) -> bool:
        """Whether sample ``ref`` reads from the disk: the middle byte of its largest member is not in the
        page cache (a 1-byte ``RWF_NOWAIT`` read fails with EAGAIN). Not its first or last bytes: a batch's
        header reads and the kernel's read-ahead may have brought the pages around them. Where the kernel or
        the file system cannot tell, what the start-up saw (``_on_disk``: the first index file read slowly)."""
        if self._nowait:
            try:
                os.preadv(self._reader.fd(ref.shard), [self._probe], ref.probe_at, os.RWF_NOWAIT)
                return False
            except BlockingIOError:
                return True
            except OSError:  # EOPNOTSUPP and the like: this file system cannot say
                self._nowait = False
        return self._on_disk

    def _text_member(self, ref: SampleRef, epoch: int) -> str | None:
        """The text member sample ``ref`` reads in ``epoch``: None when its caption is dropped (the empty
        prompt's tensors instead), else one of its captions (several: one per epoch, seeded)."""
        if self.empty_prompt is not None and caption_dropped(self.seed, epoch, ref.key, self.caption_dropout):
            return None
        texts = ref.texts
        return texts[caption_choice(self.seed, epoch, ref.key, len(texts)) if len(texts) > 1 else 0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches forever; with ``prefetch`` the next one is read in a background thread while the current
        one trains (once the consumer takes ``PREFETCH_MIN_CONSUMER_S`` or more per batch), without it each
        batch is read in the calling thread when asked for.

        The position (``state_dict``) only moves when a batch is handed out, so a checkpoint taken after
        batch N resumes at batch N+1 whatever was prefetched.
        """
        positions = self._advised(self._positions()) if self.stream is None else self._streamed(self._positions())
        if not self.prefetch:
            for at in positions:
                batch = self._read_batch(at.bucket, at.indices, at.epoch)
                _stamp(batch, at)
                self.epoch, self.batch_index = at.after  # state now points at the next batch
                yield batch
            return
        # The read-ahead: the next batch is read in a thread while the consumer works on this one, when the
        # consumer spends long enough per batch for that to pay (a tight loop gains nothing from a thread on
        # the reading side: it reads in its own thread). It starts after a short delay (a share of the
        # consumer's time per batch), so that the reader's Python does not hold the GIL just when the
        # consumer's own per-batch Python runs (moving the batch, drawing noise); a consumer that asks again
        # sooner starts it at once.
        asked = threading.Event()

        def read(bucket: tuple[int, ...], indices: list[int], epoch: int, delay: float) -> dict[str, Any]:
            if delay > 0:
                asked.wait(delay)
            return self._read_batch(bucket, indices, epoch, convert=False)  # converted when handed out

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="latent-prefetch") as pool:
            pending: tuple[Position, Future] | None = None
            handed_at: float | None = None
            while True:
                asked.set()
                consumer_s = time.perf_counter() - handed_at if handed_at is not None else 0.0
                if pending is None:
                    at = next(positions)
                    batch = self._read_batch(at.bucket, at.indices, at.epoch)
                else:
                    at, future = pending
                    batch = self._convert(future.result())
                    pending = None
                if consumer_s >= PREFETCH_MIN_CONSUMER_S:
                    delay = min(PREFETCH_DELAY_MAX_S, PREFETCH_DELAY_SHARE * consumer_s)
                    ahead = next(positions)
                    asked.clear()
                    pending = ahead, pool.submit(read, ahead.bucket, ahead.indices, ahead.epoch, delay)
                _stamp(batch, at)
                self.epoch, self.batch_index = at.after  # state now points at the next batch
                handed_at = time.perf_counter()
                yield batch

    def in_order(self) -> Iterator[dict[str, Any]]:
        """Every sample once, unshuffled: each bucket's samples in manifest then tar order, ``batch_size`` at a
        time (the evaluation's pass over the held-out set; epoch 0's caption choice, position untouched)."""
        for bucket, refs in self.buckets.items():
            for start in range(0, len(refs), self.batch_size):
                yield self._read_batch(bucket, list(range(start, min(start + self.batch_size, len(refs)))), 0)

    def _read(self, ref: SampleRef, ext: str) -> bytes:
        """The bytes of one member of a sample (metadata, tests; batches read with ``_read_batch``)."""
        return self._reader.read(ref, ext)

    def _read_batch(
        self, bucket: tuple[int, ...], indices: list[int], epoch: int, convert: bool = True
    ) -> dict[str, Any]:
        """Read one batch (``ShardReader.read_batch``: each tensor payload straight into its row).

        ``convert=False`` leaves the tensors in their stored dtype (``_convert`` does the rest): the
        read-ahead thread runs no multi-threaded torch op, whose OpenMP team would fight the training
        step's for the cores (with the conversion in the read-ahead thread a CPU step took 1.3-1.5x as
        long).
        """
        refs = [self.buckets[bucket][i] for i in indices]
        texts = [self._text_member(ref, epoch) for ref in refs]
        columns = self._reader.read_batch(
            bucket, refs, texts, empty_prompt=self.empty_prompt, distribution=self.distribution, pad=self.pad
        )
        for name in self.masked:
            columns[f"{name}_mask"] = self._token_mask(name, columns[name].shape[1], refs, texts)
        batch = {
            **columns,
            "keys": [r.key for r in refs],
            "bucket": list(bucket),
            "caption_dropped": torch.tensor([text is None for text in texts], dtype=torch.bool),
        }
        return self._convert(batch) if convert else batch

    def _token_mask(self, name: str, tokens: int, refs: list[SampleRef], texts: list[str | None]) -> torch.Tensor:
        """[B, tokens] bool, True on each row's real tokens of stream ``name`` (its stored length)."""
        mask = torch.zeros(len(refs), tokens, dtype=torch.bool)
        for i, (ref, member) in enumerate(zip(refs, texts)):
            if member is None:
                length = self.empty_prompt[name].shape[0]
            else:
                layout = ref.layouts.get(member) or self._reader.layout(ref, member)
                length = layout.tensors[name].shape[0]
            mask[i, :length] = True
        return mask

    def _convert(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch's tensors in the loader's ``dtype`` (one conversion per column)."""
        for name, value in batch.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.dtype:
                batch[name] = value.to(self.dtype)
        return batch

    def read_metadata(self, bucket: tuple[int, ...], index: int) -> dict:
        """The ``k.json`` metadata of one sample (for inspection and tests)."""
        return json.loads(self._read(self.buckets[bucket][index], META_MEMBER))

    def close(self) -> None:
        """Close the shard files (and stop the read threads and the shard check)."""
        if getattr(self, "shard_check", None) is not None:
            self.shard_check.close()
        if getattr(self, "stream", None) is not None:
            self.stream.close()
        self._reader.close()

    def __enter__(self) -> "LatentLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
