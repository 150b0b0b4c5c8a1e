"""The cache stage's recipe section (``cache:``), apart from the stage so a recipe loads without torch.

:mod:`latentmill.stages.cache` re-exports :class:`CacheConfig`; import it from either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from latentmill.stages import pixels
from latentmill.stages.shardio import DEFAULT_SHARD_BYTES, check_shard_bytes

from latentmill.core.config import ConfigError


@dataclass
class CacheConfig:
    """How latents and text embeddings are computed and stored."""

    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # storage dtype of every tensor
    batch_size: int = 8  # samples per encoder call (shapes are uniform inside a bucket shard)
    max_sequence_length: int = 512  # text tokens, as the pipeline's max_sequence_length
    device: Literal["auto", "cpu", "cuda"] = "auto"
    latents: Literal["mean", "sample", "distribution"] = "mean"  # distribution: mean + std, sampled in training
    trim_text: Literal["auto", "always", "never"] = "auto"  # see docs/cache-format.md
    seed: int = 0  # for latents: sample
    # Decode the next batch in a thread while the current one is encoded. "auto": on when encoding on a GPU;
    # off on the CPU, where the decode thread fights the encoders' threads for the cores.
    prefetch: Union[bool, Literal["auto"]] = "auto"
    # CPU threads per encoder call. CPU kernels reduce in a thread-count-dependent order, so the count is
    # pinned: the same bytes whichever runner (threads, processes, Dask with OMP_NUM_THREADS=1) ran it.
    threads: int = 0  # 0: all cores of the machine
    # What transparent pixels are composited over (a colour name or #rrggbb), here and in captioning.
    alpha_background: str = "white"
    # Target size of a cache shard: bucket shards are grouped into units whose estimated output (latents +
    # text embeddings, see docs/cache-format.md) stays within it; each unit writes one shard of all its buckets.
    shard_bytes: int = DEFAULT_SHARD_BYTES
    # Deterministic algorithms, cuDNN deterministic, no TF32 while encoding ("auto": on CUDA; see
    # docs/cache-format.md, "Reproducible where"). Not part of the component keys.
    deterministic: Union[bool, Literal["auto"]] = "auto"
    # Encode a clip longer than one of the VAE's temporal tiles in those tiles, blended as the VAE blends them
    # ("auto"), so memory stays that of one tile; or whole ("never"). A no-op for a family whose VAE has none
    # (see docs/cache-format.md, "Long clips").
    vae_tiling: Literal["auto", "never"] = "auto"

    @property
    def background(self) -> tuple[int, int, int]:
        """``alpha_background`` as an RGB triple."""
        return pixels.parse_background(self.alpha_background)

    def validate(self) -> None:
        try:
            pixels.parse_background(self.alpha_background)
        except ValueError:
            raise ConfigError(f"cache.alpha_background: {self.alpha_background!r} is not a colour; use a name "
                              "such as 'white', 'black', 'gray' or a hex colour '#rrggbb'") from None
        if self.batch_size < 1:
            raise ConfigError(f"cache.batch_size: must be >= 1, got {self.batch_size}")
        if self.max_sequence_length < 1:
            raise ConfigError(f"cache.max_sequence_length: must be >= 1, got {self.max_sequence_length}")
        if self.threads < 0:
            raise ConfigError(f"cache.threads: must be >= 0 (0 = all cores), got {self.threads}")
        check_shard_bytes(self.shard_bytes, "cache.shard_bytes")
