"""``LatentLoader``: batches of cached latents and text embeddings from the cache stage's shards.

Contract read (``<cache_dir>/manifest.json``, written by the cache stage; docs/cache-format.md, format
versions 1 and 2): a list of uncompressed webdataset tar shards, each holding ONE bucket
``[width, height, frames]``; per sample ``k.vae.safetensors`` (``latents``, and ``latents_std`` when the
manifest says ``"latents": "distribution"``), ``k.text.safetensors`` (``prompt_embeds``, and
``pooled_prompt_embeds`` for Flux) and ``k.json``; ``empty_prompt.safetensors`` holds the text tensors of
the empty caption.

Design choices:

* One bucket per batch, never mixed shapes. The order is a pure function of (seed, epoch, manifest): shuffle
  each bucket's samples, chunk them into batches of ``batch_size``, shuffle the list of batches.
* Memory: at start-up only tar *headers* are read (an index of byte ranges per sample member). A batch reads
  its members with ``os.pread`` from the shard files, so RAM holds one batch, whatever the dataset size,
  and each member is read exactly once per epoch. This needs local, uncompressed tars (what the cache
  stage writes); remote (fsspec) caches are not supported yet.
* ``state_dict()`` is (epoch, index of the next batch): restoring it yields the very same next batches.
* Under DDP each rank takes every ``world_size``-th batch of the global plan, the same number per rank.
* Trimmed text (``text.trimmed``): ``prompt_embeds`` hold only the real tokens and are zero-padded to
  ``text.pad_to`` when a batch is assembled, which is what ``WanPipeline`` feeds its transformer.
* Caption dropout: a sample trains on the empty prompt's tensors with probability ``caption_dropout``; the
  decision is a pure function of (seed, epoch, sample key), so a resumed run drops the very same captions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load as load_safetensors

log = logging.getLogger(__name__)

FORMAT_VERSIONS = (1, 2)
VAE_MEMBER = "vae.safetensors"
TEXT_MEMBER = "text.safetensors"
META_MEMBER = "json"


@dataclass(frozen=True)
class SampleRef:
    """Where one cached sample lives: its shard file and the byte range of each member."""

    shard: int  # index into LatentLoader.shard_paths
    key: str
    members: dict[str, tuple[int, int]]  # extension -> (offset, size) in the tar


def read_manifest(cache_dir: str | Path) -> dict:
    """Load ``<cache_dir>/manifest.json`` and check that it is a cache-stage manifest this trainer reads."""
    path = Path(cache_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"no cache manifest at {path}: run the cache stage first")
    manifest = json.loads(path.read_text())
    if manifest.get("stage") != "cache":
        raise ValueError(
            f"{path} is a {manifest.get('stage')!r} manifest, the trainer needs the 'cache' stage's"
        )
    if manifest.get("format_version") not in FORMAT_VERSIONS:
        raise ValueError(
            f"{path}: format_version {manifest.get('format_version')!r}, this trainer reads "
            f"{' and '.join(map(str, FORMAT_VERSIONS))}"
        )
    if not manifest.get("shards"):
        raise ValueError(f"{path} lists no shards: nothing to train on")
    if manifest.get("latents", "mean") not in ("mean", "sample", "distribution"):
        raise ValueError(f"{path}: latents {manifest['latents']!r} is not one of mean, sample, distribution")
    return manifest


def manifest_family(manifest: dict) -> str:
    """The model family that produced the cache (``flux`` when the manifest does not say: format 1)."""
    return manifest.get("family") or "flux"


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


def index_shard(path: Path) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """List (key, {extension: (offset, size)}) per sample of an uncompressed tar, reading headers only."""
    samples: dict[str, dict[str, tuple[int, int]]] = {}
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            dirname, _, basename = member.name.rpartition("/")
            key, dot, ext = basename.partition(".")
            if not dot:
                continue
            key = f"{dirname}/{key}" if dirname else key
            samples.setdefault(key, {})[ext] = (member.offset_data, member.size)
    return list(samples.items())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    ([width, height, frames]), ``epoch`` and ``index`` (position of the batch in its epoch).
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
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.cache_dir = Path(cache_dir)
        self.manifest = manifest if manifest is not None else read_manifest(self.cache_dir)
        self.batch_size, self.seed, self.dtype, self.drop_last = batch_size, seed, dtype, drop_last
        self.family = manifest_family(self.manifest)
        self.distribution = self.manifest.get("latents", "mean") == "distribution"
        text = self.manifest.get("text") or {}
        self.pad_to: int | None = int(text["pad_to"]) if text.get("trimmed") else None
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1], got {caption_dropout}")
        self.caption_dropout = caption_dropout
        self.prefetch = prefetch  # read the next batch while the current one trains
        self.empty_prompt = self._load_empty_prompt() if caption_dropout > 0 else None
        # What the sample order depends on: the shard list (content-addressed), not the stage config.
        shard_ids = [
            (e["path"], e.get("sha256"), e.get("samples"), e.get("bucket")) for e in self.manifest["shards"]
        ]
        self.dataset_id = hashlib.sha256(json.dumps(shard_ids, sort_keys=True).encode()).hexdigest()

        # --- index every shard's headers, grouped by bucket (manifest order, then tar order) ---
        self.shard_paths: list[Path] = []
        by_bucket: dict[tuple[int, ...], list[SampleRef]] = {}
        for entry in self.manifest["shards"]:
            path = self.cache_dir / entry["path"]
            if path.suffix != ".tar":
                raise ValueError(f"{path}: only uncompressed .tar shards are supported")
            if verify and entry.get("sha256") and _sha256(path) != entry["sha256"]:
                raise ValueError(f"{path}: sha256 differs from the manifest (corrupt or replaced shard)")
            shard_id = len(self.shard_paths)
            self.shard_paths.append(path)
            samples = index_shard(path)
            if "samples" in entry and entry["samples"] != len(samples):
                raise ValueError(
                    f"{path}: manifest says {entry['samples']} samples, the tar holds {len(samples)}"
                )
            for key, members in samples:
                missing = {VAE_MEMBER, TEXT_MEMBER} - set(members)
                if missing:
                    raise ValueError(f"{path}: sample {key!r} lacks {', '.join(sorted(missing))}")
                by_bucket.setdefault(tuple(entry["bucket"]), []).append(SampleRef(shard_id, key, members))
        self.buckets = {b: by_bucket[b] for b in sorted(by_bucket)}
        self.num_samples = sum(len(refs) for refs in self.buckets.values())

        self.epoch, self.batch_index = 0, 0
        self._order_epoch: int | None = None
        self._order: list[tuple[tuple[int, ...], list[int]]] = []
        self._fds: dict[int, int] = {}

    def _load_empty_prompt(self) -> dict[str, torch.Tensor]:
        """The text tensors of the empty caption (``manifest["empty_prompt"]``), checked against its sha256."""
        entry = self.manifest.get("empty_prompt")
        if not entry:
            raise ValueError(
                f"{self.cache_dir}: trainer.caption_dropout needs the empty prompt's embeddings, and the cache "
                "manifest has no empty_prompt entry (cache format 2 writes one); re-run the cache stage"
            )
        path = self.cache_dir / entry["path"]
        data = path.read_bytes()
        if entry.get("sha256") and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from the manifest")
        return load_safetensors(data)

    # --- order: a pure function of (seed, epoch, manifest) ---
    def global_batches(self, epoch: int) -> list[tuple[tuple[int, ...], list[int]]]:
        """All ranks' batches of ``epoch`` as (bucket, sample indices within that bucket), in order."""
        gen = _epoch_generator(self.seed, epoch)
        batches = []
        for bucket, refs in self.buckets.items():
            perm = torch.randperm(len(refs), generator=gen).tolist()
            for start in range(0, len(perm), self.batch_size):
                chunk = perm[start : start + self.batch_size]
                if self.drop_last and len(chunk) < self.batch_size:
                    continue
                batches.append((bucket, chunk))
        return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]

    def epoch_batches(self, epoch: int) -> list[tuple[tuple[int, ...], list[int]]]:
        """This rank's batches of ``epoch``: every ``world_size``-th global batch.

        Every rank gets the same count; the last ``len % world_size`` global batches of the epoch are skipped.
        """
        batches = self.global_batches(epoch)
        per_rank = len(batches) // self.world_size
        return batches[self.rank :: self.world_size][:per_rank]

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.epoch_batches(0))

    # --- resumable state ---
    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch (plain JSON data)."""
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_id": self.dataset_id,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken."""
        same = (state.get("seed"), state.get("batch_size"), state.get("dataset_id")) == (
            self.seed,
            self.batch_size,
            self.dataset_id,
        )
        if same:
            self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
            saved_world = int(state.get("world_size", 1))
            if saved_world != self.world_size:  # continue from the same global position, approximately
                self.batch_index = self.batch_index * saved_world // self.world_size
        else:
            # A refreshed dataset or changed batch size: the old position means nothing, start a new epoch.
            log.warning(
                "loader state is for another dataset/seed/batch size; starting epoch %d from its first batch",
                int(state["epoch"]) + 1,
            )
            self.epoch, self.batch_index = int(state["epoch"]) + 1, 0
        self._order_epoch = None

    # --- iteration ---
    def _positions(self) -> Iterator[tuple[int, int, tuple[int, ...], list[int]]]:
        """(epoch, index, bucket, sample indices) of every batch from the current position on."""
        epoch, index = self.epoch, self.batch_index
        while True:
            if self._order_epoch != epoch:
                self._order, self._order_epoch = self.epoch_batches(epoch), epoch
            if not self._order:
                raise ValueError("no full batch in any bucket: lower batch_size or set drop_last false")
            if index >= len(self._order):
                epoch, index = epoch + 1, 0
                continue
            bucket, indices = self._order[index]
            yield epoch, index, bucket, indices
            index += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches forever; the next one is read in a background thread while the current one trains.

        The position (``state_dict``) only moves when a batch is handed out, so a checkpoint taken after
        batch N resumes at batch N+1 whatever was prefetched.
        """
        positions = self._positions()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="latent-prefetch") as pool:

            def submit():
                epoch, index, bucket, indices = next(positions)
                return epoch, index, pool.submit(self._read_batch, bucket, indices, epoch)

            pending = submit()
            while True:
                epoch, index, future = pending
                batch = future.result()
                if self.prefetch:
                    pending = submit()
                batch["epoch"], batch["index"] = epoch, index
                self.epoch, self.batch_index = epoch, index + 1  # state now points at the next batch
                yield batch
                if not self.prefetch:
                    pending = submit()

    def _read(self, ref: SampleRef, ext: str) -> bytes:
        fd = self._fds.get(ref.shard)
        if fd is None:
            fd = self._fds[ref.shard] = os.open(self.shard_paths[ref.shard], os.O_RDONLY)
        offset, size = ref.members[ext]
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise IOError(f"{self.shard_paths[ref.shard]}: short read for {ref.key}.{ext}")
        return data

    def _read_batch(self, bucket: tuple[int, ...], indices: list[int], epoch: int) -> dict[str, Any]:
        refs = [self.buckets[bucket][i] for i in indices]
        columns: dict[str, list[torch.Tensor]] = {}
        dropped = []
        for ref in refs:
            vae = load_safetensors(self._read(ref, VAE_MEMBER))
            texts = text_members(ref.members)  # several captions: one per epoch, seeded
            member = texts[caption_choice(self.seed, epoch, ref.key, len(texts))] if len(texts) > 1 else TEXT_MEMBER
            text = load_safetensors(self._read(ref, member))
            drop = self.empty_prompt is not None and caption_dropped(
                self.seed, epoch, ref.key, self.caption_dropout
            )
            if drop:
                text = self.empty_prompt
            dropped.append(drop)
            if self.distribution and "latents_std" not in vae:
                raise ValueError(
                    f"sample {ref.key!r}: the manifest says latents: distribution, no latents_std"
                )
            sample = {"latents": vae["latents"], **text}
            if self.distribution:
                sample["latents_std"] = vae["latents_std"]
            if self.pad_to is not None and "prompt_embeds" in sample:
                sample["prompt_embeds"] = pad_tokens(sample["prompt_embeds"], self.pad_to)
            if columns and set(sample) != set(columns):
                raise ValueError(f"sample {ref.key!r} holds {sorted(sample)}, others {sorted(columns)}")
            for name, tensor in sample.items():
                columns.setdefault(name, []).append(tensor)
        try:
            out = {name: torch.stack(ts).to(self.dtype) for name, ts in columns.items()}
        except RuntimeError as err:  # stack refuses mixed shapes
            raise ValueError(f"bucket {list(bucket)} holds samples of different shapes: {err}") from err
        return {
            **out,
            "keys": [r.key for r in refs],
            "bucket": list(bucket),
            "caption_dropped": torch.tensor(dropped, dtype=torch.bool),
        }

    def read_metadata(self, bucket: tuple[int, ...], index: int) -> dict:
        """The ``k.json`` metadata of one sample (for inspection and tests)."""
        return json.loads(self._read(self.buckets[bucket][index], META_MEMBER))

    def close(self) -> None:
        """Close the shard files."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "LatentLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
