"""Model fingerprints: the hash of a model component's config and weight files that travels with every latent.

Everything that records or checks which weights produced a latent, a caption or a score goes through
:func:`component_fingerprint` (a folder of files) or :func:`file_fingerprint` (one file), so cache keys follow
the component actually used (contract 5). Weight-file digests are remembered per process (by the file's
identity) and across runs (a :class:`~latentmill.core.filehashes.FileHashes` store at :func:`hash_store_path`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from latentmill.core.filehashes import FileHashes
from latentmill.core.hashing import sha256_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt")  # the files a fingerprint covers


@dataclass(frozen=True)
class ComponentSource:
    """Arguments for ``Cls.from_pretrained(path, subfolder=...)``."""

    path: str
    subfolder: Optional[str]

    @property
    def is_local(self) -> bool:
        return Path(self.path).is_dir()

    def kwargs(self) -> dict[str, Any]:
        return {"subfolder": self.subfolder} if self.subfolder else {}


def component_dir(src: ComponentSource) -> Path:
    """The local folder of a component: its own folder, or for a hub id the files of the local HF cache that
    the user's ``from_pretrained`` call uses."""
    if src.is_local:
        root = Path(src.path)
    else:
        from huggingface_hub import snapshot_download

        pattern = f"{src.subfolder}/*" if src.subfolder else "*"
        root = Path(snapshot_download(src.path, allow_patterns=[pattern]))
    return root / src.subfolder if src.subfolder else root


_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()


def forget_digests() -> int:
    """Forget the weight-file digests this process took (the store on disk keeps its own); how many."""
    with _memo_lock:
        count = len(_memo)
        _memo.clear()
    return count


def hash_store_path() -> Path:
    """Where weight-file digests are remembered across runs: ``$LATENTMILL_HASH_STORE``, else
    ``$XDG_CACHE_HOME/latentmill/weight-hashes.sqlite`` (``~/.cache`` by default)."""
    if os.environ.get("LATENTMILL_HASH_STORE"):
        return Path(os.environ["LATENTMILL_HASH_STORE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "latentmill" / "weight-hashes.sqlite"


def _file_sha(path: Path, store=None) -> str:
    st = path.stat()
    # the file itself (device and inode, whatever path or link leads to it) as it is now (size, mtime): no
    # ``resolve`` (a syscall per path component) to find a digest this process has taken
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    if store is None:
        digest = sha256_file(path, chunk=1 << 22)
    else:
        digest = store.sha256(path.resolve())
    with _memo_lock:
        _memo[key] = digest
    return digest


class _StoreOnDemand:
    """The weight-hash store (``FileHashes`` at :func:`hash_store_path`), opened on the first digest this
    process has not memoised: fingerprinting a loaded model again (a curate scorer's, once per batch) then
    costs a ``stat`` per file, not a SQLite connection."""

    def __init__(self) -> None:
        self.store = None

    def sha256(self, path: Path) -> str:
        if self.store is None:
            self.store = FileHashes(hash_store_path())
        return self.store.sha256(path)

    def close(self) -> None:
        """Remember what was hashed (a read-only home: only for this process) and close the store."""
        if self.store is not None:
            self.store.save(forget_unused=False)
            self.store.close()
            self.store = None


def component_fingerprint(src: ComponentSource) -> str:
    """Hash of a component's config and weight files (names and bytes), independent of where it lives."""
    root = component_dir(src)
    if not root.is_dir():
        raise FileNotFoundError(f"model component folder {root} does not exist")
    # Digests of unchanged weight files are remembered on disk (hash_store_path): a FLUX.1-dev-sized
    # set is ~30 GB, which a prep would otherwise read in full on every run just to fingerprint it.
    store = _StoreOnDemand()
    try:
        entries = []
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES):
                entries.append((path.relative_to(root).as_posix(), _file_sha(path, store)))
    finally:
        store.close()
    if not entries:
        raise FileNotFoundError(f"no config or weight files under {root}")
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 of one weight file (a scorer head), remembered like :func:`component_fingerprint`'s digests."""
    store = _StoreOnDemand()
    try:
        return _file_sha(Path(path), store)
    finally:
        store.close()
