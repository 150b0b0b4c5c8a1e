"""The same snapshot feeds a JAX trainer: batches of NumPy arrays (or ``jax.Array`` s) from a latent cache.

A cache (``prep/cache``) or a dataset snapshot (``snapshots/<name>``) is safetensors inside plain tars, with an
index beside each tar: nothing in it is PyTorch-only. :class:`JaxLatentLoader` takes the very arguments of
``latentmill.trainer.loader.LatentLoader`` and keeps its contract, because it *is* that loader's plan:

* one bucket per batch;
* the order a pure function of (seed, epoch, snapshot): the torch loader's ``epoch_batches``, not a copy;
* a resumable position: ``state_dict`` / ``load_state_dict`` are the torch loader's (epoch, next batch), so
  a position saved by either loader resumes the other;
* a rank's share: ``rank`` / ``world_size`` (on a multi-host JAX job: ``jax.process_index()`` and
  ``jax.process_count()``), every ``world_size``-th batch of the global plan, the same count per rank.

Each batch's tensors are read from the index's byte ranges straight into preallocated host buffers
(``os.preadv``, one copy per tensor, as the torch loader reads them) and handed out as NumPy arrays that
share those buffers: ``latents``, ``prompt_embeds``, ``pooled_prompt_embeds`` (Flux), ``latents_std``
(``"latents": "distribution"`` caches), ``caption_dropped`` (bool), plus ``keys``, ``bucket``, ``epoch`` and
``index``. NumPy has no bfloat16: bf16 arrays use ``ml_dtypes.bfloat16`` (a dependency of jax), which
``jax.device_put`` takes as ``jnp.bfloat16``. On a GPU ask for ``dtype="bfloat16"`` (the stored dtype of
the cache stage): half the bytes to move, and the cast to float32 happens on the device.

Torch: ``import latentmill.jax`` imports neither torch nor jax. Building a loader does import torch (CPU is
enough), because the index reader (``latentmill.stages.shardindex``, through webdataset) and the planning
code live beside the torch trainer; duplicating them torch-free would be a second implementation of the
order to keep equal, which is exactly what this module avoids. A JAX-only install therefore needs the CPU
torch wheel too (``pip install latentmill[jax]`` brings it, as a dependency of the package).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

_DTYPES = ("float32", "float16", "bfloat16", "float64")  # output dtypes (the shared reader converts to them)


def _dtype_name(dtype: Any) -> str:
    """The name of an output dtype given as a string, a numpy dtype, ``ml_dtypes.bfloat16`` or ``jnp`` one."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: the loader hands out one of {', '.join(_DTYPES)}")
    return name


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A CPU torch tensor as a NumPy array sharing its memory (bf16 as ``ml_dtypes.bfloat16``: no copy)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_jax(batch: dict[str, Any], device: Any = None) -> dict[str, Any]:
    """The batch with its arrays put on ``device`` (``jax.device_put``; default: the default device), the
    rest (``keys``, ``bucket``, ``epoch``, ``index``) as it is. ``device`` may be a ``jax.sharding.Sharding``
    over this process's devices (the batch split over them); on several hosts, where each process loads its
    rank's share, build the global arrays with ``jax.make_array_from_process_local_data`` instead."""
    import jax

    arrays = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
    return {**batch, **jax.device_put(arrays, device)}


def resolve_snapshot_dir(path: str | Path, name: str = "latest") -> Path:
    """The folder to read: ``path`` itself when it holds a ``manifest.json`` (a snapshot or a cache), else
    snapshot ``name`` (``latest`` or a published name) of the ``output_dir`` ``path``."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    from latentmill.pipelines.snapshot import resolve_snapshot

    return resolve_snapshot(path, name)


class JaxLatentLoader:
    """Infinite iterator of single-bucket NumPy batches (``as_jax``: ``jax.Array`` s), deterministic in
    (seed, epoch, snapshot), resumable: the batches of ``LatentLoader`` with the same arguments, exactly.

    ``dtype``: ``float32`` (default, as ``LatentLoader``), ``bfloat16``, ``float16`` or ``float64``; None: the
    dtype the cache stage wrote (its manifest's ``dtype``: no conversion on the host). ``as_jax``: put each batch's arrays on ``device`` (``to_jax``) before it is
    handed out. The other arguments are ``LatentLoader`` 's (``shuffle_block``: the recipe's
    ``loader.shuffle_block``, the same block shuffle; ``prefetch``: the next batch is read in a thread while the
    caller's step runs, which with JAX's asynchronous dispatch overlaps the device's work too).
    """

    def __init__(
        self,
        cache_dir: str | Path,
        batch_size: int,
        seed: int = 0,
        *,
        dtype: Any = "float32",
        drop_last: bool = False,
        verify: bool = False,
        manifest: dict | None = None,
        rank: int = 0,
        world_size: int = 1,
        caption_dropout: float = 0.0,
        prefetch: bool = True,
        io_threads: int = 2,
        as_jax: bool = False,
        device: Any = None,
        shuffle_block: int | None = None,
    ) -> None:
        import torch

        from latentmill.trainer.loader import LatentLoader, read_manifest

        if dtype is None:  # the cache's own dtype: no conversion on the host
            manifest = manifest if manifest is not None else read_manifest(cache_dir)
            dtype = manifest.get("dtype", "float32")
        self.dtype = _dtype_name(dtype)
        self.as_jax, self.device = as_jax, device
        self._loader = LatentLoader(
            cache_dir, batch_size, seed, dtype=getattr(torch, self.dtype), drop_last=drop_last, verify=verify,
            manifest=manifest, rank=rank, world_size=world_size, caption_dropout=caption_dropout,
            prefetch=prefetch, io_threads=io_threads, shuffle_block=shuffle_block,
        )

    # --- what the torch loader knows: the snapshot, its buckets and the plan ---
    @property
    def manifest(self) -> dict:
        return self._loader.manifest

    @property
    def family(self) -> str:
        return self._loader.family

    @property
    def dataset_id(self) -> str:
        return self._loader.dataset_id

    @property
    def num_samples(self) -> int:
        return self._loader.num_samples

    @property
    def rank(self) -> int:
        return self._loader.rank

    @property
    def world_size(self) -> int:
        return self._loader.world_size

    @property
    def buckets(self) -> list[tuple[int, ...]]:
        """The snapshot's buckets ([width, height, frames]), sorted: the batch shapes a jitted step meets."""
        return list(self._loader.buckets)

    def epoch_batches(self, epoch: int):
        """This rank's batches of ``epoch`` as (bucket, sample indices within the bucket): the torch plan."""
        return self._loader.epoch_batches(epoch)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self._loader)

    # --- resumable state: the torch loader's, so a position saved by either resumes the other ---
    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch (plain JSON data)."""
        return self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken."""
        self._loader.load_state_dict(state)

    # --- iteration ---
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches forever, from the current position; the position moves when a batch is handed out."""
        import torch

        for batch in self._loader:
            out = {k: torch_to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            yield to_jax(out, self.device) if self.as_jax else out

    def close(self) -> None:
        """Close the shard files (and stop the read threads)."""
        self._loader.close()

    def __enter__(self) -> "JaxLatentLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
