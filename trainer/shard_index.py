"""Where a latent shard's tensors are, without reading them: the tar index and checked safetensors headers.

``index_shard`` lists each sample's members (byte offset and size) of an uncompressed tar from its
headers alone; ``parse_safetensors_header`` checks a member's JSON header (dtypes, shapes, byte ranges) and
says where each tensor's payload lies, so that ``latentmill.trainer.loader.LatentLoader`` can read payloads straight
into batch tensors. No tensor data is read here.
"""

from __future__ import annotations

import json
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

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
HEADER_READ = 4096  # bytes read at a member's start: its safetensors header (typically < 300 bytes) fits
MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header
_TAR_BLOCK = 512
_TAR_CHUNK = 4096  # bytes read per tar index pread: small members' data and the next headers come along


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


class HeaderError(ValueError):
    """A safetensors header that does not describe a valid member (the caller adds shard and key)."""


def parse_safetensors_header(header: bytes) -> MemberLayout:
    """Parse and check the JSON header of a safetensors member (the bytes after its 8-byte length).

    Checks what ``safetensors.torch.load`` checks: known dtypes, integer shapes, each tensor's byte range as
    long as its shape and dtype say, the ranges back to back from 0 in offset order. Raises ``HeaderError``.
    """
    try:
        entries = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeaderError(f"safetensors header is not JSON ({err})") from None
    if not isinstance(entries, dict):
        raise HeaderError("safetensors header is not a JSON object")
    tensors: dict[str, TensorSpec] = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise HeaderError(f"tensor {name!r}: entry is not an object")
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise HeaderError(f"tensor {name!r}: unknown dtype {entry.get('dtype')!r}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise HeaderError(f"tensor {name!r}: invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise HeaderError(f"tensor {name!r}: invalid data_offsets {offsets!r}")
        numel = 1
        for d in shape:
            numel *= d
        begin, end = offsets
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise HeaderError(
                f"tensor {name!r}: data_offsets {offsets} hold {end - begin} bytes, "
                f"{entry['dtype']} {shape} needs {numel * dtype.itemsize}"
            )
        tensors[name] = TensorSpec(dtype, tuple(shape), begin, end)
    position = 0
    for name, spec in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if spec.begin != position:
            raise HeaderError(f"tensor {name!r}: data_offsets start at {spec.begin}, expected {position}")
        position = spec.end
    data_start = 8 + len(header)
    return MemberLayout(
        {
            name: TensorSpec(t.dtype, t.shape, data_start + t.begin, data_start + t.end)
            for name, t in tensors.items()
        },
        data_start + position,
    )


def _tar_size(field: bytes) -> int | None:
    """A ustar numeric field (octal ASCII); None for anything else (base-256, garbage)."""
    if field[0] & 0x80:  # base-256: left to tarfile
        return None
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return None


def _st_header(chunk: bytes, at: int, size: int) -> bytes | None:
    """The JSON header of the safetensors member of ``size`` bytes at ``chunk[at:]``; None if cut off."""
    if at + 8 > len(chunk):
        return None
    end = at + 8 + int.from_bytes(chunk[at : at + 8], "little")
    return chunk[at + 8 : end] if end <= len(chunk) and end <= at + size else None


def _index_shard_fast(
    fd: int, headers: dict[tuple[str, str], bytes] | None = None
) -> list[tuple[str, dict[str, tuple[int, int]]]] | None:
    """``index_shard`` for plain ustar/v7 tars (what ``webdataset.TarWriter`` writes for short ASCII names).

    Reads the header blocks with ``os.pread`` (``_TAR_CHUNK`` bytes at a time, so a small member's data
    and the next header come with one read). Returns None on anything it does not parse itself (pax or GNU
    long-name headers, base-256 sizes, non-ASCII names, bad checksums), so the caller can use ``tarfile``.
    ``headers``: filled with (key, extension) -> the JSON header of each ``.safetensors`` member that came
    with the read of its tar header (unchecked bytes).
    """
    samples: dict[str, dict[str, tuple[int, int]]] = {}
    file_size = os.fstat(fd).st_size
    chunk, chunk_start, offset = b"", 0, 0
    while offset + _TAR_BLOCK <= file_size:
        if not chunk_start <= offset <= chunk_start + len(chunk) - _TAR_BLOCK:
            chunk, chunk_start = os.pread(fd, _TAR_CHUNK, offset), offset
            if len(chunk) < _TAR_BLOCK:
                return None
        at = offset - chunk_start
        block = chunk[at : at + _TAR_BLOCK]
        if block.count(0) == _TAR_BLOCK:  # end-of-archive marker
            break
        try:  # what tarfile writes: zero-padded octal digits, then NUL (and a space after the checksum)
            size, checksum = int(block[124:135], 8), int(block[148:154], 8)
        except ValueError:
            size, checksum = _tar_size(block[124:136]), _tar_size(block[148:156])  # type: ignore[assignment]
        # the checksum is the byte sum with its own field as spaces (adler32 sums in C: compare modulo 65521)
        if checksum is None:
            return None
        if (1 + checksum + sum(block[148:156]) - 8 * 0x20) % 65521 != zlib.adler32(block) & 0xFFFF:
            return None
        typeflag = block[156:157]
        if size is None or typeflag not in (b"0", b"\0", b"5"):
            return None
        name = block[:100].split(b"\0", 1)[0]
        if block[345]:  # a ustar name prefix (tarfile reads it whatever the magic says)
            name = block[345:500].split(b"\0", 1)[0] + b"/" + name
        if not name.isascii():
            return None
        data = offset + _TAR_BLOCK
        if typeflag != b"5" and not name.endswith(b"/"):  # a v7 directory: a name ending in "/"
            dirname, _, basename = name.decode().rpartition("/")
            key, dot, ext = basename.partition(".")
            if dot:
                key = f"{dirname}/{key}" if dirname else key
                samples.setdefault(key, {})[ext] = (data, size)
                if headers is not None and ext.endswith(".safetensors") and size >= 8:
                    header = _st_header(chunk, at + _TAR_BLOCK, size)
                    if header is None and chunk_start != offset:  # cut by the chunk's end: read from here
                        chunk, chunk_start = os.pread(fd, _TAR_CHUNK, offset), offset
                        header = _st_header(chunk, _TAR_BLOCK, size)
                    if header is not None:
                        headers[key, ext] = header
        offset = data + -(-size // _TAR_BLOCK) * _TAR_BLOCK
    return list(samples.items())


def _index_shard_tarfile(path: Path) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """``index_shard`` through ``tarfile``: every tar dialect it reads (pax, GNU long names, ...)."""
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


def index_shard(
    path: Path, headers: dict[tuple[str, str], bytes] | None = None
) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """List (key, {extension: (offset, size)}) per sample of an uncompressed tar, reading headers only.

    Plain ustar headers are parsed directly from ``os.pread`` blocks; any other tar dialect goes through
    ``tarfile`` (same result, slower). ``headers``: see ``_index_shard_fast`` (left empty by ``tarfile``).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        samples = _index_shard_fast(fd, headers)
    finally:
        os.close(fd)
    if samples is None:
        if headers is not None:
            headers.clear()
        samples = _index_shard_tarfile(path)
    return samples
