"""Batch assembly for ``latentmill.trainer.loader.LatentLoader``: one copy per tensor, from shard files to batch.

``ShardReader`` holds the open shard files of a latent cache. For a batch it checks each member's
safetensors header (8-byte little-endian length + JSON with dtype, shape and ``data_offsets``; from the
start-up index where it read it, else one small ``pread``), allocates one ``[B, ...]`` tensor per column in
the stored dtype, and reads each tensor's payload with ``os.preadv`` straight into its row: no per-sample
decode, no ``torch.stack``. A batch with ``PARALLEL_READ_BYTES`` or more to read is copied by several
threads at once (``os.preadv`` releases the GIL).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch
from latentmill.trainer.shard_index import (
    HEADER_READ,
    MAX_HEADER,
    HeaderError,
    MemberLayout,
    TensorSpec,
    parse_safetensors_header,
)

VAE_MEMBER = "vae.safetensors"
TEXT_MEMBER = "text.safetensors"
META_MEMBER = "json"

PARALLEL_READ_BYTES = 1 << 20  # a batch with less to read is read by one thread (a hand-off costs ~50 µs)


@dataclass(frozen=True)
class SampleRef:
    """Where one cached sample lives: its shard file and the byte range of each member."""

    shard: int  # index into the shard list (LatentLoader.shard_paths)
    key: str
    members: dict[str, tuple[int, int]]  # extension -> (offset, size) in the tar
    texts: tuple[str, ...] = (TEXT_MEMBER,)  # caption members in order (``loader.text_members``)
    # extension -> its checked safetensors header, where the index read it (shared by equal headers)
    layouts: dict[str, MemberLayout] = field(default_factory=dict)
    probe_at: int = 0  # the middle byte of its largest member: what the page-cache probe reads


# Where one tensor of a batch row comes from: (sample, member extension, tensor) or an in-memory tensor
_Source = Union[tuple[SampleRef, str, TensorSpec], torch.Tensor]
# One run of adjacent byte ranges: (file offset, [writable buffers back to back], their bytes)
_Run = tuple[int, list[Any], int]
# One member's reads: (sample, member extension, its runs)
_Group = tuple[SampleRef, str, list[_Run]]


@dataclass
class _Plan:
    """How a batch whose samples share one VAE and one text header is read: per column its row shape and
    dtype; per member, its tensors as runs of adjacent byte ranges ((offset in the member, [(column,
    bytes)])); the empty prompt's rows as bytes, ready to copy (caption dropout)."""

    vae: MemberLayout
    text: MemberLayout
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    padded: bool  # some column's rows hold fewer bytes than the row (trimmed text): allocate zeros
    vae_runs: list[tuple[int, list[tuple[int, int]], int]]
    text_runs: list[tuple[int, list[tuple[int, int]], int]]
    empty_rows: dict[int, Any] | None  # column -> uint8 row (padded); None: no empty prompt given


class ShardReader:
    """The open shard files of a cache, and batches read from them.

    ``io_threads``: threads that copy the members of one batch (over ``PARALLEL_READ_BYTES``). Thread-safe
    for one batch at a time (the loader's read-ahead thread and its consumer take turns)."""

    def __init__(self, shard_paths: list[Path], io_threads: int = 2) -> None:
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.shard_paths = shard_paths
        self.io_threads = io_threads
        self._io_pool: ThreadPoolExecutor | None = None
        self._layouts: dict[bytes, MemberLayout] = {}  # parsed headers by their bytes (a bucket shares a few)
        self._plans: dict[tuple, _Plan] = {}  # read plans by (VAE header, text header, options)
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()

    def fd(self, shard: int) -> int:
        """The open file descriptor of shard ``shard`` (opened on first use, closed by ``close``)."""
        fd = self._fds.get(shard)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(shard)
                if fd is None:
                    fd = self._fds[shard] = os.open(self.shard_paths[shard], os.O_RDONLY)
        return fd

    def forget(self, shard: int) -> None:
        """Close shard ``shard``'s file (a streamed shard evicted from the local cache; reopened on next use)."""
        with self._fd_lock:
            fd = self._fds.pop(shard, None)
        if fd is not None:
            os.close(fd)

    def read(self, ref: SampleRef, ext: str) -> bytes:
        """The bytes of one member of a sample (metadata, tests; batches read with ``read_batch``)."""
        offset, size = ref.members[ext]
        data = os.pread(self.fd(ref.shard), size, offset)
        if len(data) != size:
            raise IOError(f"{self.shard_paths[ref.shard]}: short read for {ref.key}.{ext}")
        return data

    def where(self, ref: SampleRef, ext: str) -> str:
        return f"{self.shard_paths[ref.shard]}: sample {ref.key!r}, member {ref.key}.{ext}"

    def parsed(self, header: bytes, strict: bool = False) -> MemberLayout | None:
        """``parse_safetensors_header`` once per distinct header; an invalid one: None, or ``HeaderError``
        when ``strict``."""
        layout = self._layouts.get(header)
        if layout is None:
            try:
                layout = parse_safetensors_header(header)
            except HeaderError:
                if strict:
                    raise
                return None
            if len(self._layouts) >= 65536:  # many distinct headers (unusual): stay bounded
                self._layouts.clear()
            self._layouts[header] = layout
        return layout

    def layout(self, ref: SampleRef, ext: str) -> MemberLayout:
        """The checked safetensors header of a sample member: from the index where it read it, else one
        small ``pread``. Raises ``ValueError`` naming the shard, the sample and the member if invalid."""
        layout = ref.layouts.get(ext)
        if layout is not None:
            return layout
        offset, size = ref.members[ext]
        fd = self.fd(ref.shard)
        head = os.pread(fd, min(size, HEADER_READ), offset)
        if len(head) < 8:
            raise ValueError(f"{self.where(ref, ext)}: {size} bytes, too short for a safetensors header")
        end = 8 + int.from_bytes(head[:8], "little")
        if end > size or end - 8 > MAX_HEADER:
            raise ValueError(
                f"{self.where(ref, ext)}: safetensors header length {end - 8} runs past the member's "
                f"{size} bytes"
            )
        if end > len(head):
            head += os.pread(fd, end - len(head), offset + len(head))
            if len(head) < end:
                raise IOError(f"{self.where(ref, ext)}: short read")
        try:
            layout = self.parsed(head[8:end], strict=True)
        except HeaderError as err:
            raise ValueError(f"{self.where(ref, ext)}: {err}") from None
        if layout.size != size:
            raise ValueError(
                f"{self.where(ref, ext)}: safetensors header describes {layout.size} bytes, "
                f"the member holds {size}"
            )
        return layout

    def read_batch(
        self,
        bucket: tuple[int, ...],
        refs: list[SampleRef],
        texts: list[str | None],
        *,
        empty_prompt: dict[str, torch.Tensor] | None = None,
        distribution: bool = False,
        pad: dict[str, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """One batch tensor per column (``latents``, ``latents_std`` with ``distribution``, the text
        tensors), rows in ``refs`` order, each in its stored dtype: the members' headers first, then each
        tensor payload straight into its row.

        ``texts``: per sample, the text member it reads, or None for the empty prompt's tensors
        (``empty_prompt``, caption dropout). ``pad``: the token-axis streams of a trimmed cache, each
        zero-padded to its number of tokens. Everything done here is ``os.preadv`` and numpy copies (no
        multi-threaded torch op, which would fight a training step's OpenMP team for the cores), except
        for rows stored in another dtype than their column (not what the cache stage writes).
        """
        plan = self._plan(refs, texts, empty_prompt, distribution, pad)
        if plan is not None:
            return self._read_planned(plan, refs, texts)
        # The general case (samples of different headers, or an empty prompt of another dtype):
        # 1. per sample, where each output tensor comes from: a tensor of a member, or the empty prompt's
        rows: list[dict[str, _Source]] = []
        for ref, member in zip(refs, texts):
            vae = self.layout(ref, VAE_MEMBER)
            if "latents" not in vae.tensors:
                raise ValueError(f"{self.where(ref, VAE_MEMBER)}: no 'latents' tensor")
            # every tensor of the VAE member is a column (an edit family's reference_latents too), bar
            # latents_std outside "distribution" caches
            sample: dict[str, _Source] = {name: (ref, VAE_MEMBER, spec) for name, spec in vae.tensors.items()
                                          if name != "latents_std"}
            if member is None:
                if empty_prompt is None:
                    raise ValueError(f"sample {ref.key!r}: no text member and no empty prompt to use")
                sample.update(empty_prompt)
            else:
                for name, spec in self.layout(ref, member).tensors.items():
                    sample[name] = (ref, member, spec)
            if distribution:
                if "latents_std" not in vae.tensors:
                    raise ValueError(
                        f"sample {ref.key!r}: the manifest says latents: distribution, no latents_std"
                    )
                sample["latents_std"] = (ref, VAE_MEMBER, vae.tensors["latents_std"])
            if rows and sample.keys() != rows[0].keys():
                raise ValueError(f"sample {ref.key!r} holds {sorted(sample)}, others {sorted(rows[0])}")
            rows.append(sample)

        # 2. one batch tensor per column, [B, *row shape] in the rows' (stored) dtype
        columns = {name: _column(bucket, name, [row[name] for row in rows], pad) for name in rows[0]}

        # 3. payloads: the bytes of each row of each column, read in place; padding and empty prompts filled
        # (shard, member offset) -> (sample, member, [(file offset, buffer)])
        reads: dict[tuple[int, int], tuple[SampleRef, str, list[tuple[int, Any]]]] = {}
        conversions: list[tuple[torch.Tensor, torch.Tensor]] = []  # (row, staged tensor of another dtype)
        for name, out in columns.items():
            flat = out.view(len(rows), out[0].numel())
            flat_bytes = flat.view(torch.uint8).numpy()  # [B, row bytes], writable, shares out's memory
            for i, row in enumerate(rows):
                source = row[name]
                if isinstance(source, torch.Tensor):  # the empty prompt's tensor
                    n = source.numel()
                    if source.dtype == out.dtype:
                        nb = n * out.element_size()
                        flat_bytes[i, :nb] = source.reshape(-1).view(torch.uint8).numpy()
                        flat_bytes[i, nb:] = 0
                    else:  # an empty prompt stored in another dtype (rare): a torch conversion
                        flat[i, :n].copy_(source.reshape(-1))
                        flat[i, n:].zero_()
                    continue
                ref, member, spec = source
                nbytes = spec.end - spec.begin
                if spec.dtype == out.dtype:
                    buffer = flat_bytes[i, :nbytes]
                    if nbytes < flat_bytes.shape[1]:  # trimmed text: zeros after the real tokens
                        flat_bytes[i, nbytes:] = 0
                else:  # rows of different dtypes (not what the cache stage writes): stage, convert below
                    staged = torch.empty(spec.shape, dtype=spec.dtype)
                    buffer = staged.view(-1).view(torch.uint8).numpy()
                    conversions.append((flat[i, : staged.numel()], staged))
                    flat[i, staged.numel() :].zero_()
                if nbytes:
                    at = ref.members[member][0]
                    reads.setdefault((ref.shard, at), (ref, member, []))[2].append((at + spec.begin, buffer))
        self._read_members([
            (ref, member, _adjacent([(at, len(buffer), buffer) for at, buffer in pieces]))
            for _, (ref, member, pieces) in sorted(reads.items())
        ])
        for row, staged in conversions:
            row.copy_(staged.reshape(-1))
        return columns

    def _plan(
        self,
        refs: list[SampleRef],
        texts: list[str | None],
        empty_prompt: dict[str, torch.Tensor] | None,
        distribution: bool,
        pad: dict[str, int] | None,
    ) -> _Plan | None:
        """The read plan of a batch whose samples all share one VAE header and one text header, as read by
        the start-up index (a bucket's samples usually do); None for anything else (``read_batch``'s
        general path reads it, and raises what is wrong with it). Built once per header pair."""
        vae = text = None
        for ref, member in zip(refs, texts):
            layout = ref.layouts.get(VAE_MEMBER)
            if layout is None or (vae is not None and layout is not vae):
                return None
            vae = layout
            if member is not None:
                layout = ref.layouts.get(member)
                if layout is None or (text is not None and layout is not text):
                    return None
                text = layout
        if text is None and refs:  # every caption dropped: the columns of the first sample's caption
            text = refs[0].layouts.get(refs[0].texts[0])
        if vae is None or text is None:
            return None
        key = (id(vae), id(text), id(empty_prompt), distribution, tuple(sorted((pad or {}).items())))
        plan = self._plans.get(key)
        if plan is None:
            plan = _make_plan(vae, text, empty_prompt, distribution, pad)
            if plan is None:
                return None
            if len(self._plans) >= 4096:  # many distinct headers (unusual): stay bounded
                self._plans.clear()
            self._plans[key] = plan  # holds vae, text and the empty prompt: their ids stay theirs
        if plan.empty_rows is None and any(member is None for member in texts):
            return None
        return plan

    def _read_planned(
        self, plan: _Plan, refs: list[SampleRef], texts: list[str | None]
    ) -> dict[str, torch.Tensor]:
        """``read_batch`` by a plan: allocate the columns, then one ``os.preadv`` per run of each member."""
        B = len(refs)
        alloc = torch.zeros if plan.padded else torch.empty
        columns = [alloc((B, *shape), dtype=dtype) for shape, dtype in zip(plan.shapes, plan.dtypes)]
        rows = [column.view(B, -1).view(torch.uint8).numpy() for column in columns]  # [B, row bytes] views
        groups: list[tuple[tuple[int, int], _Group]] = []
        for i, (ref, member) in enumerate(zip(refs, texts)):
            at = ref.members[VAE_MEMBER][0]
            runs = [(at + start, [rows[c][i, :n] for c, n in cut], nb) for start, cut, nb in plan.vae_runs]
            groups.append(((ref.shard, at), (ref, VAE_MEMBER, runs)))
            if member is None:  # the empty prompt's tensors (caption dropout)
                for c, row in plan.empty_rows.items():  # type: ignore[union-attr]
                    rows[c][i] = row
                continue
            at = ref.members[member][0]
            runs = [(at + start, [rows[c][i, :n] for c, n in cut], nb) for start, cut, nb in plan.text_runs]
            groups.append(((ref.shard, at), (ref, member, runs)))
        groups.sort(key=lambda item: item[0])
        self._read_members([group for _, group in groups])
        return dict(zip(plan.names, columns))

    def _read_members(self, groups: list[_Group]) -> None:
        """Run ``_read_into`` for every member of a batch (in file order): with ``io_threads`` > 1 and at
        least ``PARALLEL_READ_BYTES`` to read, in that many contiguous slices at once (page-cache copies on
        several cores, several requests in flight on a cold disk)."""
        threads = min(self.io_threads, len(groups))
        if threads < 2:
            for group in groups:
                self._read_into(*group)
            return
        sizes = [sum(size for _, _, size in runs) for _, _, runs in groups]
        total = sum(sizes)
        if total < PARALLEL_READ_BYTES:
            for group in groups:
                self._read_into(*group)
            return
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(self.io_threads - 1, thread_name_prefix="latent-io")
        cuts, done, share = [0], 0, total / threads
        for i, size in enumerate(sizes):  # slices of about equal bytes
            done += size
            if done >= share * len(cuts) and len(cuts) < threads:
                cuts.append(i + 1)
        cuts.append(len(groups))
        slices = [groups[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
        futures = [self._io_pool.submit(self._read_slice, part) for part in slices[1:]]
        self._read_slice(slices[0])
        for future in futures:
            future.result()

    def _read_slice(self, groups: list[_Group]) -> None:
        for group in groups:
            self._read_into(*group)

    def _read_into(self, ref: SampleRef, member: str, runs: list[_Run]) -> None:
        """Fill one member's tensors: one ``os.preadv`` per run of adjacent byte ranges."""
        fd = self.fd(ref.shard)
        for start, buffers, size in runs:
            if os.preadv(fd, buffers, start) != size:
                raise IOError(f"{self.where(ref, member)}: short read")

    def close(self) -> None:
        """Close the shard files (and stop the read threads)."""
        if self._io_pool is not None:
            self._io_pool.shutdown()
            self._io_pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _column(bucket: tuple[int, ...], name: str, sources: list[_Source], pad: dict[str, int] | None) -> torch.Tensor:
    """An uninitialised batch tensor for column ``name``: the rows' common shape (a padded stream of a
    trimmed cache: ``pad[name]`` tokens) and dtype (promoted as ``torch.stack`` would, if they differ)."""
    shapes, dtypes = set(), set()
    for source in sources:
        if isinstance(source, torch.Tensor):
            shape, dtype = tuple(source.shape), source.dtype
        else:
            shape, dtype = source[2].shape, source[2].dtype
        shapes.add(_padded(name, shape, pad))
        dtypes.add(dtype)
    if len(shapes) > 1:
        raise ValueError(f"bucket {list(bucket)} holds samples of different shapes: {name} {sorted(shapes)}")
    dtype = dtypes.pop()
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    return torch.empty((len(sources), *shapes.pop()), dtype=dtype)


def _adjacent(items: list[tuple[int, int, Any]]) -> list[tuple[int, list[Any], int]]:
    """(offset, bytes, payload) items -> runs of back-to-back ones: (start, [payloads], bytes), in offset
    order; empty items left out."""
    runs: list[tuple[int, list[Any], int]] = []
    start, payloads, end = -1, [], -1
    for offset, nbytes, payload in sorted(items, key=lambda item: item[0]):
        if not nbytes:
            continue
        if offset != end:
            if payloads:
                runs.append((start, payloads, end - start))
            start, payloads = offset, []
        payloads.append(payload)
        end = offset + nbytes
    if payloads:
        runs.append((start, payloads, end - start))
    return runs


def _padded(name: str, shape: tuple[int, ...], pad: dict[str, int] | None) -> tuple[int, ...]:
    """A row's shape in its batch column: a padded stream of a trimmed cache holds ``pad[name]`` tokens."""
    if not pad or name not in pad or not shape:
        return shape
    if shape[0] > pad[name]:
        raise ValueError(
            f"{name} hold {shape[0]} tokens, more than the manifest's text.pad_to ({pad[name]})"
        )
    return (pad[name], *shape[1:])


def _make_plan(
    vae: MemberLayout,
    text: MemberLayout,
    empty_prompt: dict[str, torch.Tensor] | None,
    distribution: bool,
    pad: dict[str, int] | None,
) -> _Plan | None:
    """The ``_Plan`` of batches of samples with these headers; None where ``read_batch``'s general path
    must decide (a missing tensor, more tokens than ``pad``, empty tensors: it raises or copes)."""
    if "latents" not in vae.tensors or (distribution and "latents_std" not in vae.tensors):
        return None
    # (column name, member: 0 vae / 1 text, tensor): every VAE tensor (bar latents_std), then the text's
    sources = [(name, 0, spec) for name, spec in vae.tensors.items() if name != "latents_std"]
    sources += [(name, 1, spec) for name, spec in text.tensors.items()]
    if distribution:
        sources.append(("latents_std", 0, vae.tensors["latents_std"]))
    if len({name for name, _, _ in sources}) != len(sources):
        return None
    names = [name for name, _, _ in sources]
    shapes = [_padded(name, spec.shape, pad) for name, _, spec in sources]  # raises as the general path
    dtypes = [spec.dtype for _, _, spec in sources]
    if any(math.prod(shape) == 0 for shape in shapes):
        return None
    padded = any(shape != spec.shape for shape, (_, _, spec) in zip(shapes, sources))
    empty_rows = None
    if empty_prompt is not None and set(empty_prompt) == set(text.tensors):
        empty_rows = {}
        for c, (name, member, _) in enumerate(sources):
            if member != 1:
                continue
            tensor = empty_prompt[name]
            try:
                fits = tensor.dtype == dtypes[c] and _padded(name, tuple(tensor.shape), pad) == shapes[c]
            except ValueError:  # more tokens than pad
                fits = False
            if not fits:  # the general path promotes, or refuses (for a batch that drops a caption)
                empty_rows = None
                break
            row = torch.zeros(shapes[c], dtype=dtypes[c])
            row.view(-1)[: tensor.numel()] = tensor.reshape(-1)
            empty_rows[c] = row.view(-1).view(torch.uint8).numpy()
    vae_runs, text_runs = (
        _adjacent([(spec.begin, spec.end - spec.begin, (c, spec.end - spec.begin))
                   for c, (_, m, spec) in enumerate(sources) if m == member])
        for member in (0, 1)
    )
    return _Plan(vae, text, names, shapes, dtypes, padded, vae_runs, text_runs, empty_rows)
