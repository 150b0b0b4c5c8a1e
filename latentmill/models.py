"""Where each model component comes from, and the fingerprint that travels with every latent.

A recipe names a Diffusers pipeline (``model.pretrained``: a local folder or a hub id such as
``black-forest-labs/FLUX.1-dev``) and may override single components (``model.vae=PATH``). Everything that
loads a component goes through :func:`component_source`, and everything that records or checks which
weights produced a latent goes through :func:`component_fingerprint`, so cache keys follow the component
actually used (contract 5).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

# Components whose outputs are cached; the trainer never loads them.
CACHED_COMPONENTS = ("vae", "text_encoder", "text_encoder_2")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt")


class CacheMismatchError(RuntimeError):
    """Cached latents were produced by other models or settings than the recipe asks for."""


@dataclass
class ModelConfig:
    """Which pretrained pipeline to use, with optional per-component overrides."""

    pretrained: str
    family: Literal["auto", "flux", "wan"] = "auto"  # auto: read from the pipeline's model_index.json
    vae: Optional[str] = None
    text_encoder: Optional[str] = None
    text_encoder_2: Optional[str] = None
    # A tiny-model recipe (e.g. data/tiny-flux.yaml): build `pretrained` from it when the folder is missing.
    tiny_recipe: Optional[str] = None


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


def component_source(model: ModelConfig, name: str) -> ComponentSource:
    """Resolve component ``name`` (``vae``, ``text_encoder``, ``tokenizer``...) to a loadable source."""
    override = getattr(model, name, None)
    if override:
        # An override is either a component folder itself or a pipeline folder that has the subfolder.
        if (Path(override) / name / "config.json").is_file():
            return ComponentSource(override, name)
        return ComponentSource(override, None)
    return ComponentSource(model.pretrained, name)


def _local_dir(src: ComponentSource) -> Path:
    if src.is_local:
        root = Path(src.path)
    else:  # a hub id: the files the user's from_pretrained call uses, from the local HF cache
        from huggingface_hub import snapshot_download

        pattern = f"{src.subfolder}/*" if src.subfolder else "*"
        root = Path(snapshot_download(src.path, allow_patterns=[pattern]))
    return root / src.subfolder if src.subfolder else root


_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()


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
        from latentmill.stages.hashing import sha256_file

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
            from latentmill.stages.filehashes import FileHashes

            self.store = FileHashes(hash_store_path())
        return self.store.sha256(path)

    def close(self) -> None:
        """Remember what was hashed (a read-only home: only for this process) and close the store."""
        if self.store is not None:
            self.store.save(forget_unused=False)
            self.store.close()
            self.store = None


class LoadedOnce:
    """Models (or anything costly to load) kept once per process by key: the threads of one worker share
    them, and a key that changes (a changed folder's fingerprint) loads anew. ``release`` forgets them all
    (``pipelines.prep.release_prep_models``)."""

    def __init__(self) -> None:
        self._items: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, load: Any) -> Any:
        """The item under ``key``, made by ``load()`` the first time."""
        with self._lock:
            if key not in self._items:
                self._items[key] = load()
            return self._items[key]

    def release(self) -> int:
        """Forget every item; returns how many there were."""
        with self._lock:
            count = len(self._items)
            self._items.clear()
        return count


def component_fingerprint(src: ComponentSource) -> str:
    """Hash of a component's config and weight files (names and bytes), independent of where it lives."""
    root = _local_dir(src)
    if not root.is_dir():
        raise FileNotFoundError(f"model component folder {root} does not exist")
    # Digests of unchanged weight files are remembered on disk (hash_store_path): a FLUX.1-dev-sized
    # set is ~30 GB, which a prep would otherwise read in full on every run just to fingerprint it.
    store = _StoreOnDemand()
    try:
        entries = []
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
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


def read_component_config(src: ComponentSource) -> dict[str, Any]:
    """The component's ``config.json`` as a dict."""
    return json.loads((_local_dir(src) / "config.json").read_text())


# A text encoder's output depends on its tokenizer too, so the tokenizer joins its fingerprint.
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}


def tokenizer_source(model: ModelConfig, encoder: str) -> ComponentSource:
    """Where the tokenizer of text encoder ``encoder`` lives: beside an override, else in the pipeline."""
    name = TOKENIZER_OF[encoder]
    override = getattr(model, encoder, None)
    if override and (Path(override) / name).is_dir():
        return ComponentSource(override, name)
    return ComponentSource(model.pretrained, name)


def cached_model_fingerprints(model: ModelConfig, components: tuple[str, ...] = CACHED_COMPONENTS) -> dict[str, str]:
    """Fingerprints of the components whose outputs the cache stores (text encoders with tokenizers)."""
    prints = {}
    for name in components:
        fp = component_fingerprint(component_source(model, name))
        if name in TOKENIZER_OF:
            fp = hashlib.sha256((fp + component_fingerprint(tokenizer_source(model, name))).encode()).hexdigest()
        prints[name] = fp
    return prints


def check_cache_compatible(manifest: dict[str, Any], model: ModelConfig) -> None:
    """Refuse a latent cache whose producing models differ from the recipe's, saying what differs."""
    recorded = manifest.get("models") or {}
    expected = cached_model_fingerprints(model, tuple(recorded) or CACHED_COMPONENTS)
    problems = []
    family = manifest.get("family", "flux")
    if model.family != "auto" and model.family != family:
        problems.append(f"family: cache holds {family!r} latents, recipe's model.family is {model.family!r}")
    for name, fp in expected.items():
        have = (recorded.get(name) or {}).get("fingerprint")
        if have != fp:
            src = component_source(model, name)
            where = os.path.join(src.path, src.subfolder or "")
            problems.append(
                f"{name}: cache was made with fingerprint {str(have)[:12]}, recipe's {where} is {fp[:12]}"
            )
    if problems:
        raise CacheMismatchError(
            "the latent cache does not match the recipe's models:\n  "
            + "\n  ".join(problems)
            + "\nRe-run `latentmill prep` with this recipe to re-encode (only the changed components are "
            "redone), or point model.* at the models that made the cache."
        )
