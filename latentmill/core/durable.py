"""Durable, atomic writes: a reader sees the old file or the whole new one, also after a power cut.

A file is written under a temporary name unique to this host, process and thread, fsync'd, renamed over its
final name, and then its folder is fsync'd so that the rename itself is on disk. Unit records, index files,
snapshot manifests and the ``LATEST`` pointers that training reads all go through here.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any


def temporary_name(path: Path) -> Path:
    """A sibling of ``path`` that no other host, process or thread writing the same path uses."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")


def fsync_dir(folder: str | Path) -> None:
    """Make the entries of ``folder`` (a rename, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically and durably."""
    write_bytes(path, text.encode())


def write_json(path: str | Path, obj: Any, *, indent: int | None = 1, sort_keys: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` atomically and durably (``json.dumps`` with these arguments)."""
    write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys))


def replace(src: str | Path, dst: str | Path) -> None:
    """Rename ``src`` over ``dst`` (a file or folder whose contents are already fsync'd), durably."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def symlink(link: str | Path, target: str | Path) -> None:
    """Point ``link`` at ``target`` (relative to the link's folder), replacing it atomically and durably."""
    link = Path(link)
    tmp = temporary_name(link)
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    replace(tmp, link)
