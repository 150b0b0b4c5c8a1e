"""Durable writes (``latentmill.core.durable``): whole or old, the file and its folder fsync'd, no temporaries.

The pointers and manifests that training reads (``snapshots/LATEST``, a snapshot's ``manifest.json``,
``train/LATEST``) are written through it, like the unit records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from latentmill.core import durable


@pytest.fixture()
def fsynced(monkeypatch) -> list[str]:
    """The paths that ``os.fsync`` was called on (a file, or a folder for its entries), in order."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_write_syncs_the_file_then_its_folder_and_leaves_no_temporary(tmp_path, fsynced):
    path = tmp_path / "record.json"
    durable.write_json(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == json.dumps({"b": 1, "a": [1, 2]}, indent=1, sort_keys=True)
    assert [Path(p).name for p in fsynced] == [Path(fsynced[0]).name, tmp_path.name]
    assert fsynced[0].endswith(".tmp") and fsynced[1] == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_failed_write_keeps_the_old_file_whole(tmp_path):
    path = tmp_path / "LATEST"
    durable.write_text(path, "0001-old\n")
    with pytest.raises(TypeError):
        durable.write_bytes(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_text() == "0001-old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_symlink_replaces_a_link_durably(tmp_path, fsynced):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "current"
    durable.symlink(link, tmp_path / "a")
    durable.symlink(link, tmp_path / "b")
    assert os.readlink(link) == "b" and link.resolve() == (tmp_path / "b").resolve()
    assert fsynced == [str(tmp_path), str(tmp_path)]


def test_a_published_snapshot_and_its_pointer_are_on_disk_before_publish_returns(tmp_path, fsynced):
    from latentmill.pipelines.snapshot import publish

    from .trainer_helpers import write_fake_cache

    out = tmp_path / "out"
    write_fake_cache(out / "prep" / "cache", {(64, 64, 1): 3})
    fsynced.clear()  # the cache's own writes: only the publication is looked at
    name = publish(out, out / "prep" / "cache")["name"]
    snapshots = out / "snapshots"
    assert (snapshots / "LATEST").read_text() == name + "\n"
    manifest = json.loads((snapshots / name / "manifest.json").read_text())
    assert manifest["snapshot"]["samples"] == 3
    # the manifest, its temporary folder's entry, the renamed folder's entry, then LATEST and its entry
    folder = snapshots / f".{name}.tmp"
    assert [Path(p).parent for p in fsynced] == [folder, snapshots, out, snapshots, out]
    assert Path(fsynced[0]).name.startswith(".manifest.json.") and fsynced[1:3] == [str(folder), str(snapshots)]
    assert Path(fsynced[3]).name.startswith(".LATEST.") and fsynced[4] == str(snapshots)
    assert {p.name for p in snapshots.iterdir()} == {"LATEST", name}
