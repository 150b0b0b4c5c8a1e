"""Shard index files: ``<shard>.idx`` beside each tar (docs/cache-format.md, "Shard index").

An index lists, per sample of its tar, each member's byte offset and size, the sample's key and bucket,
and each safetensors member's tensors, so the trainer reads payloads without scanning the tar. Here: the
writer (``build_shard_index``, ``index_tar``, ``write_index_file``), the reader (``read_shard_index``,
``load_shard_index``, ``ShardIndex``) and the manifest check (``verify_index``).

The index is a file format of its own, read by the trainer and written by the stages, so it is kept apart
from the unit and manifest bookkeeping of ``latentmill.stages.shardio``. It builds on the member walker
and grouping rule of ``latentmill.stages.tarshard`` and the canonical bytes of ``latentmill.core.hashing``;
it must not import ``shardio`` (which imports it to write each shard's index).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from latentmill.stages.tarshard import (
    HEADER_READ,
    MAX_HEADER,
    HeaderError,
    TarSamples,
    index_shard,
    safetensors_entries,
)

from latentmill.core import durable
from latentmill.core.hashing import json_bytes, sha256_bytes, sha256_file

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


def bucket_of(meta_bytes_: bytes) -> list[int] | None:
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
    headers: dict[tuple[int, str], bytes],
    buckets: list[list[int] | None],
) -> bytes:
    """The bytes of a shard index (the index writer): a pure function of its arguments.

    ``samples``: (key, {extension: (data offset, size)}) in tar order (``index_shard``); ``headers``: by
    (sample number in ``samples``, extension), the JSON header of each ``.safetensors`` member (a missing or invalid one gets no layout: the loader then
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
    for number, ((key, members), bucket) in enumerate(zip(samples, buckets)):
        for ext, (offset, size) in members.items():
            offsets.append(offset)
            sizes.append(size)
            member_names.append(names.setdefault(ext, len(names)))
            layout = -1
            header = headers.get((number, ext)) if ext.endswith(".safetensors") else None
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
    """The index of the tar at ``path``, from its bytes alone: its samples as ``index_shard`` lists them (the
    one walker and grouping rule), the safetensors header of each ``.safetensors`` member and the ``bucket``
    field of each sample's ``json`` member."""
    path = Path(path)
    samples = index_shard(path)
    headers: dict[tuple[int, str], bytes] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        tar_size = os.fstat(fd).st_size
        buckets: list[list[int] | None] = []
        for number, (_, members) in enumerate(samples):
            for ext, (offset, size) in members.items():
                if ext.endswith(".safetensors") and size >= 8:
                    head = os.pread(fd, min(size, HEADER_READ), offset)
                    length = int.from_bytes(head[:8], "little")
                    if 8 + length <= size and length <= MAX_HEADER:
                        headers[number, ext] = head[8 : 8 + length] if 8 + length <= len(head) else \
                            os.pread(fd, length, offset + 8)
            meta = members.get("json")
            buckets.append(bucket_of(os.pread(fd, meta[1], meta[0])) if meta is not None else None)
    finally:
        os.close(fd)
    return build_shard_index(tar_size, samples, headers, buckets)


def write_index_file(tar_path: str | Path, data: bytes | None = None) -> dict[str, Any]:
    """Write the index of the tar at ``tar_path`` beside it, atomically (``index_tar`` unless ``data`` is
    given); return its manifest entry ``{"name", "size", "sha256"}``."""
    path = index_path(tar_path)
    data = index_tar(tar_path) if data is None else data
    durable.write_bytes(path, data)
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
    fix = "re-run the prep: it rewrites a missing or damaged index from its tar, without re-encoding"
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
    or None when it matches (also None for an entry without an index: a stage folder written before
    indexes, which the next prep indexes)."""
    index = entry.get("index")
    if not index:
        return None
    path = Path(tar_path).with_name(index["name"])
    if not path.is_file():
        return f"{tar_path}: its index {path} is missing"
    if sha256_file(path) != index["sha256"]:
        return f"{tar_path}: its index {path}: sha256 differs from the manifest"
    return None
