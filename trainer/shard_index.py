"""Where a latent shard's tensors are, without reading them: shard indexes and safetensors headers.

A cache (format 3) has an index file beside each tar (``latentmill.stages.shardindex.read_shard_index``: each
member's offset and size, each sample's key and bucket, each safetensors member's tensors);
``parse_safetensors_header`` checks a member's JSON header (dtypes, shapes, byte ranges) and says where each
tensor's payload lies, so that ``latentmill.trainer.loader.LatentLoader`` can read payloads straight into
batch tensors. No tensor data is read here. The format code itself lives in ``latentmill.stages.shardindex``
and ``latentmill.stages.tarshard`` (the cache stage writes indexes; it must not import the trainer package).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from latentmill.stages.shardindex import (  # noqa: F401  (re-exported: the trainer's view of the format)
    ShardIndex,
    ShardIndexError,
    load_shard_index,
    verify_index,
)
from latentmill.stages.tarshard import (  # noqa: F401  (re-exported: the trainer's view of the format)
    HEADER_READ,
    MAX_HEADER,
    HeaderError,
    safetensors_entries,
)

# safetensors dtype names -> torch dtypes (the ones torch can hold; the cache stage writes BF16/F16/F32)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors member: dtype, shape and payload byte range from the member's start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class MemberLayout:
    """A parsed, checked safetensors header: its tensors in header order and the member size it implies."""

    tensors: dict[str, TensorSpec]
    size: int  # 8 + header length + payload bytes: the whole member


def parse_safetensors_header(header: bytes) -> MemberLayout:
    """Parse and check the JSON header of a safetensors member (the bytes after its 8-byte length).

    Checks what ``safetensors.torch.load`` checks (``safetensors_entries``): known dtypes, integer shapes,
    each tensor's byte range as long as its shape and dtype say, the ranges back to back from 0 in offset
    order. Raises ``HeaderError``.
    """
    entries, size = safetensors_entries(header)
    return MemberLayout(
        {name: TensorSpec(SAFETENSORS_DTYPES[dtype], shape, begin, end) for name, dtype, shape, begin, end in entries},
        size,
    )


def layout_from_index(entry: dict[str, Any]) -> MemberLayout:
    """The ``MemberLayout`` of one entry of a shard index's ``layouts`` table (checked when it was written:
    no safetensors header is parsed)."""
    return MemberLayout(
        {
            name: TensorSpec(SAFETENSORS_DTYPES[dtype], tuple(shape), begin, end)
            for name, dtype, shape, begin, end in entry["tensors"]
        },
        int(entry["size"]),
    )
