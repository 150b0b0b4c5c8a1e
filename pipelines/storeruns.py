"""Training runs of an output on an object store: the run folder lives in the local work folder
(``latentmill.core.store.work_dir_for``) and is published to the store while it trains (docs/object-stores.md).

:func:`pull_runs` brings a fresh machine the runs the store holds (what a resume reads); :class:`RunPublisher`
uploads a run's files phase after phase (checkpoint parts, then a checkpoint's ``trainer_state.json`` once the
checkpoint is whole on the store, then the run's other files, ``LATEST`` last) and deletes what was pruned. On
several nodes, each in a work folder of its own, every node publishes its ranks' checkpoint parts and the node
of global rank 0 the rest.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from latentmill.pipelines.objectstore import (
    LOCAL_SUFFIXES,
    PUBLISH_EVERY_S,
    PULLING,
    Publisher,
    StoreLease,
    all_local_files,
    store_listing,
)
from latentmill.pipelines.snapshot import LATEST

from latentmill.core.store import join, store_fs


def run_file(rel: str) -> bool:
    """Whether the work folder's file ``rel`` belongs to the training runs (``train/``, ``train-<expert>/``)."""
    return rel.split("/", 1)[0].startswith("train") and "/" in rel and not rel.endswith(LOCAL_SUFFIXES)


def run_phase(rel: str) -> int:
    """The order in which a run's file is published: checkpoint parts (0), a checkpoint's
    ``trainer_state.json`` (1: what makes it complete for ``resume``), the run's other files (2), the
    ``LATEST`` pointer (3)."""
    from latentmill.trainer.checkpoint import STATE_FILE

    parts = rel.split("/")
    if len(parts) == 2 and parts[1] == LATEST:
        return 3
    if "checkpoints" in parts[:-1]:
        return 1 if parts[-1] == STATE_FILE else 0
    return 2


def pull_runs(url: str, work: Path) -> dict[str, Any]:
    """Download the store's training-run files that the work folder lacks (a fresh machine resuming a run
    finds its checkpoints); ``{"downloaded", "bytes"}``. What this machine holds already is its own truth."""
    fs, root = store_fs(url)
    remote, local, size = [], [], 0
    for rel, info in sorted(store_listing(fs, root).items()):
        path = work / rel
        if not run_file(rel) or path.exists() or path.is_symlink():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        remote.append(join(root, rel))
        local.append(str(path) + PULLING)
        size += int(info.get("size") or 0)
    if remote:
        fs.get(remote, local)
        for tmp in local:
            os.replace(tmp, tmp[: -len(PULLING)])
    return {"downloaded": len(remote), "bytes": size}


RANK0_MARKER = ".global-rank-0"  # global rank 0 marks its node's run folder (pipelines.launch); never published
HOLD_S = 60.0  # how long a run's last publishing waits for the other nodes' parts of its checkpoints


def checkpoint_folder(rel: str) -> str | None:
    """``train/runs/R/checkpoints/step-N`` for a file below that folder, else None."""
    from latentmill.trainer.checkpoint import STEP_DIR

    parts = rel.split("/")
    for i, part in enumerate(parts[:-2]):
        if part == "checkpoints" and STEP_DIR.match(parts[i + 1]):
            return "/".join(parts[: i + 2])
    return None


def checkpoint_needs(folder: Path) -> set[str]:
    """The files (``/`` paths in the checkpoint ``folder``) that make it whole: every rank's RNG file (the
    ``world_size`` ranks its ``trainer_state.json`` names) and every file a DCP ``.metadata`` in it names
    (``FileSystemReader.read_metadata().storage_data``), with the metadata."""
    from latentmill.trainer.checkpoint import DCP_DIR, STATE_FILE, read_trainer_state, rng_file

    world = int(read_trainer_state(folder).get("world_size") or 0)  # 0: a state that names no ranks
    needs = {rng_file(rank) for rank in range(world)}
    for metadata in sorted(folder.rglob(".metadata")):
        if metadata.parent.name != DCP_DIR:
            continue
        from torch.distributed.checkpoint import FileSystemReader

        dcp = metadata.parent.relative_to(folder).as_posix()
        needs.add(f"{dcp}/.metadata")
        needs.update(f"{dcp}/{info.relative_path}"
                     for info in FileSystemReader(str(metadata.parent)).read_metadata().storage_data.values())
    needs.discard(STATE_FILE)
    return needs


class RunPublisher(Publisher):
    """Publishes the training runs of a work folder to the store while they train: every ``every_s`` seconds
    in a thread, and once more when stopped (a run killed midway leaves its checkpoints there). A checkpoint's
    ``trainer_state.json`` goes only once every file that makes it whole is on the store (:func:`checkpoint_needs`:
    every rank's RNG file, every shard its DCP metadata names, whichever node wrote them), so one found on the
    store is whole; the last round waits up to ``hold_s`` for them. Checkpoints pruned here (``keep_latest_k``)
    are deleted there, ``trainer_state.json`` first, then the whole folder (every node's parts); so are run files
    the store holds and this folder lacks when it starts: ``pull_runs`` brings every one in first. Links
    (``metrics.jsonl``, the export links) are not published: ``run.json`` and ``LATEST`` name the folders.
    ``lease``: the training lease; a run that lost it publishes nothing more (:class:`LostLease` at its end).

    ``run_dir``: the run folder of a training on several nodes, each in its own work folder. This node publishes
    the checkpoint parts its ranks wrote; the run's other files, the ``trainer_state.json`` files and every
    deletion only once global rank 0 has marked ``run_dir`` as its node's (:data:`RANK0_MARKER`). None: one node,
    which holds every rank."""

    def __init__(self, work: Path, url: str, every_s: float = PUBLISH_EVERY_S, lease: StoreLease | None = None,
                 run_dir: Path | None = None, hold_s: float = HOLD_S):
        super().__init__(every_s, "latentmill-publish-runs")
        self.work, self.url, self.lease, self.run_dir, self.hold_s = work, url, lease, run_dir, hold_s
        self.fs, self.root = store_fs(url)
        self.sent: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) of the copy on the store
        self.held: list[str] = []  # trainer_state.json files whose checkpoints are not whole on the store yet
        self.pruned: dict[str, float] = {}  # checkpoint folders deleted on the store, and when (time.monotonic)
        self.uploaded = 0
        self._lock = threading.Lock()

    @property
    def main(self) -> bool:
        """Whether this node holds global rank 0 (it alone publishes the run's files and deletes)."""
        return self.run_dir is None or (self.run_dir / RANK0_MARKER).is_file()

    def _files(self) -> dict[str, tuple[int, int]]:
        found = {}
        for rel in all_local_files(self.work):
            path = self.work / rel
            if run_file(rel) and ".tmp/" not in rel and not path.is_symlink() and path.name != RANK0_MARKER:
                try:
                    stat = path.stat()
                except FileNotFoundError:  # pruned meanwhile
                    continue
                found[rel] = (stat.st_size, stat.st_mtime_ns)
        return found

    def _whole(self, state: str) -> bool:
        """Whether the store holds every file that makes the checkpoint of ``state`` (its trainer_state.json)
        whole."""
        folder = state.rsplit("/", 1)[0]
        try:
            needs = checkpoint_needs(self.work / folder)
        except FileNotFoundError:  # pruned meanwhile
            return False
        return needs <= set(store_listing(self.fs, join(self.root, folder)))

    def publish(self) -> int:
        """Upload what changed since the last round, phase after phase; delete what was pruned; how many
        files were uploaded."""
        with self._lock:
            if self.lease is not None:
                self.lease.check()
            main = self.main
            now = self._files()
            changed = sorted((rel for rel, sig in now.items() if self.sent.get(rel) != sig
                              and (main or run_phase(rel) == 0)), key=run_phase)
            count, held = 0, []
            for step in sorted({run_phase(rel) for rel in changed}):
                names = [rel for rel in changed if run_phase(rel) == step and (self.work / rel).is_file()]
                if step == 1:  # after this round's parts: a checkpoint whose parts are not all there waits
                    held = [rel for rel in names if not self._whole(rel)]
                    names = [rel for rel in names if rel not in held]
                if names:
                    self.fs.put([str(self.work / rel) for rel in names], [join(self.root, rel) for rel in names])
                    self.sent.update({rel: now[rel] for rel in names})
                    count += len(names)
            self.held = held
            gone = [rel for rel in self.sent if rel not in now]
            if (gone or self.pruned) and main:
                self._delete(gone)
            for rel in gone:  # another node's: its parts of a pruned checkpoint go with global rank 0's deletion
                del self.sent[rel]
            self.uploaded += count
            return count

    def _delete(self, gone: list[str]) -> None:
        """Delete from the store what went here: a pruned checkpoint as a whole folder, its trainer_state.json
        first (no longer whole for a resume), then every object below it, whichever node wrote it. A pruned
        folder is looked at again for ``hold_s`` seconds: another node's publishing round that listed its
        parts before that node pruned them may upload them after this deletion."""
        from latentmill.trainer.checkpoint import STATE_FILE

        folders = {folder for rel in gone if (folder := checkpoint_folder(rel)) is not None
                   and not (self.work / folder).is_dir()}
        files = sorted((rel for rel in gone if checkpoint_folder(rel) not in folders), key=lambda rel: -run_phase(rel))
        now = time.monotonic()
        self.pruned.update({folder: now for folder in folders})
        for folder, when in sorted(self.pruned.items()):
            if now - when > self.hold_s:
                del self.pruned[folder]
                continue
            objects = sorted(store_listing(self.fs, join(self.root, folder)))
            for batch in ([rel for rel in objects if rel == STATE_FILE], [rel for rel in objects if rel != STATE_FILE]):
                if batch:
                    self.fs.rm([join(self.root, folder, rel) for rel in batch])
        if files:
            self.fs.rm([join(self.root, rel) for rel in files])

    def __enter__(self) -> "RunPublisher":
        if self.run_dir is not None:  # a mark left by an earlier run on this machine: rank 0 marks it again
            (self.run_dir / RANK0_MARKER).unlink(missing_ok=True)
        # what the store holds already: a copy of the same size is taken as this file's, one this folder lacks
        # (``pull_runs`` brought every one in) was pruned here and goes at the first round
        local = self._files()
        self.sent = {rel: local.get(rel, (-1, -1)) if int(info.get("size") or 0) == local.get(rel, (-1,))[0]
                     else (-1, -1) for rel, info in store_listing(self.fs, self.root).items() if run_file(rel)}
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        deadline = time.monotonic() + self.hold_s
        while self.held and time.monotonic() < deadline:  # the other nodes' last parts may be on their way
            time.sleep(min(self.every_s, 1.0))
            self.publish()
        if self.held:
            print(f"train: {len(self.held)} checkpoint(s) not published whole to {self.url} (parts of other nodes "
                  f"missing after {self.hold_s:.0f} s): {', '.join(rel.rsplit('/', 1)[0] for rel in self.held)}; "
                  "a resume there takes an older one", flush=True)
