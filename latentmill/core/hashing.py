"""Content hashes and canonical JSON: the bytes every unit id, fingerprint, record and sample json is made of.

``stable_hash`` (over ``canonical_json``) names work units and fingerprints, ``json_bytes`` encodes records
and index tables, ``meta_bytes`` a sample's ``json`` member, ``sha256_*`` shards, indexes and input files.
Changing any of them changes every unit id, so they live together, on the ground floor (``latentmill.core``):
the stages, the trainer, the pipelines and the model fingerprints all build on it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    return _file_digest(hashlib.sha256(), path, chunk)


def md5_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex MD5 of a file, read in chunks: what object stores give as an object's checksum (not for security)."""
    return _file_digest(hashlib.md5(usedforsecurity=False), path, chunk)


def _file_digest(h: Any, path: str | Path, chunk: int) -> str:
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str) without building an encoder per call
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)


def canonical_json(obj: Any) -> str:
    """The JSON text :func:`stable_hash` hashes: sorted keys, no spaces, ASCII, ``str()`` of anything else.
    A dict's text is its values' texts joined in key order, so a part can be encoded once and reused."""
    return _CANONICAL.encode(obj)


def stable_hash(obj: Any) -> str:
    """Hash of a JSON-able object, independent of dict order."""
    return sha256_bytes(canonical_json(obj).encode())


def json_bytes(obj: Any) -> bytes:
    """Canonical JSON encoding used for every metadata member and record."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):  # scalars are taken as they are, without a call each (a json per sample)
        return {k: _without_nulls(v) if isinstance(v, (dict, list)) else v for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) if isinstance(v, (dict, list)) else v for v in value]
    return value


def meta_bytes(meta: dict[str, Any]) -> bytes:
    """A sample's ``json`` member: canonical JSON without null fields (an absent field reads as None).

    Hugging Face ``datasets`` types each field from a shard's first samples: a field that is null there and
    a string later fails to load, one that is absent there is only left out.
    """
    return json_bytes(_without_nulls(meta))
