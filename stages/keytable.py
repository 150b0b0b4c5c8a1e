"""A map from sha256 keys (64 hex characters) to numbers, held in sorted numpy arrays.

The per-process record indexes (curate's score index, the cache's component index) hold one entry per
sample of a stage, for the whole stage. As a Python dict an entry costs a key object, a value object and a
slot: ~150-250 bytes, so at 100,000 samples each index held 30-45 MB of small objects that grew with the data
(figure 15: the prep's peak RSS at 10x the inputs) and left the heap fragmented once freed. Here an entry
costs its 32 key bytes and its 8 value bytes in two arrays; no Python object exists per entry.

New keys wait in a small dict and are merged into the sorted arrays when it holds an eighth of the table
(at least ``MIN_MERGE``), so adding n keys costs O(n log n) in all and a lookup is a binary search.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

MIN_MERGE = 4096  # pending keys merged into the arrays at once, at least


class HexKeyTable:
    """sha256 hex key -> a value of ``dtype`` (int64 or float64). A key set again takes the new value."""

    def __init__(self, dtype: type = np.int64):
        self.dtype = np.dtype(dtype)
        self._keys = np.empty(0, "S32")  # the raw 32 bytes, sorted
        self._values = np.empty(0, self.dtype)
        self._pending: dict[bytes, float | int] = {}

    @staticmethod
    def raw(key: str) -> bytes | None:
        """The 32 bytes of a 64-hex key (None for anything else: such a key is never held)."""
        if len(key) != 64:
            return None
        try:
            return bytes.fromhex(key)
        except ValueError:
            return None

    def __len__(self) -> int:
        self._merge()
        return len(self._keys)

    def _find(self, raw: bytes) -> int | None:
        """The row of ``raw`` in the sorted arrays, or None."""
        if not len(self._keys):
            return None
        i = int(np.searchsorted(self._keys, raw))
        # numpy's bytes type drops trailing NUL bytes (on both sides of the comparison, so order holds)
        return i if i < len(self._keys) and self._keys[i] == raw.rstrip(b"\0") else None

    def set(self, key: str, value: float | int) -> None:
        raw = self.raw(key)
        if raw is None:
            raise ValueError(f"not a sha256 hex key: {key!r}")
        self._pending[raw] = value
        if len(self._pending) >= max(MIN_MERGE, len(self._keys) // 8):
            self._merge()

    def add_new(self, raws: list[bytes], values: list[int] | list[float]) -> list[int]:
        """Enter each of ``raws`` (32-byte keys) not held yet with its value; return the positions of those
        held already (or repeated within ``raws``) for the caller to decide. One binary search for the batch."""
        if not raws:
            return []
        held = []
        present = np.zeros(len(raws), bool)
        if len(self._keys):
            batch = np.array(raws, "S32")
            at = np.minimum(np.searchsorted(self._keys, batch), len(self._keys) - 1)
            present = self._keys[at] == batch
        pending = self._pending
        for i, (raw, value) in enumerate(zip(raws, values)):
            if present[i] or raw in pending:
                held.append(i)
            else:
                pending[raw] = value
        if len(pending) >= max(MIN_MERGE, len(self._keys) // 8):
            self._merge()
        return held

    def get(self, key: str, default=None):
        raw = self.raw(key)
        if raw is None:
            return default
        if raw in self._pending:
            return self._pending[raw]
        i = self._find(raw)
        return default if i is None else self._values[i].item()

    def __getitem__(self, key: str) -> float | int:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def items(self) -> Iterator[tuple[str, float | int]]:
        """Every (hex key, value), in key order (tests, debugging)."""
        self._merge()
        for raw, value in zip(self._keys, self._values):
            yield raw.ljust(32, b"\0").hex(), value.item()

    def _merge(self) -> None:
        if not self._pending:
            return
        new_keys = np.array(list(self._pending), "S32")
        new_values = np.array(list(self._pending.values()), self.dtype)
        self._pending = {}
        keys = np.concatenate([self._keys, new_keys])
        values = np.concatenate([self._values, new_values])
        order = np.argsort(keys, kind="stable")  # a key set again: its new value sorts after the old one
        keys, values = keys[order], values[order]
        last = np.ones(len(keys), bool)
        last[:-1] = keys[1:] != keys[:-1]  # keep the last (newest) of equal keys
        self._keys, self._values = keys[last], values[last]
