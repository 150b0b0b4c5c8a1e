"""Shard I/O shared by every stage: deterministic webdataset tars, atomic commits, unit records, manifests.

Layout of one stage under ``<output_dir>/prep/<stage>/``::

    shards/<stage>-<unit id>-<part>.tar   webdataset tars, written as .tmp and renamed when complete
    units/<unit id>.json                  what one work unit produced (shards, quarantine), written last
    manifest.json                         the stage's current output: every shard, counts, fingerprint
    quarantine.jsonl                      every sample the stage refused, with the reason

A work unit's id is the hash of its inputs' content and the stage fingerprint (contract 1), so a unit
whose record exists is done: re-running reuses it, and a killed run resumes at the first missing unit.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import tarfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from latentmill.stages.hashing import json_bytes, sha256_bytes, sha256_file, stable_hash
from latentmill.stages.memory import release_memory

FORMAT_VERSION = 1
_TAR_USER = "latentmill"


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(json.dumps(obj, sort_keys=True, indent=1).encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# Reading and writing one shard
# ---------------------------------------------------------------------------------------------------------


_TAR_MODE = 0o444  # the members' mode (webdataset.TarWriter's default)
_TAR_NAME_MAX = 100  # a ustar name field; a longer (or non-ASCII) name goes into a pax header
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
    template that ``tarfile`` made, about 10x faster than ``TarInfo.tobuf``. Any other name (or a size of
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


class _ShardSink:
    """Writes samples into ``path`` through a temporary file; ``commit`` renames it into place.

    The tar is what ``webdataset.TarWriter(user=group=_TAR_USER, mtime=0, encoder=False)`` writes over a
    ``tarfile`` stream, byte for byte (tests/test_shardio.py compares them): per sample its members in sorted
    extension order, each a header (:func:`tar_member_header`) and its data padded to 512 bytes; at the end
    two zero blocks, then zeros to a multiple of 10 KiB. Written here directly: the stream and ``TarFile``
    layers cost more than the header itself. mtime 0 and a fixed owner make the bytes a pure function of the
    samples; written front to back, hashing the writes hashes the file. Where each member's data lands is
    known as it is written, so the shard index is built from it too (:func:`index_tar` reads it back only for
    names it would not parse the same way).
    """

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self._fh = open(self.tmp, "wb")
        self._sha = hashlib.sha256()
        self._offset = 0  # bytes written
        self.count = 0
        self.size = 2 * _TAR_BLOCK  # the tar's bytes once closed (before its last record is padded)
        self.index: dict[str, Any] | None = None  # the index's manifest entry, set by ``commit``
        # the index as index_shard / index_tar would read it back (None: read it back)
        self._samples: dict[str, dict[str, tuple[int, int]]] | None = {}
        self._st_headers: dict[tuple[str, str], bytes] = {}
        self._json: dict[str, bytes] = {}  # key -> its (last) json member, for its bucket

    def _put(self, data: bytes) -> None:
        self._sha.update(data)
        self._fh.write(data)
        self._offset += len(data)

    def write(self, sample: dict[str, Any]) -> None:
        if "__key__" not in sample:
            raise ValueError("object must contain a __key__")
        for k, v in sample.items():
            if k[0] != "_" and not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} doesn't map to a bytes after encoding ({type(v)})")
        key = sample["__key__"]
        for ext in sorted(sample):
            if ext[0] == "_":  # __key__ and other metadata entries are not written
                continue
            data = sample[ext]
            name = f"{key}.{ext}"
            size = len(data)
            header = tar_member_header(name, size)
            self._put(header)
            data_at = self._offset
            self._put(data)
            if size % _TAR_BLOCK:
                self._put(bytes(_TAR_BLOCK - size % _TAR_BLOCK))
            self._remember(name, data_at, data, len(header) == _TAR_BLOCK)
        self.count += 1
        self.size += _tar_bytes(sample)

    def _remember(self, name: str, data_at: int, data: bytes, plain: bool) -> None:
        """Enter one member in the index as ``_index_shard_fast`` parses it back (the same rules)."""
        if self._samples is None:
            return
        if not plain or name.endswith("/"):  # a pax header, or a v7 directory's name: let index_tar read it
            self._samples = None
            return
        dirname, _, basename = name.rpartition("/")
        member_key, dot, ext = basename.partition(".")
        if not dot:
            return
        member_key = f"{dirname}/{member_key}" if dirname else member_key
        size = len(data)
        self._samples.setdefault(member_key, {})[ext] = (data_at, size)
        if ext == "json":
            self._json[member_key] = bytes(data)
        if ext.endswith(".safetensors") and size >= 8:
            length = int.from_bytes(bytes(data[:8]), "little")
            if 8 + length <= size and length <= MAX_HEADER:
                self._st_headers[member_key, ext] = bytes(data[8:8 + length])
            else:
                self._st_headers.pop((member_key, ext), None)

    def _finish_tar(self) -> None:
        """The end of the archive, as ``TarFile.close`` writes it: two zero blocks, then a full record."""
        self._put(bytes(2 * _TAR_BLOCK))
        if self._offset % tarfile.RECORDSIZE:
            self._put(bytes(tarfile.RECORDSIZE - self._offset % tarfile.RECORDSIZE))

    def commit(self) -> str:
        """Finish the tar, move it into place, write its index beside it (built from what was written, else
        ``index_tar``: from the tar's bytes, read back from the page cache); return the tar's sha256."""
        self._finish_tar()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if self._samples is not None:
            samples = list(self._samples.items())
            data = build_shard_index(self._offset, samples, self._st_headers,
                                     [_bucket_of(self._json[k]) if k in self._json else None for k, _ in samples])
        else:
            data = index_tar(self.tmp)
        os.replace(self.tmp, self.path)
        self.index = write_index_file(self.path, data)
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._fh.close()
        self.tmp.unlink(missing_ok=True)


def read_shard(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the samples of a webdataset tar as ``{"__key__": key, ext: bytes, ...}``, in file order.

    A plain ustar tar (every tar this repository writes) is read from its headers directly
    (:func:`_tar_files_fast`), a few times faster than ``tarfile``; any other (pax or GNU headers, non-ASCII
    names, compression, damage) goes through ``tarfile``. Both give the same samples."""
    with open(path, "rb") as fh:
        members = _tar_files_fast(fh.fileno())
        if members is None:
            yield from _read_shard_tarfile(path)
            return

        def reader(offset: int, size: int) -> Callable[[], bytes]:
            def read() -> bytes:
                fh.seek(offset)
                return fh.read(size)
            return read

        yield from _group_samples((name, reader(offset, size)) for name, offset, size in members)


def _read_shard_tarfile(path: str | Path) -> Iterator[dict[str, Any]]:
    """:func:`read_shard` through ``tarfile``: every tar dialect it reads."""
    with tarfile.open(path, "r") as tar:
        yield from _group_samples((member.name, lambda m=member: tar.extractfile(m).read())
                                  for member in tar if member.isfile())


def _group_samples(files: Iterable[tuple[str, Callable[[], bytes]]]) -> Iterator[dict[str, Any]]:
    """A tar's regular files ``(name, read)``, in order, as webdataset groups them: ``dir/key.ext`` is member
    ``ext`` of sample ``dir/key``, consecutive files of one key make one sample, a name without an extension
    is skipped (and not read)."""
    current: dict[str, Any] | None = None
    for name, read in files:
        base = os.path.basename(name)
        if "." not in base:
            continue
        prefix, ext = base.split(".", 1)
        key = os.path.join(os.path.dirname(name), prefix)
        data = read()
        if current is None or current["__key__"] != key:
            if current is not None:
                yield current
            current = {"__key__": key}
        current[ext] = data
    if current is not None:
        yield current


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


def _tar_files_fast(fd: int) -> list[tuple[str, int, int]] | None:
    """``(name, data offset, size)`` of every regular file of a plain ustar/v7 tar, in order, as ``tarfile``
    lists them (``member.isfile()``), from its header blocks alone (``os.pread``, ``_TAR_CHUNK`` bytes at a
    time). None for anything this does not read exactly as ``tarfile`` does: pax or GNU headers, other
    member types, non-ASCII names, base-256 sizes, bad checksums, a member that passes the file's end, no
    end-of-archive block (a compressed, truncated or damaged file)."""
    files: list[tuple[str, int, int]] = []
    file_size = os.fstat(fd).st_size
    chunk, chunk_start, offset = b"", 0, 0
    while True:
        if offset + _TAR_BLOCK > file_size:
            return None  # no end-of-archive block: tarfile decides what a short file is
        if not chunk_start <= offset <= chunk_start + len(chunk) - _TAR_BLOCK:
            chunk, chunk_start = os.pread(fd, _TAR_CHUNK, offset), offset
            if len(chunk) < _TAR_BLOCK:
                return None
        at = offset - chunk_start
        block = chunk[at : at + _TAR_BLOCK]
        if block.count(0) == _TAR_BLOCK:  # end-of-archive marker
            return files
        header = _ustar_header(block)
        if header is None:
            return None
        name, size, typeflag = header
        data = offset + _TAR_BLOCK
        if data + size > file_size:
            return None
        if typeflag == b"0" or (typeflag == b"\0" and not name.endswith(b"/")):  # tarfile: AREGTYPE "x/" is a dir
            files.append((name.decode(), data, size))
        elif size:  # a directory with data: tarfile would not skip it
            return None
        offset = data + -(-size // _TAR_BLOCK) * _TAR_BLOCK


# ---------------------------------------------------------------------------------------------------------
# Tar header scan and safetensors headers (no tensor data is read)
# ---------------------------------------------------------------------------------------------------------

# safetensors dtype names -> bytes per element (the dtypes torch can hold; the cache stage writes BF16/F16/F32)
SAFETENSORS_ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
HEADER_READ = 4096  # bytes read at a member's start: its safetensors header (typically < 300 bytes) fits
MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header
_TAR_BLOCK = 512
_TAR_CHUNK = 4096  # bytes read per tar index pread: small members' data and the next headers come along

# One tensor of a safetensors member: (name, dtype name, shape, payload begin, end), bytes from the member's start
TensorEntry = tuple[str, str, tuple[int, ...], int, int]
# (key, {extension: (data offset, size)}) per sample of a tar, in tar order
TarSamples = list[tuple[str, dict[str, tuple[int, int]]]]


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


def _st_header(chunk: bytes, at: int, size: int) -> bytes | None:
    """The JSON header of the safetensors member of ``size`` bytes at ``chunk[at:]``; None if cut off."""
    if at + 8 > len(chunk):
        return None
    end = at + 8 + int.from_bytes(chunk[at : at + 8], "little")
    return chunk[at + 8 : end] if end <= len(chunk) and end <= at + size else None


def _index_shard_fast(fd: int, headers: dict[tuple[str, str], bytes] | None = None) -> TarSamples | None:
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
        header = _ustar_header(block)
        if header is None:
            return None
        name, size, typeflag = header
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


def _index_shard_tarfile(path: Path) -> TarSamples:
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


def index_shard(path: Path, headers: dict[tuple[str, str], bytes] | None = None) -> TarSamples:
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


# ---------------------------------------------------------------------------------------------------------
# Shard indexes: ``<shard>.idx`` beside each tar (docs/cache-format.md, "Shard index")
# ---------------------------------------------------------------------------------------------------------

INDEX_SUFFIX = ".idx"
INDEX_VERSION = 1
INDEX_METADATA_KEY = "latentmill.shard_index"
# The index's columns: name -> (safetensors dtype, numpy dtype), in the order their bytes are stored
# (8-byte columns first, so every column starts aligned when the header is padded to 8 bytes).
INDEX_COLUMNS: dict[str, tuple[str, str]] = {
    "member_offset": ("I64", "<i8"),  # per member: byte offset of its data in the tar
    "member_size": ("I64", "<i8"),  # per member: its size in bytes
    "sample_member_end": ("I64", "<i8"),  # per sample: end of its members in the member columns (CSR)
    "sample_key_end": ("I64", "<i8"),  # per sample: end of its key in ``keys`` (UTF-8, back to back)
    "member_layout": ("I32", "<i4"),  # per member: its safetensors layout in ``layouts``; -1: none
    "member_name": ("I32", "<i4"),  # per member: its extension in ``names``
    "sample_bucket": ("I32", "<i4"),  # per sample: its bucket in ``buckets``; -1: none
    "keys": ("U8", "u1"),
}


class ShardIndexError(ValueError):
    """An index file that cannot be read or does not describe its tar."""


def index_path(tar_path: str | Path) -> Path:
    """Where the index of the shard at ``tar_path`` lives: beside it, ``<name>.idx`` for ``<name>.tar``."""
    tar_path = Path(tar_path)
    return tar_path.with_name(tar_path.name.removesuffix(".tar") + INDEX_SUFFIX)


def _bucket_of(meta_bytes_: bytes) -> list[int] | None:
    """The ``bucket`` of a sample's ``json`` member (a list of ints), or None."""
    if b"bucket" not in meta_bytes_ and b"\\u" not in meta_bytes_:  # no such key, even escaped: no parse
        return None
    try:
        bucket = json.loads(meta_bytes_).get("bucket")
    except (ValueError, AttributeError):
        return None
    if isinstance(bucket, list) and bucket and all(type(d) is int for d in bucket):
        return bucket
    return None


def build_shard_index(
    tar_size: int,
    samples: TarSamples,
    headers: dict[tuple[str, str], bytes],
    buckets: list[list[int] | None],
) -> bytes:
    """The bytes of a shard index (the index writer): a pure function of its arguments.

    ``samples``: (key, {extension: (data offset, size)}) in tar order (``index_shard``); ``headers``: the
    JSON header of each ``.safetensors`` member (a missing or invalid one gets no layout: the loader then
    reads and checks that member's header itself, and names what is wrong with it); ``buckets``: per
    sample, its bucket or None. Names, buckets and layouts are numbered in order of first appearance.
    """
    import numpy as np

    if len(buckets) != len(samples):
        raise ValueError(f"{len(buckets)} buckets for {len(samples)} samples")
    names: dict[str, int] = {}
    bucket_ids: dict[tuple[int, ...], int] = {}
    layouts: dict[str, int] = {}  # canonical JSON of a layout -> its id
    layout_sizes: list[int] = []  # per layout id: the member size it describes
    by_header: dict[bytes, int] = {}  # a header's bytes -> its layout id (-1: invalid)
    offsets, sizes, member_names, member_layouts, member_ends, key_ends, sample_buckets = ([] for _ in range(7))
    keys = bytearray()
    for (key, members), bucket in zip(samples, buckets):
        for ext, (offset, size) in members.items():
            offsets.append(offset)
            sizes.append(size)
            member_names.append(names.setdefault(ext, len(names)))
            layout = -1
            header = headers.get((key, ext)) if ext.endswith(".safetensors") else None
            if header is not None:
                layout = by_header.get(header, -2)
                if layout == -2:
                    try:
                        tensors, total = safetensors_entries(header)
                        text = json_bytes({"size": total, "tensors": [list(t) for t in tensors]}).decode()
                        layout = layouts.setdefault(text, len(layouts))
                        if layout == len(layout_sizes):
                            layout_sizes.append(total)
                    except HeaderError:
                        layout = -1
                    by_header[header] = layout
                if layout >= 0 and layout_sizes[layout] != size:
                    layout = -1  # the header describes another size: the loader checks it and says so
            member_layouts.append(layout)
        member_ends.append(len(offsets))
        keys += key.encode()
        key_ends.append(len(keys))
        sample_buckets.append(-1 if bucket is None else bucket_ids.setdefault(tuple(bucket), len(bucket_ids)))
    values = {
        "member_offset": offsets, "member_size": sizes, "sample_member_end": member_ends,
        "sample_key_end": key_ends, "member_layout": member_layouts, "member_name": member_names,
        "sample_bucket": sample_buckets, "keys": keys,
    }
    tables = {
        "version": INDEX_VERSION,
        "tar_size": int(tar_size),
        "samples": len(samples),
        "members": len(offsets),
        "names": list(names),
        "buckets": [list(b) for b in bucket_ids],
        "layouts": [json.loads(text) for text in layouts],
    }
    header: dict[str, Any] = {"__metadata__": {INDEX_METADATA_KEY: json_bytes(tables).decode()}}
    blobs, position = [], 0
    for name, (st_dtype, np_dtype) in INDEX_COLUMNS.items():
        column = values[name]
        blob = bytes(column) if name == "keys" else np.asarray(column, dtype=np_dtype).tobytes()
        header[name] = {"dtype": st_dtype, "shape": [len(column)], "data_offsets": [position, position + len(blob)]}
        blobs.append(blob)
        position += len(blob)
    head = json_bytes(header)
    head += b" " * (-len(head) % 8)  # columns start 8-byte aligned
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def index_tar(path: str | Path) -> bytes:
    """The index of the tar at ``path``, from its bytes alone: the tar's headers, the safetensors headers of
    its ``.safetensors`` members and the ``bucket`` field of each sample's ``json`` member."""
    path = Path(path)
    headers: dict[tuple[str, str], bytes] = {}
    samples = index_shard(path, headers)
    fd = os.open(path, os.O_RDONLY)
    try:
        tar_size = os.fstat(fd).st_size
        buckets: list[list[int] | None] = []
        for key, members in samples:
            for ext, (offset, size) in members.items():
                if ext.endswith(".safetensors") and (key, ext) not in headers and size >= 8:
                    length = int.from_bytes(os.pread(fd, 8, offset), "little")
                    if 8 + length <= size and length <= MAX_HEADER:
                        headers[key, ext] = os.pread(fd, length, offset + 8)
            meta = members.get("json")
            buckets.append(_bucket_of(os.pread(fd, meta[1], meta[0])) if meta is not None else None)
    finally:
        os.close(fd)
    return build_shard_index(tar_size, samples, headers, buckets)


def write_index_file(tar_path: str | Path, data: bytes | None = None) -> dict[str, Any]:
    """Write the index of the tar at ``tar_path`` beside it, atomically (``index_tar`` unless ``data`` is
    given); return its manifest entry ``{"name", "size", "sha256"}``."""
    path = index_path(tar_path)
    data = index_tar(tar_path) if data is None else data
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return {"name": path.name, "size": len(data), "sha256": sha256_bytes(data)}


@dataclass
class ShardIndex:
    """A parsed shard index: its columns (numpy arrays over the file's bytes) and tables."""

    tar_size: int
    names: list[str]
    buckets: list[list[int]]
    layouts: list[dict[str, Any]]  # {"size": member bytes, "tensors": [[name, dtype, shape, begin, end]]}
    columns: dict[str, Any]

    @property
    def num_samples(self) -> int:
        return len(self.columns["sample_key_end"])

    def key(self, i: int) -> str:
        ends = self.columns["sample_key_end"]
        return self.columns["keys"][ends[i - 1] if i else 0 : ends[i]].tobytes().decode()

    def members(self, i: int) -> dict[str, tuple[int, int]]:
        """Extension -> (data offset, size) of sample ``i``'s members, in tar order."""
        c = self.columns
        start = int(c["sample_member_end"][i - 1]) if i else 0
        end = int(c["sample_member_end"][i])
        names, offsets, sizes = c["member_name"], c["member_offset"], c["member_size"]
        return {self.names[names[m]]: (int(offsets[m]), int(sizes[m])) for m in range(start, end)}

    def samples(self) -> TarSamples:
        """(key, members) of every sample, as ``index_shard`` lists them."""
        return [(self.key(i), self.members(i)) for i in range(self.num_samples)]


def read_shard_index(data: bytes, where: str = "index") -> ShardIndex:
    """Parse and check the bytes of a shard index (``where`` names it in errors: ``ShardIndexError``).

    Checks what a reader relies on, vectorised (no per-sample Python): the columns' dtypes and lengths,
    monotone CSR ends, table ids in range, every member inside the tar, each layout's size equal to its
    member's size.
    """
    import numpy as np

    def fail(why: str) -> ShardIndexError:
        return ShardIndexError(f"{where}: {why}")

    if len(data) < 8:
        raise fail(f"{len(data)} bytes, too short for an index")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise fail(f"header length {n} runs past the file's {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + n])
        tables = json.loads(header["__metadata__"][INDEX_METADATA_KEY])
        if tables["version"] != INDEX_VERSION:
            raise fail(f"index version {tables['version']!r}, this reader reads {INDEX_VERSION}")
        samples, members = int(tables["samples"]), int(tables["members"])
        names, buckets, layouts = list(tables["names"]), list(tables["buckets"]), list(tables["layouts"])
        tar_size = int(tables["tar_size"])
    except ShardIndexError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise fail(f"not a shard index ({type(err).__name__}: {err})") from None
    body = memoryview(data)[8 + n :]
    columns: dict[str, Any] = {}
    expected = {"member": members, "sample": samples}
    for name, (st_dtype, np_dtype) in INDEX_COLUMNS.items():
        entry = header.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") != st_dtype:
            raise fail(f"column {name!r} missing or not {st_dtype}")
        begin, end = entry["data_offsets"]
        itemsize = np.dtype(np_dtype).itemsize
        if not 0 <= begin <= end <= len(body) or (end - begin) % itemsize:
            raise fail(f"column {name!r}: byte range {begin}..{end} outside the file")
        column = np.frombuffer(body[begin:end], dtype=np_dtype)
        want = expected.get(name.split("_", 1)[0])
        if want is not None and len(column) != want:
            raise fail(f"column {name!r} holds {len(column)} values, expected {want}")
        columns[name] = column
    c = columns
    for ends, total, what in ((c["sample_member_end"], members, "member"), (c["sample_key_end"], len(c["keys"]), "key")):
        # every sample holds a member and a key: strictly increasing ends
        if samples and (ends[0] <= 0 or ends[-1] != total or (samples > 1 and bool((ends[1:] <= ends[:-1]).any()))):
            raise fail(f"sample {what} ends are not increasing up to {total}")
    if not samples and members:
        raise fail(f"{members} members and no sample")
    if members:
        if c["member_name"].min() < 0 or c["member_name"].max() >= len(names):
            raise fail("a member name id is out of range")
        if c["member_layout"].min() < -1 or c["member_layout"].max() >= len(layouts):
            raise fail("a member layout id is out of range")
        ends = c["member_offset"] + c["member_size"]
        if c["member_offset"].min() < 0 or c["member_size"].min() < 0 or ends.max() > tar_size:
            raise fail(f"a member lies outside the tar's {tar_size} bytes")
        has = c["member_layout"] >= 0
        if has.any():
            layout_sizes = np.array([int(entry["size"]) for entry in layouts], dtype=np.int64)
            if bool((layout_sizes[c["member_layout"][has]] != c["member_size"][has]).any()):
                raise fail("a safetensors layout's size differs from its member's size")
    if samples and (c["sample_bucket"].min() < -1 or c["sample_bucket"].max() >= len(buckets)):
        raise fail("a sample bucket id is out of range")
    return ShardIndex(tar_size, names, buckets, layouts, columns)


def load_shard_index(tar_path: str | Path, entry: dict[str, Any] | None = None) -> ShardIndex:
    """Read and check the index of the tar at ``tar_path``; with its manifest ``entry`` (``{"name", "size",
    "sha256"}``) also its name and size (the sha256 is checked by ``verify_index``). ``ShardIndexError``
    names the shard and says what to do."""
    path = index_path(tar_path) if entry is None else Path(tar_path).with_name(entry["name"])
    fix = ("re-run the prep: it rewrites a missing or damaged index from its tar, without re-encoding "
           "(or train on a manifest of format 2, which scans the tars)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ShardIndexError(f"{tar_path}: its index {path} cannot be read ({err.strerror or err}); {fix}") from None
    if entry is not None and entry.get("size") is not None and len(data) != entry["size"]:
        raise ShardIndexError(
            f"{tar_path}: its index {path} holds {len(data)} bytes, the manifest says {entry['size']}; {fix}")
    try:
        return read_shard_index(data, f"{tar_path}: its index {path}")
    except ShardIndexError as err:
        raise ShardIndexError(f"{err}; {fix}") from None


def verify_index(tar_path: str | Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with the index of a shard against its manifest ``entry["index"]`` (name, size, sha256),
    or None when it matches (also None for an entry without an index: format 2)."""
    index = entry.get("index")
    if not index:
        return None
    path = Path(tar_path).with_name(index["name"])
    if not path.is_file():
        return f"{tar_path}: its index {path} is missing"
    if sha256_file(path) != index["sha256"]:
        return f"{tar_path}: its index {path}: sha256 differs from the manifest"
    return None


# ---------------------------------------------------------------------------------------------------------
# Work units
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ShardInfo:
    """One committed output shard."""

    name: str
    path: str  # relative to the stage directory
    sha256: str
    samples: int
    bucket: list[int] | None = None  # the bucket of every sample; null for a shard of several buckets
    index: dict[str, Any] | None = None  # the shard index beside the tar: {"name", "size", "sha256"}
    buckets: dict[str, int] | None = None  # samples per bucket ("WxHxF"), for a shard of several buckets


@dataclass
class UnitRecord:
    """What one work unit produced; its presence on disk means the unit is done."""

    unit_id: str
    stage: str
    inputs: list[str]
    shards: list[ShardInfo]
    quarantined: list[dict[str, Any]]
    samples_in: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    reused: bool = False

    @property
    def samples_out(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        """The record as written (``reused`` is not), sharing ``extra`` and ``quarantined`` with the record:
        ``dataclasses.asdict`` would deep-copy them (a curate record holds every sample's score keys) only
        for them to be encoded."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "reused"}
        data["shards"] = [asdict(shard) for shard in self.shards]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "UnitRecord":
        data = dict(data)
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        return cls(**data)


@dataclass
class WorkUnit:
    """A stage's unit of work: its id (content hash + fingerprint) and what it reads."""

    unit_id: str
    inputs: list[str]  # input identities (content hashes), for the record
    payload: dict[str, Any]  # stage-specific description: input shard paths, file lists, bucket...
    samples_in: int


_MIXED = "mixed"  # a shard's bucket once two samples of different buckets went into it


class UnitOutput:
    """Collects one unit's samples into shards (one per ``part``) and its quarantine entries.

    A unit planned by :func:`units_by_bytes` writes one shard per part, holding every bucket it meets (each
    sample's bucket is in its ``json`` and in the shard index; the shard's ``bucket`` is null when it holds
    several). A unit whose estimated output passes its byte target (one upstream shard larger than the
    target) gets ``payload["roll_bytes"]``: a part then continues in a new shard (``<part>-1``,
    ``<part>-2``...) before a sample that would take the current one past that many bytes (before the tar's
    last record is padded to 10 KiB). Where the cut falls
    depends only on the samples' bytes and order, so it is the same whichever runner wrote the unit.
    """

    def __init__(self, stage_dir: "StageDir", unit: WorkUnit):
        self.stage_dir = stage_dir
        self.unit = unit
        self._sinks: dict[tuple[str, int], _ShardSink] = {}
        self._open: dict[str, int] = {}  # part -> the number of its shard now written
        self._buckets: dict[tuple[str, int], Any] = {}
        self._counts: dict[tuple[str, int], dict[str, int]] = {}
        self.roll_bytes: int | None = unit.payload.get("roll_bytes")
        self.quarantined: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        if "upstream" in unit.payload:
            self.extra[GROUP_KEY] = list(unit.payload["upstream"])

    def add(self, sample: dict[str, Any], part: str = "0", bucket: list[int] | None = None) -> None:
        """Append ``sample`` to the shard ``part`` of this unit (e.g. one part per kind of sample)."""
        seq = self._open.get(part, 0)
        sink = self._sinks.get((part, seq))
        if sink is not None and self.roll_bytes and sink.count and \
                sink.size + _tar_bytes(sample) > self.roll_bytes:
            seq = self._open[part] = seq + 1
            sink = None
        if sink is None:
            suffix = part if seq == 0 else f"{part}-{seq}"
            name = f"{self.stage_dir.stage}-{self.unit.unit_id[:16]}-{suffix}.tar"
            sink = self._sinks[(part, seq)] = _ShardSink(self.stage_dir.shard_dir / name)
            self._buckets[(part, seq)] = bucket
            self._open[part] = seq
        elif self._buckets[(part, seq)] != bucket:
            self._buckets[(part, seq)] = _MIXED
        if bucket is not None:
            counts = self._counts.setdefault((part, seq), {})
            name = "x".join(map(str, bucket))
            counts[name] = counts.get(name, 0) + 1
        sink.write(sample)

    def quarantine(self, key: str, source: str, reason: str, **details: Any) -> None:
        """Refuse one sample, keeping where it came from and why (``details``: more JSON fields of the entry,
        e.g. the curate stage's ``scores`` or ``duplicate_of``)."""
        self.quarantined.append({"key": key, "source": source, "stage": self.stage_dir.stage, "reason": reason,
                                 **details})

    def commit(self, seconds: float) -> UnitRecord:
        shards = []
        for part in sorted(self._sinks):
            sink = self._sinks[part]
            digest = sink.commit()
            bucket = self._buckets[part]
            shards.append(
                ShardInfo(
                    name=sink.path.name,
                    path=f"shards/{sink.path.name}",
                    sha256=digest,
                    samples=sink.count,
                    bucket=None if bucket is _MIXED else bucket,
                    index=sink.index,
                    buckets=dict(sorted(self._counts[part].items())) if bucket is _MIXED else None,
                )
            )
        record = UnitRecord(
            unit_id=self.unit.unit_id,
            stage=self.stage_dir.stage,
            inputs=self.unit.inputs,
            shards=shards,
            quarantined=self.quarantined,
            samples_in=self.unit.samples_in,
            seconds=round(seconds, 4),
            extra=self.extra,
        )
        _write_json_atomic(self.stage_dir.unit_path(self.unit.unit_id), record.to_json())
        return record

    def abort(self) -> None:
        for sink in self._sinks.values():
            sink.abort()


class RecordIndex(abc.ABC):
    """What a stage keeps from every committed unit record of its folder (curate's scores, the cache's
    components, curate's embeddings), per process: :meth:`refresh` reads only the records not read before,
    when the ``units/`` folder changed, so units committed by earlier runs or other workers are found without
    re-reading every record for every unit. Subclasses say what to keep from one record
    (:meth:`read_record`)."""

    def __init__(self, stage_root: Path):
        self.root = stage_root
        self._seen: set[str] = set()
        self._mtime = -1

    @abc.abstractmethod
    def read_record(self, path: Path) -> None:
        """Keep what this index needs from the unit record at ``path`` (a damaged one is skipped)."""

    def refresh(self):
        units = self.root / "units"
        mtime = units.stat().st_mtime_ns if units.is_dir() else -1
        if mtime == self._mtime:
            return self
        self._mtime = mtime
        for path in sorted(units.glob("*.json")) if units.is_dir() else []:
            if path.name not in self._seen:
                self._seen.add(path.name)
                self.read_record(path)
        return self


class PerProcess:
    """One :class:`RecordIndex` per stage folder in this process: ``get`` returns it refreshed; ``release``
    forgets them all (their memory grows with the samples: the prep flow releases a stage's once the stage
    is done; a later run in the process reads the records again)."""

    def __init__(self, factory: Callable[[Path], RecordIndex]):
        self._factory = factory
        self._items: dict[str, RecordIndex] = {}
        self._lock = threading.Lock()

    def get(self, stage_root: Path):
        with self._lock:
            key = str(Path(stage_root).resolve())
            if key not in self._items:
                self._items[key] = self._factory(Path(stage_root))
            return self._items[key].refresh()

    def release(self) -> int:
        """Forget every index; returns how many there were."""
        with self._lock:
            count = len(self._items)
            self._items.clear()
        return count


class StageDir:
    """The directory of one stage: shards, unit records, manifest and quarantine list."""

    def __init__(self, root: str | Path, stage: str):
        self.stage = stage
        self.root = Path(root)
        self.shard_dir = self.root / "shards"
        self.unit_dir = self.root / "units"
        self.manifest_path = self.root / "manifest.json"
        self.quarantine_path = self.root / "quarantine.jsonl"

    def ensure(self) -> "StageDir":
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        return self

    def unit_path(self, unit_id: str) -> Path:
        return self.unit_dir / f"{unit_id}.json"

    def load_record(self, unit_id: str) -> UnitRecord | None:
        """The unit's record if the unit is complete (record present and every shard on disk)."""
        path = self.unit_path(unit_id)
        if not path.is_file():
            return None
        try:
            record = UnitRecord.from_json(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            return None
        if any(not (self.root / s.path).is_file() for s in record.shards):
            return None
        if not self._ensure_indexes(record):
            return None
        record.reused = True
        return record

    def _ensure_indexes(self, record: UnitRecord) -> bool:
        """Give every shard of a committed unit its index: a unit committed before indexes existed (cache
        format 2), or one whose index file is missing or damaged, gets it written from its tar (a header scan,
        nothing re-encoded) and its record rewritten. False when the rebuilt index differs from the one the
        record names: the tar changed since it was committed, and the unit must run again."""
        changed = False
        for shard in record.shards:
            tar = self.root / shard.path
            if shard.index is not None:
                path = tar.with_name(shard.index["name"])
                try:
                    if path.stat().st_size == shard.index["size"] and sha256_file(path) == shard.index["sha256"]:
                        continue
                except OSError:
                    pass
            entry = write_index_file(tar)
            if shard.index is not None and entry != shard.index:
                return False
            shard.index, changed = entry, True
        if changed:
            _write_json_atomic(self.unit_path(record.unit_id), record.to_json())
        return True

    def run_unit(self, unit: WorkUnit, process: Callable[[WorkUnit, UnitOutput], None]) -> UnitRecord:
        """Run ``process`` on ``unit`` unless an identical unit already committed; return its record."""
        record = self.load_record(unit.unit_id)
        if record is not None:
            return record
        self.ensure()
        out = UnitOutput(self, unit)
        start = time.perf_counter()
        try:
            process(unit, out)
        except BaseException:
            out.abort()
            raise
        finally:
            release_memory()
        return out.commit(time.perf_counter() - start)

    def write_manifest(self, records: list[UnitRecord], header: dict[str, Any]) -> dict[str, Any]:
        """Write the stage manifest (last, atomically) and the quarantine list; return the manifest."""
        self.ensure()
        records = sorted(records, key=lambda r: r.unit_id)
        shards = [{k: v for k, v in asdict(s).items() if k not in ("index", "buckets") or v is not None}
                  for r in records for s in r.shards]
        quarantined = [q for r in records for q in r.quarantined]
        expanded = sum(int(r.extra.get("expanded", 0)) for r in records)
        manifest = {
            "stage": self.stage,
            "format_version": FORMAT_VERSION,
            **header,
            "shards": sorted(shards, key=lambda s: s["name"]),
            "units": [r.unit_id for r in records],
            "counts": {
                "in": sum(r.samples_in for r in records),
                "out": sum(r.samples_out for r in records),
                "quarantined": len(quarantined),
                **({"expanded": expanded} if expanded else {}),  # clips beyond one per video
            },
        }
        tmp = self.quarantine_path.with_name(self.quarantine_path.name + ".tmp")
        with open(tmp, "wb") as fh:
            for q in sorted(quarantined, key=lambda q: (q["source"], q["key"])):
                fh.write(json_bytes(q) + b"\n")
        os.replace(tmp, self.quarantine_path)
        _write_json_atomic(self.manifest_path, manifest)
        return manifest

    def read_manifest(self) -> dict[str, Any]:
        if not self.manifest_path.is_file():
            raise FileNotFoundError(f"{self.manifest_path} does not exist: run the {self.stage} stage first")
        return json.loads(self.manifest_path.read_text())


def stage_report(stage: str, records: list[UnitRecord], seconds: float) -> dict[str, Any]:
    """Counts for the run summary: in + expanded = out + quarantined, and in = processed + reused.

    ``expanded`` is non-zero only where one input sample becomes several outputs (the bucket stage cuts a
    video into clips); its records then count ``videos``, ``clips`` and ``expanded`` (clips beyond the
    first of each video) in ``extra``, and the report carries them. ``in``, ``processed`` and ``reused``
    count input samples; ``out`` counts output samples (clips).
    """
    report = {
        "in": sum(r.samples_in for r in records),
        "out": sum(r.samples_out for r in records),
        "quarantined": sum(len(r.quarantined) for r in records),
        "processed": sum(r.samples_in for r in records if not r.reused),
        "reused": sum(r.samples_in for r in records if r.reused),
        "shards": sum(len(r.shards) for r in records),
        "units": len(records),
        "seconds": round(seconds, 3),
    }
    expanded = sum(int(r.extra.get("expanded", 0)) for r in records)
    if any("clips" in r.extra for r in records):
        report["videos"] = sum(int(r.extra.get("videos", 0)) for r in records)
        report["clips"] = sum(int(r.extra.get("clips", 0)) for r in records)
        report["expanded"] = expanded
    if report["in"] + expanded != report["out"] + report["quarantined"]:
        raise RuntimeError(f"{stage}: counts do not conserve: {report}")
    return report


def sample_json(sample: dict[str, Any]) -> dict[str, Any]:
    """Decode a sample's ``json`` member."""
    return json.loads(sample["json"])


def iter_samples(stage_root: Path, shards: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Yield every sample of the listed shards (manifest entries), in order."""
    for shard in shards:
        yield from read_shard(stage_root / shard["path"])


def _tar_bytes(sample: dict[str, Any]) -> int:
    """The bytes ``sample`` takes in a tar: a 512-byte header per member and its data padded to 512."""
    return sum(_TAR_BLOCK + -(-len(v) // _TAR_BLOCK) * _TAR_BLOCK for k, v in sample.items()
               if not k.startswith("__") and isinstance(v, (bytes, bytearray, memoryview)))


# Shard layout of the caption, bucket and cache stages (it joins their unit ids). 1: one unit per upstream
# shard, one shard per (unit x bucket). 2: upstream shards grouped up to a byte target, one shard per unit
# (per kind of sample: image or video) holding every bucket it meets (see docs/cache-format.md).
LAYOUT_VERSION = 2
DEFAULT_SHARD_BYTES = 1 << 30  # cache.shard_bytes
# A unit estimated at E > target bytes cuts its shards at min(target, S * E / n + one sample) with
# n = ceil(S * E / target), S = ROLL_SLACK / 100: n shards of about equal size, each at most the target, with
# room for an estimate up to 10% low (and for whole samples) before an (n+1)th small one is cut.
ROLL_SLACK = 110
GROUP_KEY = "upstream"  # a unit record's extra: the names of the upstream shards the unit read, in order


def group_by_bytes(items: list[tuple[str, int]], previous: list[list[str]], target: int) -> list[list[str]]:
    """Group ``items`` (name, estimated output bytes), in the given order, into groups of at most ``target``
    bytes (a single item larger than the target makes a group of its own).

    Stable across refreshes: each group of ``previous`` (the last run's units) keeps those of its members
    that are still listed, in its order, and only the items no previous group holds are packed into new
    groups (next fit, in the order of ``items``). A refresh therefore never regroups old inputs: its new
    inputs form new units, and a removed input changes only the unit that held it.
    """
    listed = dict(items)
    groups: list[list[str]] = []
    placed: set[str] = set()
    for group in previous:
        members = [name for name in group if name in listed and name not in placed]
        placed.update(members)
        if members:
            groups.append(members)
    current: list[str] = []
    size = 0
    for name, nbytes in items:
        if name in placed:
            continue
        if current and size + nbytes > target:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def previous_unit_groups(stage_dir: StageDir | None) -> list[list[str]]:
    """The upstream shard names of each unit of the stage's last committed manifest (empty without one, or
    for units of layout 1, whose records do not name them)."""
    if stage_dir is None or not stage_dir.manifest_path.is_file():
        return []
    try:
        unit_ids = json.loads(stage_dir.manifest_path.read_text()).get("units") or []
    except (OSError, ValueError):
        return []
    groups = []
    for unit_id in unit_ids:
        try:
            names = json.loads(stage_dir.unit_path(unit_id).read_text()).get("extra", {}).get(GROUP_KEY)
        except (OSError, ValueError, AttributeError):
            continue
        if names:
            groups.append(list(names))
    return groups


def shard_tar_bytes(upstream: StageDir, entry: dict[str, Any], per_sample: int = 0) -> int:
    """An upstream shard's size on disk, plus ``per_sample`` bytes a sample: what a stage that copies its
    samples and adds a little to each (a caption, a bucket and crop in its json) writes."""
    return (upstream.root / entry["path"]).stat().st_size + per_sample * int(entry["samples"])


def copy_estimate(per_sample: int) -> Callable[[StageDir, dict[str, Any]], int]:
    """``shard_tar_bytes`` with ``per_sample`` bytes added to each sample (an estimate for ``units_by_bytes``)."""
    return lambda upstream, entry: shard_tar_bytes(upstream, entry, per_sample)


def grouped_unit_id(fingerprint: dict[str, Any], inputs: list[str]) -> str:
    """The id of a unit that reads the upstream shards of sha256 ``inputs`` (in order), for a stage of
    ``fingerprint``: planning (:func:`units_by_bytes`) and compaction (``stages.compact``) agree on it, so a
    compacted unit is the unit the next plan asks for."""
    return stable_hash({"fingerprint": fingerprint, "layout": LAYOUT_VERSION, "inputs": list(inputs)})


def units_by_bytes(upstream: StageDir, fingerprint: dict[str, Any], target: int,
                   stage_dir: StageDir | None = None,
                   estimate: Callable[[StageDir, dict[str, Any]], int] = shard_tar_bytes) -> list[WorkUnit]:
    """Work units that each read several upstream shards, up to ``target`` estimated output bytes.

    ``estimate(upstream, entry)`` is the output one upstream shard will make. Grouping follows
    :func:`group_by_bytes` (upstream shards in manifest order, i.e. by name; ``stage_dir``'s last manifest
    keeps old groups), so it is deterministic and a refresh adds units only for new upstream shards. A unit's
    id is the hash of its inputs' sha256s (in order), the stage fingerprint and ``LAYOUT_VERSION``. A unit
    whose estimate passes ``target`` (one upstream shard larger than it) cuts its output into shards of about
    equal size, each at most ``target`` bytes (``payload["roll_bytes"]``, see :class:`UnitOutput`).
    """
    entries = {e["name"]: e for e in upstream.read_manifest()["shards"]}
    sizes = {name: int(estimate(upstream, e)) for name, e in entries.items()}
    units = []
    for group in group_by_bytes(list(sizes.items()), previous_unit_groups(stage_dir), target):
        members = [entries[name] for name in group]
        inputs = [e["sha256"] for e in members]
        unit_id = grouped_unit_id(fingerprint, inputs)
        estimated = sum(sizes[name] for name in group)
        payload = {"shards": [str(upstream.root / e["path"]) for e in members], GROUP_KEY: list(group),
                   "estimated_bytes": estimated}
        if estimated > target:  # cut into n shards of about equal size, each at most the target
            n = -(-estimated * ROLL_SLACK // (100 * target))
            per_sample = estimated // max(1, sum(e["samples"] for e in members))
            payload["roll_bytes"] = min(target, -(-estimated * ROLL_SLACK // (100 * n)) + per_sample)
        units.append(WorkUnit(unit_id, inputs, payload, sum(e["samples"] for e in members)))
    return units


def sibling_stage(upstream: StageDir, stage: str) -> StageDir:
    """The folder of ``stage`` beside its upstream stage's (``<output_dir>/prep/<stage>``)."""
    return StageDir(upstream.root.parent / stage, stage)


def check_shard_bytes(value: int, key: str) -> None:
    """Refuse a byte target below 1 (a ``ConfigError`` naming the key)."""
    from latentmill.config import ConfigError

    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: the target size of a shard in bytes, must be >= 1, got {value!r}")


def unit_input_shards(unit: WorkUnit) -> list[str]:
    """The upstream shard paths a unit reads (``shards``; ``shard`` in units planned before layout 2)."""
    return list(unit.payload["shards"]) if "shards" in unit.payload else [unit.payload["shard"]]


def iter_unit_samples(unit: WorkUnit) -> Iterator[dict[str, Any]]:
    """Every sample of a unit's upstream shards, shard after shard, in file order."""
    for path in unit_input_shards(unit):
        yield from read_shard(path)


def shard_buckets(entry: dict[str, Any]) -> dict[str, int]:
    """Samples per bucket (``"WxHxF"``) of one manifest shard entry: its ``bucket`` when it holds one bucket,
    its ``buckets`` when it holds several (layout 2); empty for a shard without buckets (ingest, caption)."""
    if entry.get("bucket"):
        return {"x".join(map(str, entry["bucket"])): int(entry["samples"])}
    return dict(entry.get("buckets") or {})


def units_per_shard(upstream: StageDir, fingerprint: dict[str, Any]) -> list[WorkUnit]:
    """One work unit per upstream shard, keyed by that shard's hash and this stage's fingerprint."""
    units = []
    for shard in upstream.read_manifest()["shards"]:
        unit_id = stable_hash({"fingerprint": fingerprint, "inputs": [shard["sha256"]]})
        payload = {"shard": str(upstream.root / shard["path"]), "bucket": shard.get("bucket")}
        units.append(WorkUnit(unit_id, [shard["sha256"]], payload, shard["samples"]))
    return units
