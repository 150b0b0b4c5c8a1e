"""Near-duplicate removal: per-sample embeddings (computed in the curate units), a persistent index that grows
with the data, and keep / ``duplicate_of`` decisions that the bucket stage applies.

Where each part runs (``docs/cache-format.md``, "Curation: near duplicates"):

* **Embeddings** are computed in the curate units (they need decoded pixels, so they belong to the parallel
  part), only for samples that pass the thresholds. They are components with keys of their own, like scores:
  ``key = hash(embedder fingerprint, content sha256, clip window)``. A unit writes its embeddings to one
  ``.npy`` file beside its shards (``shards/curate-<unit>-embeddings.npy``, float32 ``[N, D]``) and lists the
  sample keys, embedding keys and the file's sha256 in its record (``extra["embeddings"]``); a unit that runs
  again (a changed threshold) looks every embedding up by key in the output folder's catalog
  (``stages.catalog``) before it decodes anything.
* **The index** (:class:`NearDupIndex`, ``prep/curate/neardup/<embedder>/``) is entered after the curate
  units of a run finish (:func:`update`): the samples of the stage's records not entered yet, in manifest
  order, become one batch. It keeps its own copy of every vector (``vectors.f32``, append-only), so old data is
  never read again, and an approximate nearest-neighbour search over them: random-hyperplane LSH in numpy
  (brute force on small indexes), or usearch's HNSW when the recipe asks for it (docs/benchmarks.md compares
  the two). Every candidate is re-checked with the exact cosine.
* **Decisions** are stored per (embedder, threshold): within a batch, samples are visited by the keep rule
  (highest ``aesthetic`` score first when the sample has one, then oldest: entry order, i.e. manifest order);
  a sample whose cosine with a sample already kept (an earlier batch's, or one visited before it) is
  ``>= curate.dedup_threshold`` is a near duplicate of the nearest such sample; otherwise it is kept. An
  earlier batch is never re-decided: a new sample near an old one is ``duplicate_of`` the old one. A new
  threshold decides the stored batches again, batch by batch, from the stored vectors (no decode, no
  embedding computed).
* **The bucket stage** applies them: its plan gives each unit the decisions for the samples of its input
  shards and its process quarantines them (``near duplicate``, ``duplicate_of``, ``cosine``); the threshold
  and the embedder are in its fingerprint.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
from latentmill.stages.catalog import Lookup, unit_detail
from latentmill.stages.shardio import StageRecords, UnitRecord
from PIL import Image

from latentmill.core.hashing import stable_hash

EMBEDDER = "thumbnail"  # the model-free default (the CLIP embedder of the aesthetic scorer can take its place)
EMBEDDER_VERSION = 1
THUMB_SIDE = 16  # 16 x 16 RGB = 768 values, the width of a CLIP L/14 embedding
# Measured on the 24 demo images (docs/cache-format.md): distinct pictures reach cosine 0.891 at most; a JPEG
# q=60 copy >= 0.9997, a half-size copy >= 0.9998, a copy cropped by 4 px >= 0.912 (>= 0.977 outside the 5
# fine-stripe pictures), a 4-px shift with edge padding >= 0.62 (0.92 outside them). The recommended
# curate.dedup_threshold; the default is off (null): two flat pictures of similar colours, e.g. (0, 200, 90) and
# (40, 170, 90), are at 0.997, so a pixel embedding would drop cheap synthetic data that is not duplicated.
DEFAULT_THRESHOLD = 0.92
INDEX_KINDS = ("auto", "usearch", "lsh", "exact")
EXACT_BELOW = 4096  # "auto" and "lsh": an index with fewer vectors is searched by brute force
NEIGHBOURS = 32  # candidates asked of the search per sample (each re-checked with the exact cosine)
REASON = "near duplicate"
FILE_SUFFIX = "-embeddings.npy"


# ---------------------------------------------------------------------------------------------------------
# The model-free embedder
# ---------------------------------------------------------------------------------------------------------


def thumbnail_embedding(frames: Sequence[Image.Image], side: int = THUMB_SIDE) -> np.ndarray:
    """The image (or the mean over a video's frames) shrunk to ``side`` x ``side`` RGB (Pillow's antialiased
    bilinear resize), centred on its mean grey level and L2-normalised: float32 ``[side * side * 3]``.

    Why this one: the colours and the layout of a picture survive re-encoding, resizing and a shift of a few
    pixels, and centring and normalising make the vector blind to a brightness or contrast change. What it
    cannot see: fine periodic textures shifted by half a period (docs/cache-format.md has the measurements).
    Centring on the grey level (not per channel) keeps the colours: two flat pictures of one colour are
    duplicates, of two colours are not; a flat grey picture is the zero vector, near nothing.
    """
    vectors = []
    for frame in frames:
        rgb = np.asarray(frame.convert("RGB").resize((side, side), Image.BILINEAR), np.float64)
        vectors.append((rgb - rgb.mean()).ravel())
    v = np.mean(vectors, axis=0)
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 1e-6 else np.zeros_like(v)).astype(np.float32)


def embedder_fingerprint(frames: int, score_side: int, background: tuple[int, int, int]) -> dict[str, Any]:
    """What decides an embedding's value for a given sample content: the embedder and how pixels reach it."""
    return {"embedder": EMBEDDER, "version": EMBEDDER_VERSION, "side": THUMB_SIDE, "frames": frames,
            "score_side": score_side, "background": list(background)}


def embedding_key(fingerprint_hash: str, meta: dict[str, Any]) -> str:
    """An embedding component's key: the embedder's fingerprint, the sample's content hash and clip window."""
    return stable_hash({"embedder": fingerprint_hash, "sha256": meta.get("sha256"), "clip": meta.get("clip")})


# ---------------------------------------------------------------------------------------------------------
# Embeddings of the curate units (components with keys, reused across runs)
# ---------------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class UnitEmbeddings:
    """Collects one curate unit's embeddings (reused by key, or computed from the frames the unit decoded)
    and writes them beside the unit's shards when it ends."""

    def __init__(self, stage_root: Path, unit_id: str, fingerprint: dict[str, Any], found: Lookup,
                 embed: Callable[[list[Image.Image]], np.ndarray] | None = None):
        self.root = stage_root
        self.unit_id = unit_id
        self.fp_hash = stable_hash(fingerprint)
        self.embed = embed
        self._found = found  # the catalog: embeddings stored by earlier units, by key
        self._arrays: dict[str, np.ndarray] = {}
        self.keys: list[str] = []
        self.ekeys: list[str] = []
        self.vectors: list[np.ndarray] = []
        self.computed = self.reused = 0

    def add(self, key: str, meta: dict[str, Any], frames: Callable[[], list[Image.Image]]) -> None:
        """Embed one kept sample: its stored embedding when its key is known, else ``embed(frames())``
        (``frames`` decodes only when called). A sample that cannot be decoded gets no embedding."""
        ekey = embedding_key(self.fp_hash, meta)
        vector = self.stored(ekey)
        if vector is None:
            try:
                vector = (self.embed or thumbnail_embedding)(frames())
            except Exception:  # PIL / decord / PyAV errors: the cache stage reports them
                return
            self.computed += 1
        else:
            self.reused += 1
        self.keys.append(key)
        self.ekeys.append(ekey)
        self.vectors.append(np.asarray(vector, np.float32))

    def stored(self, ekey: str) -> np.ndarray | None:
        """The embedding of key ``ekey`` an earlier unit stored, or None (unknown, or its file is gone)."""
        where = self._found.embedding(ekey)
        if where is None:
            return None
        name, row = where
        if name not in self._arrays:
            try:
                self._arrays[name] = np.load(self.root / name, mmap_mode="r")
            except (OSError, ValueError):
                return None
        return np.array(self._arrays[name][row], np.float32)

    def write(self, stage_dir_name: str = "curate") -> dict[str, Any] | None:
        """Write ``shards/<stage>-<unit>-embeddings.npy`` (atomically); the record's ``extra["embeddings"]``."""
        if not self.keys:
            return None
        name = f"shards/{stage_dir_name}-{self.unit_id[:16]}{FILE_SUFFIX}"
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, np.stack(self.vectors))
        tmp.replace(path)
        return {"file": name, "sha256": _sha256(path), "fingerprint": self.fp_hash, "dim": int(self.vectors[0].size),
                "keys": self.keys, "ekeys": self.ekeys, "computed": self.computed, "reused": self.reused}


# ---------------------------------------------------------------------------------------------------------
# Searches: candidates for the exact re-check
# ---------------------------------------------------------------------------------------------------------


def _top_k(queries: np.ndarray, rows: np.ndarray, cos: np.ndarray, k: int, n_queries: int) -> np.ndarray:
    """Per query, the ``k`` rows of highest cosine among pairs ``(queries[i], rows[i])``: ``[n_queries, k]``,
    padded with -1."""
    out = np.full((n_queries, k), -1, np.int64)
    if not len(rows):
        return out
    order = np.lexsort((-cos, queries))
    queries, rows = queries[order], rows[order]
    starts = np.searchsorted(queries, np.arange(n_queries))
    rank = np.arange(len(queries)) - starts[queries]
    keep = rank < k
    out[queries[keep], rank[keep]] = rows[keep]
    return out


class ExactSearch:
    """Brute force over every stored vector (blocks of 65,536 rows): the reference, and the search of small
    indexes."""

    name = "exact"

    def __init__(self, vectors: Callable[[], np.ndarray]):
        self.vectors = vectors

    def add(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        pass  # searches the store itself

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        store = self.vectors()
        best_cos = np.full((len(queries), 0), -np.inf, np.float32)
        best_rows = np.zeros((len(queries), 0), np.int64)
        for start in range(0, len(store), 65536):
            block = np.asarray(store[start:start + 65536])
            cos = queries @ block.T
            best_cos = np.concatenate([best_cos, cos], axis=1)
            best_rows = np.concatenate([best_rows, np.broadcast_to(np.arange(start, start + len(block)),
                                                                   cos.shape)], axis=1)
            if best_cos.shape[1] > k:
                part = np.argpartition(-best_cos, k, axis=1)[:, :k]
                best_cos = np.take_along_axis(best_cos, part, 1)
                best_rows = np.take_along_axis(best_rows, part, 1)
        q = np.repeat(np.arange(len(queries)), best_rows.shape[1])
        return _top_k(q, best_rows.ravel(), best_cos.ravel(), k, len(queries))


class LshSearch:
    """Random-hyperplane LSH in numpy: ``TABLES`` tables of ``BITS`` sign bits per vector (``codes.u32``,
    append-only beside the vectors), each table's codes kept sorted with their rows (``codes-sorted.u32``,
    uint32 ``[2, TABLES, N]``, rewritten after an update: new codes are merged in, O(N) copying, instead of
    sorting every table again, O(N log N), at each open).

    A query reads, per table, the bucket of its top ``b`` bits and the ``b`` buckets one bit away (multi-probe),
    where ``b = log2(N)`` grows with the index (about one vector per bucket): a query reads about 300
    candidates whatever N is, and a pair at cosine 0.92 (23 degrees) lands in a probed bucket of at least one
    of 16 tables with probability >= 0.99 up to N = 10^6 (1 - (1 - q^b - b p q^(b-1))^16, p = 23/180,
    q = 1 - p, b = 20).
    """

    name = "lsh"
    TABLES = 16
    BITS = 24
    PER_BUCKET = 1
    SEED = 1234

    def __init__(self, dim: int, codes_path: Path, vectors: Callable[[], np.ndarray]):
        self.vectors = vectors
        rng = np.random.default_rng(self.SEED)
        self.planes = rng.standard_normal((dim, self.TABLES * self.BITS)).astype(np.float32)
        self.weights = (2.0 ** np.arange(self.BITS - 1, -1, -1))  # float64: exact below 2 ** 53, and BLAS
        self.path = codes_path
        self.codes = np.zeros((0, self.TABLES), np.uint32)
        if codes_path.is_file():
            self.codes = np.fromfile(codes_path, np.uint32).reshape(-1, self.TABLES)
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self.sorted_path = codes_path.with_name("codes-sorted.u32")
        self._dirty = False

    def hash(self, vectors: np.ndarray) -> np.ndarray:
        """``[n, TABLES]`` uint32 codes: the sign bits of each table's hyperplanes, first plane highest."""
        bits = (np.asarray(vectors, np.float32) @ self.planes > 0).reshape(len(vectors), self.TABLES, self.BITS)
        return (bits.astype(np.float64) @ self.weights).astype(np.uint32)

    def truncate(self, rows: int) -> None:
        """Forget codes beyond ``rows`` (a write that was not committed)."""
        if len(self.codes) > rows:
            self.codes = self.codes[:rows]
            with open(self.path, "r+b") as fh:
                fh.truncate(rows * self.TABLES * 4)
            self._sorted = None

    def add(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Hash and append the vectors of ``rows`` (the rows right after those already hashed)."""
        new = np.concatenate([self.hash(np.asarray(vectors[i:i + 65536])) for i in range(0, len(vectors), 65536)]
                             or [np.zeros((0, self.TABLES), np.uint32)])
        with open(self.path, "ab") as fh:
            fh.write(new.tobytes())
        first = len(self.codes)
        self.codes = np.concatenate([self.codes, new])
        if self._sorted is not None:
            self._sorted = self._merged(self._sorted, first)

    def _merged(self, tables: tuple[np.ndarray, np.ndarray], first: int) -> tuple[np.ndarray, np.ndarray]:
        """The sorted tables with the codes of rows ``first..`` merged in (each table stays sorted)."""
        codes_TN, perm_TN = tables
        new_TN = np.ascontiguousarray(self.codes[first:].T)
        rows = np.arange(first, len(self.codes), dtype=np.uint32)
        merged_codes, merged_perm = [], []
        for t in range(self.TABLES):
            order = np.argsort(new_TN[t], kind="stable")
            at = np.searchsorted(codes_TN[t], new_TN[t][order], "right")
            merged_codes.append(np.insert(codes_TN[t], at, new_TN[t][order]))
            merged_perm.append(np.insert(perm_TN[t], at, rows[order]))
        self._dirty = True
        return np.stack(merged_codes), np.stack(merged_perm)

    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Per table, contiguous ``[TABLES, N]``: the codes in order and their rows (uint32)."""
        if self._sorted is None:
            n = len(self.codes)
            stored = (np.fromfile(self.sorted_path, np.uint32) if self.sorted_path.is_file()
                      else np.zeros(0, np.uint32))
            held = stored.size // (2 * self.TABLES)
            if stored.size and held <= n and stored.size == 2 * self.TABLES * held:
                stored = stored.reshape(2, self.TABLES, held)
                self._sorted = (stored[0], stored[1])
                if held < n:
                    self._sorted = self._merged(self._sorted, held)
            else:  # none yet, or written past the committed rows: sort every table
                codes_TN = np.ascontiguousarray(self.codes.T)
                perm_TN = np.argsort(codes_TN, axis=1).astype(np.uint32)
                self._sorted = (np.ascontiguousarray(np.take_along_axis(codes_TN, perm_TN, 1)), perm_TN)
                self._dirty = True
        return self._sorted

    def save(self) -> None:
        """Write the sorted tables when they changed (atomically)."""
        if self._dirty and self._sorted is not None:
            tmp = self.sorted_path.with_name(self.sorted_path.name + ".tmp")
            with open(tmp, "wb") as fh:
                fh.write(np.stack(self._sorted).astype(np.uint32, copy=False).tobytes())
            tmp.replace(self.sorted_path)
            self._dirty = False

    def bits(self) -> int:
        return int(min(self.BITS, max(1, math.ceil(math.log2(max(2, len(self.codes)) / self.PER_BUCKET)))))

    def candidates(self, query_codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(query index, row)`` pairs of every probed bucket, each pair once (``query_codes``: the queries'
        :meth:`hash`)."""
        codes, perm = self._tables()
        b, n = self.bits(), len(self.codes)
        shift = np.uint32(self.BITS - b)
        prefix = query_codes >> shift  # [Q, T]
        flips = np.concatenate([[0], 1 << np.arange(b)]).astype(np.uint32)  # this bucket and b neighbours
        probes = prefix[:, :, None] ^ flips[None, None, :]  # [Q, T, b + 1]
        q_idx, t_idx = np.meshgrid(np.arange(len(query_codes)), np.arange(self.TABLES), indexing="ij")
        lo = np.empty(probes.shape, np.int64)
        hi = np.empty(probes.shape, np.int64)
        for t in range(self.TABLES):
            low = probes[:, t, :] << shift  # < 2 ** BITS: uint32 like the codes (no conversion of the table)
            lo[:, t, :] = np.searchsorted(codes[t], low, "left")
            hi[:, t, :] = np.searchsorted(codes[t], low + (np.uint32(1) << shift), "left")
        lengths = (hi - lo).ravel()
        total = int(lengths.sum())
        starts = np.repeat(lo.ravel() + np.repeat(t_idx.ravel(), probes.shape[2]) * n, lengths)
        offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        rows = perm.ravel()[starts + offsets]
        queries_of = np.repeat(np.repeat(q_idx.ravel(), probes.shape[2]), lengths)
        pairs = np.unique(queries_of.astype(np.int64) * n + rows)
        return pairs // n, pairs % n

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        """Per query, the ``k`` candidates nearest by Hamming distance over all ``TABLES * BITS`` sign bits
        (the angle estimate: 384 bits, about 3 degrees of error at 23), 64 bytes a candidate instead of its
        vector; the caller re-checks them with the exact cosine."""
        out = []
        for start in range(0, len(queries), 256):
            chunk = queries[start:start + 256]
            query_codes = self.hash(chunk)
            q, rows = self.candidates(query_codes)
            hamming = np.bitwise_count(self.codes[rows] ^ query_codes[q]).sum(axis=1, dtype=np.int32)
            out.append(_top_k(q, rows, -hamming.astype(np.float32), k, len(chunk)))
        return np.concatenate(out) if out else np.zeros((0, k), np.int64)


class UsearchSearch:
    """usearch's HNSW graph (cosine metric, f16 vectors), saved as ``hnsw.usearch`` after every update; the
    keys are row numbers."""

    name = "usearch"

    def __init__(self, dim: int, path: Path, vectors: Callable[[], np.ndarray], rows: int):
        from usearch.index import Index

        self.path = path
        self.index = Index(ndim=dim, metric="cos", dtype="f16", connectivity=16, expansion_add=64,
                           expansion_search=128)
        if path.is_file():
            self.index.load(str(path))
        held = len(self.index)
        if held > rows:  # saved after a write that was not committed: rebuild
            self.index = Index(ndim=dim, metric="cos", dtype="f16", connectivity=16, expansion_add=64,
                               expansion_search=128)
            held = 0
        if held < rows:
            self.add(np.arange(held, rows), np.asarray(vectors()[held:rows]))

    def add(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        if len(rows):
            self.index.add(rows.astype(np.uint64), np.asarray(vectors, np.float32), threads=0)

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.index.save(str(tmp))
        tmp.replace(self.path)

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        found = self.index.search(np.asarray(queries, np.float32), k, threads=0)
        out = np.full((len(queries), k), -1, np.int64)
        if not hasattr(found, "counts"):  # one query: usearch answers with Matches, not BatchMatches
            keys = np.asarray(found.keys, np.int64).reshape(-1)[:k]
            out[0, :len(keys)] = keys
            return out
        keys = np.asarray(found.keys, np.int64).reshape(len(queries), -1)
        for i, c in enumerate(np.asarray(found.counts).reshape(-1)):
            out[i, :c] = keys[i, :c]
        return out


def usearch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("usearch") is not None


# ---------------------------------------------------------------------------------------------------------
# The persistent index and the decisions
# ---------------------------------------------------------------------------------------------------------


class NearDupIndex:
    """Every entered embedding of one embedder, in entry order, and the decisions per threshold.

    Folder ``prep/curate/neardup/<embedder hash[:16]>/``: ``vectors.f32`` (float32 ``[N, D]``, append-only),
    ``codes.u32`` (LSH codes), ``hnsw.usearch`` (with usearch) and ``index.sqlite``: ``entries(row, key, batch,
    aesthetic)``, ``units(unit_id)`` (curate records entered), ``decisions(threshold, row, owner, cosine)``
    (near duplicates only; a decided row without one is kept) and ``decided(threshold, rows)`` (rows
    ``[0, rows)`` are decided at that threshold). A write appends vectors first and commits the rows in SQLite
    last: vectors past the committed count are cut at the next open.
    """

    def __init__(self, folder: Path, dim: int, kind: str = "auto"):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.dim, self.kind = folder, dim, kind
        self.db = sqlite3.connect(str(folder / "index.sqlite"))
        self.db.executescript(
            "CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);"
            "CREATE TABLE IF NOT EXISTS entries (row INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL,"
            " batch INTEGER NOT NULL, aesthetic REAL);"
            "CREATE TABLE IF NOT EXISTS units (unit_id TEXT PRIMARY KEY);"
            "CREATE TABLE IF NOT EXISTS decisions (threshold REAL NOT NULL, row INTEGER NOT NULL,"
            " owner INTEGER NOT NULL, cosine REAL NOT NULL, PRIMARY KEY (threshold, row));"
            "CREATE TABLE IF NOT EXISTS decided (threshold REAL PRIMARY KEY, rows INTEGER NOT NULL);")
        stored = self.db.execute("SELECT v FROM meta WHERE k = 'dim'").fetchone()
        if stored is not None and int(stored[0]) != dim:
            raise ValueError(f"{folder}: the index holds {stored[0]}-dim embeddings, not {dim}")
        with self.db:
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('dim', ?)", (str(dim),))
        self.rows = self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        self.vector_path = folder / "vectors.f32"
        with open(self.vector_path, "ab") as fh:  # cut what a killed write left past the committed rows
            fh.truncate(self.rows * dim * 4)
        self._store: np.ndarray | None = None
        self._search: Any = None
        self.vectors_read = 0  # rows read from the store (exact re-checks and searches do not count)

    # -- the store ------------------------------------------------------------------------------------------

    def store(self) -> np.ndarray:
        if self._store is None or len(self._store) != self.rows:
            self._store = (np.memmap(self.vector_path, np.float32, "r", shape=(self.rows, self.dim))
                           if self.rows else np.zeros((0, self.dim), np.float32))
        return self._store

    def search_kind(self) -> str:
        """The search in use for the index's present size: ``auto`` and ``lsh`` search by brute force below
        ``EXACT_BELOW`` vectors (it is faster there), by LSH from there on; usearch only when asked for."""
        if self.kind in ("auto", "lsh") and self.rows < EXACT_BELOW:
            return "exact"
        return "lsh" if self.kind == "auto" else self.kind

    def searcher(self):
        kind = self.search_kind()
        if self._search is None or self._search.name != kind:
            if kind == "usearch":
                self._search = UsearchSearch(self.dim, self.folder / "hnsw.usearch", self.store, self.rows)
            elif kind == "lsh":
                self._search = LshSearch(self.dim, self.folder / "codes.u32", self.store)
                self._search.truncate(self.rows)
                if len(self._search.codes) < self.rows:
                    done = len(self._search.codes)
                    self._search.add(np.arange(done, self.rows), self.store()[done:self.rows])
            else:
                self._search = ExactSearch(self.store)
        return self._search

    @staticmethod
    def _peek(folder: Path, sql: str) -> list[tuple]:
        """Rows of ``sql`` in the index in ``folder``, without creating it (none when there is none yet)."""
        path = folder / "index.sqlite"
        if not path.is_file():
            return []
        db = sqlite3.connect(str(path))
        try:
            return db.execute(sql).fetchall()
        except sqlite3.OperationalError:  # created but its tables not yet
            return []
        finally:
            db.close()

    @staticmethod
    def entered_units_in(folder: Path) -> set[str]:
        """The curate records entered into the index in ``folder`` (none when there is no index yet)."""
        return {u for (u,) in NearDupIndex._peek(folder, "SELECT unit_id FROM units")}

    @staticmethod
    def stored_dim(folder: Path) -> int | None:
        """The embedding width of the index in ``folder`` (None when there is none yet)."""
        rows = NearDupIndex._peek(folder, "SELECT v FROM meta WHERE k = 'dim'")
        return int(rows[0][0]) if rows else None

    def known(self, keys: list[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(keys), 500):
            part = keys[start:start + 500]
            found.update(k for (k,) in self.db.execute(
                f"SELECT key FROM entries WHERE key IN ({','.join('?' * len(part))})", part))
        return found

    def enter(self, keys: list[str], vectors: np.ndarray, aesthetic: list[Optional[float]],
              unit_ids: list[str]) -> int:
        """Append one batch (in order); returns its number. Vectors first, then the rows in SQLite."""
        batch = (self.db.execute("SELECT MAX(batch) FROM entries").fetchone()[0] or 0) + 1
        rows = np.arange(self.rows, self.rows + len(keys))
        if len(keys):
            with open(self.vector_path, "ab") as fh:
                fh.write(np.ascontiguousarray(vectors, np.float32).tobytes())
        with self.db:
            self.db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?)",
                                [(int(r), k, batch, a) for r, k, a in zip(rows, keys, aesthetic)])
            self.db.executemany("INSERT OR IGNORE INTO units VALUES (?)", [(u,) for u in unit_ids])
        self.rows += len(keys)
        if len(keys) and self._search is not None and self._search.name == self.search_kind():
            self._search.add(rows, vectors)
        return batch

    # -- decisions --------------------------------------------------------------------------------------------

    def decided_rows(self, threshold: float) -> int:
        row = self.db.execute("SELECT rows FROM decided WHERE threshold = ?", (threshold,)).fetchone()
        return int(row[0]) if row else 0

    def decide(self, threshold: float, k: int = NEIGHBOURS) -> int:
        """Decide every row not yet decided at ``threshold``, batch by batch; returns how many rows."""
        start = self.decided_rows(threshold)
        if start >= self.rows:
            return 0
        owner = np.full(self.rows, -1, np.int64)
        for r, o in self.db.execute("SELECT row, owner FROM decisions WHERE threshold = ? AND row < ?",
                                    (threshold, start)):
            owner[r] = o
        batches = self.db.execute("SELECT batch, MIN(row), MAX(row) + 1 FROM entries WHERE row >= ? "
                                  "GROUP BY batch ORDER BY batch", (start,)).fetchall()
        store, search = self.store(), self.searcher()
        for _, lo, hi in batches:
            vectors = np.asarray(store[lo:hi])
            neighbours = search.search(vectors, min(k, self.rows))
            aesthetic = dict(self.db.execute("SELECT row, aesthetic FROM entries WHERE row >= ? AND row < ? "
                                             "AND aesthetic IS NOT NULL", (lo, hi)).fetchall())
            # the keep rule: highest aesthetic first (samples with one before those without), then entry order
            order = sorted(range(lo, hi), key=lambda r: (r not in aesthetic, -aesthetic.get(r, 0.0), r))
            visited = np.zeros(hi - lo, bool)
            found = []
            for r in order:
                cands = set()
                for n in neighbours[r - lo]:
                    if n < 0 or n == r or n >= hi or (n >= lo and not visited[n - lo]):
                        continue  # none, itself, a later batch, or a batch-mate of lower priority
                    cands.add(int(owner[n]) if owner[n] >= 0 else int(n))
                visited[r - lo] = True
                if not cands:
                    continue
                rows = np.array(sorted(cands))
                cos = np.asarray(store[rows]) @ vectors[r - lo]
                best = int(np.argmax(cos))
                if cos[best] >= threshold:
                    owner[r] = rows[best]
                    found.append((threshold, r, int(rows[best]), round(float(cos[best]), 6)))
            with self.db:
                self.db.executemany("INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?)", found)
                self.db.execute("INSERT OR REPLACE INTO decided VALUES (?, ?)", (threshold, hi))
        if isinstance(self._search, (UsearchSearch, LshSearch)):
            self._search.save()
        return self.rows - start

    def duplicates(self, threshold: float, keys: list[str]) -> dict[str, tuple[str, float]]:
        """Sample key -> (owner key, cosine) of the near duplicates among ``keys`` at ``threshold``."""
        return _duplicates(self.db, threshold, keys)

    def close(self) -> None:
        if isinstance(self._search, (UsearchSearch, LshSearch)):
            self._search.save()
        self.db.close()


# ---------------------------------------------------------------------------------------------------------
# Wiring: the prep's update after the curate stage, the bucket stage's view
# ---------------------------------------------------------------------------------------------------------

NEARDUP_DIR = "neardup"


def index_folder(curate_root: Path, fingerprint: dict[str, Any]) -> Path:
    return curate_root / NEARDUP_DIR / stable_hash(fingerprint)[:16]


def _manifest_order(records: Iterable[UnitRecord], skip: set[str]) -> Iterator[UnitRecord]:
    """The records not in ``skip``, in manifest order: by the name of the first upstream shard each read
    (units group upstream shards in name order), then unit id. Holds one record at a time when ``records``
    is a :class:`~latentmill.stages.shardio.StageRecords` (the order is found in a first pass)."""
    order = sorted(((r.extra.get("upstream") or [""])[0], r.unit_id) for r in records if r.unit_id not in skip)
    load = records.load if isinstance(records, StageRecords) else {r.unit_id: r for r in records}.__getitem__
    return (load(unit_id) for _, unit_id in order)


def update(curate_root: Path, records: Iterable[UnitRecord], fingerprint: dict[str, Any], threshold: float,
           kind: str = "auto") -> dict[str, Any]:
    """Enter the samples of the stage's records that the index does not hold yet (one batch, manifest
    order) and decide every row not yet decided at ``threshold``. Reads the embedding files of records not
    entered before only. Returns the run summary's ``near_duplicates``."""
    start = time.perf_counter()
    fp_hash = stable_hash(fingerprint)
    folder = index_folder(curate_root, fingerprint)
    done_units = NearDupIndex.entered_units_in(folder)
    # records not entered before, with the embedder's embeddings
    todo = ((r, r.extra["embeddings"]) for r in _manifest_order(records, done_units)
            if (r.extra.get("embeddings") or {}).get("fingerprint") == fp_hash)
    first = next(todo, None)
    # nothing new to enter: the index's own width (a CLIP embedder's is not the thumbnail's)
    dim = int(first[1]["dim"]) if first is not None else (NearDupIndex.stored_dim(folder)
                                                          or THUMB_SIDE * THUMB_SIDE * 3)
    index = NearDupIndex(folder, dim, kind)
    try:
        keys: list[str] = []
        vectors: list[np.ndarray] = []
        aesthetic: list[Optional[float]] = []
        units_read: list[str] = []
        for record, emb in itertools.chain([first] if first is not None else [], todo):
            units_read.append(record.unit_id)
            known = index.known(emb["keys"])
            new = [i for i, key in enumerate(emb["keys"]) if key not in known and key not in keys]
            if not new:
                continue
            path = curate_root / emb["file"]
            if _sha256(path) != emb["sha256"]:
                raise RuntimeError(f"{path}: its sha256 differs from the one its unit record names")
            array = np.load(path)
            index.vectors_read += len(array)
            scores = unit_detail(curate_root, record.extra).get("scores") or {}
            by_video = video_aesthetics(scores)
            for i in new:
                keys.append(emb["keys"][i])
                vectors.append(array[i])
                aesthetic.append((scores.get(emb["keys"][i]) or {}).get("values", {}).get("aesthetic",
                                                                                         by_video.get(emb["keys"][i])))
        index.enter(keys, np.stack(vectors) if vectors else np.zeros((0, dim), np.float32), aesthetic,
                    units_read)
        decided = index.decide(threshold)
        new_dups = len(index.duplicates(threshold, keys)) if keys else 0
        return {"threshold": threshold, "embedder": fp_hash[:16], "search": index.search_kind(),
                "entered": len(keys), "units_read": len(units_read), "vectors_read": index.vectors_read,
                "decided": decided, "indexed": index.rows, "new_near_duplicates": new_dups,
                "near_duplicates": index.db.execute("SELECT COUNT(*) FROM decisions WHERE threshold = ?",
                                                    (threshold,)).fetchone()[0],
                "seconds": round(time.perf_counter() - start, 3)}
    finally:
        index.close()


def video_aesthetics(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Video key -> the mean ``aesthetic`` of its clips, for videos the curate stage scored per clip (their
    rows are the clips', each naming its ``video``): the keep rule's score of a video."""
    found: dict[str, list[float]] = {}
    for row in rows.values():
        value = (row.get("values") or {}).get("aesthetic")
        if row.get("video") and value is not None:
            found.setdefault(row["video"], []).append(float(value))
    return {video: float(np.mean(values)) for video, values in found.items()}


def decisions_for(curate_root: Path, fingerprint: dict[str, Any], threshold: float,
                  keys: list[str]) -> dict[str, tuple[str, float]]:
    """Sample key -> (owner key, cosine) for the near duplicates among ``keys`` (none without an index)."""
    folder = index_folder(curate_root, fingerprint)
    if not (folder / "index.sqlite").is_file():
        return {}
    db = sqlite3.connect(str(folder / "index.sqlite"))
    try:
        return _duplicates(db, threshold, keys)
    finally:
        db.close()


def _duplicates(db: sqlite3.Connection, threshold: float, keys: list[str]) -> dict[str, tuple[str, float]]:
    sql = ("SELECT e.key, o.key, d.cosine FROM decisions d JOIN entries e ON e.row = d.row "
           "JOIN entries o ON o.row = d.owner WHERE d.threshold = ?")
    found: dict[str, tuple[str, float]] = {}
    for start in range(0, len(keys), 500):
        part = keys[start:start + 500]
        found.update({k: (o, c) for k, o, c in db.execute(
            sql + f" AND e.key IN ({','.join('?' * len(part))})", (threshold, *part))})
    return found
