"""Tar-level shard code: the bytes of our webdataset tars' member headers, the one walker of a tar's members
and the one rule that groups them into samples, and safetensors headers.

Every shard is an uncompressed tar as ``webdataset.TarWriter`` writes it. This module knows that format and
nothing above it: no unit records, manifests or index files. Every reader of samples goes through
:func:`tar_members` (the walker: plain ustar headers parsed directly, a few times faster than ``tarfile``,
anything else through ``tarfile`` with the same result) and :func:`group_samples` (webdataset's grouping
rule): ``read_shard`` (the stages), ``index_shard`` (the shard index writer of
``latentmill.stages.shardindex``, which the trainer, ``verify`` and compaction read) and the shard writer of
``latentmill.stages.shardio``, which groups what it wrote by the same rule to index it. It imports nothing
from the repository but ``remotetars`` (a tar a work folder left on its store is fetched where the walker
opens it), so the trainer's readers and every stage can use it.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

from latentmill.stages.remotetars import local_tar

# ---------------------------------------------------------------------------------------------------------
# Writing: a member's header, a sample's size in a tar
# ---------------------------------------------------------------------------------------------------------

_TAR_USER = "latentmill"
_TAR_MODE = 0o444  # the members' mode (webdataset.TarWriter's default)
_TAR_NAME_MAX = 100  # a ustar name field; a longer (or non-ASCII) name goes into a pax header
TAR_BLOCK = 512  # a tar's headers and data padding are in blocks of this many bytes
_tar_template: bytearray | None = None  # a plain member header of our tars, name and size left to fill


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    """A member of our tars as ``webdataset.TarWriter(user=group=_TAR_USER, mtime=0)`` describes it."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, _TAR_MODE, _TAR_USER, _TAR_USER
    return info


def tar_member_header(name: str, size: int) -> bytes:
    """The header blocks ``tarfile`` writes for one member of our tars (``TarFile.addfile`` in its default
    pax format, as ``webdataset.TarWriter`` calls it), byte for byte.

    For a short ASCII name (every key and extension this repository writes) the header is one ustar block
    that differs from member to member only in its name, size and checksum fields: those are filled into a
    template that ``tarfile`` made, which costs far less than ``TarInfo.tobuf``. Any other name (or a size of
    8 GiB and more) goes through ``tobuf`` itself (pax extended header first)."""
    global _tar_template
    if not (len(name) <= _TAR_NAME_MAX and name.isascii() and 0 <= size < 8 ** 11):
        return _tar_info(name, size).tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
    if _tar_template is None:
        _tar_template = bytearray(_tar_info("", 0).tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape"))
    block = bytearray(_tar_template)
    encoded = name.encode("ascii")
    block[0:len(encoded)] = encoded
    block[124:136] = b"%011o\0" % size
    block[148:156] = b"        "  # the checksum sums the header with its own field as spaces
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block)


def tar_bytes(sample: dict[str, Any]) -> int:
    """The bytes ``sample`` takes in a tar: a 512-byte header per member and its data padded to 512."""
    return sum(TAR_BLOCK + -(-len(v) // TAR_BLOCK) * TAR_BLOCK for k, v in sample.items()
               if not k.startswith("__") and isinstance(v, (bytes, bytearray, memoryview)))


# ---------------------------------------------------------------------------------------------------------
# Reading: the one member walker and the one rule that groups members into samples
# ---------------------------------------------------------------------------------------------------------

# (name, data offset, size) of one regular file of a tar
TarMember = tuple[str, int, int]
# (key, {extension: (data offset, size)}) per sample of a tar, in tar order
TarSamples = list[tuple[str, dict[str, tuple[int, int]]]]
_TAR_CHUNK = 4096  # bytes read per header pread: small members' data and the next headers come along
_MEMBER_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext, corners included


def split_member(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name as webdataset splits it (``base_plus_ext``): the key is the name
    up to the first dot of its basename (the folder kept), the extension the rest, as written (webdataset's
    reader lowercases it by default); None for a name it does not split (no dot in the basename)."""
    match = _MEMBER_NAME.match(name)
    return (match.group(1), match.group(2)) if match else None


def group_samples(members: Iterable[tuple[str, Any]], where: str = "tar") -> Iterator[tuple[str, dict[str, Any]]]:
    """The samples of a tar's regular files ``(name, value)`` in tar order, as webdataset groups them:
    consecutive members of one key (:func:`split_member`) make one sample, ``{extension: value}``; a name
    without an extension is skipped. A key that comes back later starts another sample; an extension twice
    in one sample raises ``ValueError`` naming ``where`` (webdataset refuses it too)."""
    key: str | None = None
    sample: dict[str, Any] = {}
    for name, value in members:
        split = split_member(name)
        if split is None:
            continue
        if split[0] != key:
            if key is not None:
                yield key, sample
            key, sample = split[0], {}
        if split[1] in sample:
            raise ValueError(f"{where}: member {name!r} repeats extension {split[1]!r} of sample {key!r}")
        sample[split[1]] = value
    if key is not None:
        yield key, sample


def tar_members(path: str | Path) -> list[TarMember]:
    """``(name, data offset, size)`` of every regular file of an uncompressed tar, in order, as ``tarfile``
    lists them (``member.isfile()``): the one walker of the tar format that every reader of samples uses.

    A plain ustar tar (every tar this repository writes) is parsed from its header blocks directly
    (``os.pread``, a few times faster than ``tarfile``); anything else (pax or GNU headers, non-ASCII
    names, base-256 sizes, damage, no end-of-archive block) goes through ``tarfile``, with the same result. A
    tar that a work folder left on its object store is downloaded first (``remotetars.local_tar``)."""
    path = local_tar(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        members = _ustar_members(fd)
    finally:
        os.close(fd)
    if members is not None:
        return members
    with tarfile.open(path, "r:") as tar:  # uncompressed only: a compressed member has no offset to read at
        return [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]


def index_shard(path: str | Path) -> TarSamples:
    """``(key, {extension: (data offset, size)})`` per sample of an uncompressed tar, in tar order, from its
    headers alone (:func:`tar_members` grouped by :func:`group_samples`)."""
    return list(group_samples(((name, (offset, size)) for name, offset, size in tar_members(path)), str(path)))


def read_shard(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the samples of a webdataset tar as ``{"__key__": key, ext: bytes, ...}``, in file order
    (:func:`index_shard`, then each sample's members read as it is yielded). A compressed tar, whose members
    have no offsets to read at, is streamed through ``tarfile`` under the same grouping rule."""
    try:
        samples = index_shard(path)
    except tarfile.ReadError:
        with tarfile.open(path, "r") as tar:  # compressed (or not a tar: this raises again)
            files = ((m.name, m) for m in tar if m.isfile())
            for key, members in group_samples(files, str(path)):
                yield {"__key__": key, **{ext: tar.extractfile(m).read() for ext, m in members.items()}}
        return
    with open(path, "rb") as fh:
        for key, members in samples:
            sample: dict[str, Any] = {"__key__": key}
            for ext, (offset, size) in members.items():
                sample[ext] = data = os.pread(fh.fileno(), size, offset)
                if len(data) != size:
                    raise ValueError(f"{path}: member {key}.{ext} ends past the file ({len(data)} of {size} bytes)")
            yield sample


def _ustar_header(block: bytes) -> tuple[bytes, int, bytes] | None:
    """``(name, size, typeflag)`` of one plain ustar/v7 header block (a regular file or a directory), or None
    for what the fast tar readers leave to ``tarfile``: pax or GNU headers and other member types, base-256
    sizes, a bad checksum, a non-ASCII name."""
    try:  # what tarfile writes: zero-padded octal digits, then NUL (and a space after the checksum)
        size, checksum = int(block[124:135], 8), int(block[148:154], 8)
    except ValueError:
        size, checksum = _tar_size(block[124:136]), _tar_size(block[148:156])  # type: ignore[assignment]
    if size is None or checksum is None:
        return None
    # the checksum is the byte sum with its own field as spaces (adler32 sums in C: compare modulo 65521)
    if (1 + checksum + sum(block[148:156]) - 8 * 0x20) % 65521 != zlib.adler32(block) & 0xFFFF:
        return None
    typeflag = block[156:157]
    if typeflag not in (b"0", b"\0", b"5"):
        return None
    name = block[:100].split(b"\0", 1)[0]
    if block[345]:  # a ustar name prefix (tarfile reads it whatever the magic says)
        name = block[345:500].split(b"\0", 1)[0] + b"/" + name
    if not name.isascii():
        return None
    return name, size, typeflag


def _ustar_members(fd: int) -> list[TarMember] | None:
    """:func:`tar_members` of a plain ustar/v7 tar, from its header blocks alone (``os.pread``, ``_TAR_CHUNK``
    bytes at a time). None for anything this does not read exactly as ``tarfile`` does: pax or GNU headers, other
    member types, non-ASCII names, base-256 sizes, bad checksums, a member that passes the file's end, no
    end-of-archive block (a compressed, truncated or damaged file)."""
    files: list[TarMember] = []
    file_size = os.fstat(fd).st_size
    chunk, chunk_start, offset = b"", 0, 0
    while True:
        if offset + TAR_BLOCK > file_size:
            return None  # no end-of-archive block: tarfile decides what a short file is
        if not chunk_start <= offset <= chunk_start + len(chunk) - TAR_BLOCK:
            chunk, chunk_start = os.pread(fd, _TAR_CHUNK, offset), offset
            if len(chunk) < TAR_BLOCK:
                return None
        at = offset - chunk_start
        block = chunk[at : at + TAR_BLOCK]
        if block.count(0) == TAR_BLOCK:  # end-of-archive marker
            return files
        header = _ustar_header(block)
        if header is None:
            return None
        name, size, typeflag = header
        data = offset + TAR_BLOCK
        if data + size > file_size:
            return None
        if typeflag == b"0" or (typeflag == b"\0" and not name.endswith(b"/")):  # tarfile: AREGTYPE "x/" is a dir
            files.append((name.decode(), data, size))
        elif size:  # a directory with data: tarfile would not skip it
            return None
        offset = data + -(-size // TAR_BLOCK) * TAR_BLOCK


# ---------------------------------------------------------------------------------------------------------
# Safetensors headers (no tensor data is read)
# ---------------------------------------------------------------------------------------------------------

# safetensors dtype names -> bytes per element (the dtypes torch can hold; the cache stage writes BF16/F16/F32)
SAFETENSORS_ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
HEADER_READ = 4096  # bytes read at a member's start: its safetensors header (typically < 300 bytes) fits
MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header

# One tensor of a safetensors member: (name, dtype name, shape, payload begin, end), bytes from the member's start
TensorEntry = tuple[str, str, tuple[int, ...], int, int]


class HeaderError(ValueError):
    """A safetensors header that does not describe a valid member (the caller adds shard and key)."""


def safetensors_entries(header: bytes) -> tuple[list[TensorEntry], int]:
    """Parse and check the JSON header of a safetensors member (the bytes after its 8-byte length).

    Returns its tensors in header order, each with its payload's byte range from the member's start, and
    the whole member's size (8 + header + payloads). Checks what ``safetensors.torch.load`` checks: known
    dtypes, integer shapes, each tensor's byte range as long as its shape and dtype say, the ranges back to
    back from 0 in offset order. Raises ``HeaderError``.
    """
    try:
        entries = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeaderError(f"safetensors header is not JSON ({err})") from None
    if not isinstance(entries, dict):
        raise HeaderError("safetensors header is not a JSON object")
    tensors: list[TensorEntry] = []
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise HeaderError(f"tensor {name!r}: entry is not an object")
        itemsize = SAFETENSORS_ITEMSIZE.get(entry.get("dtype"))  # type: ignore[arg-type]
        if itemsize is None:
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
        if end - begin != numel * itemsize or begin < 0:
            raise HeaderError(
                f"tensor {name!r}: data_offsets {offsets} hold {end - begin} bytes, "
                f"{entry['dtype']} {shape} needs {numel * itemsize}"
            )
        tensors.append((name, entry["dtype"], tuple(shape), begin, end))
    position = 0
    for name, _, _, begin, end in sorted(tensors, key=lambda t: (t[3], t[4])):
        if begin != position:
            raise HeaderError(f"tensor {name!r}: data_offsets start at {begin}, expected {position}")
        position = end
    start = 8 + len(header)
    return [(name, dtype, shape, start + b, start + e) for name, dtype, shape, b, e in tensors], start + position


def _tar_size(field: bytes) -> int | None:
    """A ustar numeric field (octal ASCII); None for anything else (base-256, garbage)."""
    if field[0] & 0x80:  # base-256: left to tarfile
        return None
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return None
