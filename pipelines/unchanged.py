"""An unchanged prep returns at once: ``latentmill prep`` reports the last run's outcome without starting Prefect
or loading a model when nothing that decides the output changed.

A prep's output is a function of its recipe (less the runner, which decides how, not what), of its inputs'
content, of the model files it reads and of latentmill's own code. A prep that finishes writes
``prep/last-run.json``: a key over those four, its summary and the snapshot it published. The next prep
computes the key again (the recipe; the ingest plan's unit ids, which are the inputs' content identities,
found from one ``stat`` per unchanged file; a ``stat`` signature of every local file the recipe names and of
the package's sources) and, when it matches, the snapshot is still what ``LATEST`` names and no other writer
holds the output folder, reports that summary with every sample reused. Anything it cannot see runs the full
prep: a model named by a hub id, a changed or new input, a gc or compaction since, an edited source file.

A folder source is first compared by a ``stat`` signature of its files (:func:`source_signature`), taken before
the last run started: equal, the last run's unit ids stand for the inputs without planning the ingest again;
different, or none because a file was modified within ``FileHashes.RACY_SECONDS`` (new files just copied in),
the prep runs without planning it here first (the flow plans it once). A file touched but not changed therefore
runs the prep, which reuses every unit.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

from latentmill.core import durable
from latentmill.core.hashing import stable_hash
from latentmill.core.store import is_url

LAST_RUN = "last-run.json"  # under <output_dir>/prep/
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name": files this module cannot stat
_PACKAGE_ROOTS = ("latentmill", "stages", "pipelines", "trainer")


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for n, item in enumerate(value):
            yield from _leaves(item, f"{path}[{n}]")
    else:
        yield path, value


def _stat_rows(path: Path) -> list[list[Any]]:
    """(relative name, size, mtime_ns, inode) of ``path`` or of every file below it."""
    if path.is_file():
        st = path.stat()
        return [[path.name, st.st_size, st.st_mtime_ns, st.st_ino]]
    rows = []
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(folder, name)
            st = os.stat(full)
            rows.append([os.path.relpath(full, path), st.st_size, st.st_mtime_ns, st.st_ino])
    return rows


# Keys whose paths are no input of the prep: what it writes, and the source its ingest plan covers
_NOT_INPUTS = ("output_dir", "ingest.source", "loader.cache_dir")
# Keys that name a model or a file even as a bare relative name ("tiny-flux"); any other value counts as a path only
# when it looks like one (a "/", or a leading "~" or "."): trainer.tracker_project "latentmill" is a name, though a
# folder of that name sits in the repository (its __pycache__ changed the key while other processes imported)
_FILE_KEYS = ("pretrained", "tiny_recipe", "model")


def _files_named(recipe_data: dict[str, Any]) -> list[list[Any]] | None:
    """The stat rows of every local file or folder the recipe names as an input (models, tiny recipes, caption
    files); None when it names something that looks like a hub id and is no local path (its files live where
    this cannot look)."""
    rows = []
    for key, value in _leaves(recipe_data):
        if not isinstance(value, str) or not value or key in _NOT_INPUTS:
            continue
        if not key.rsplit(".", 1)[-1].endswith(_FILE_KEYS) and "/" not in value and not value.startswith(("~", ".")):
            continue
        path = Path(value).expanduser()
        if path.exists():
            rows.append([key, _stat_rows(path)])
        elif _HUB_ID.match(value):
            return None
    return rows


def _code_rows() -> list[list[Any]]:
    """(file, size, mtime_ns) of latentmill's Python sources: an edited or upgraded install is another prep."""
    import latentmill

    rows = []
    for root in {Path(p) for p in latentmill.__path__}:
        for name in _PACKAGE_ROOTS:
            folder = root / name if (root / name).is_dir() else None
            if folder is None:
                continue
            for file in sorted(folder.rglob("*.py")):
                st = file.stat()
                rows.append([str(file), st.st_size, st.st_mtime_ns])
    return rows


def key_base(recipe: Any) -> dict[str, Any] | None:
    """What decides ``recipe``'s output besides its inputs: the recipe less its runner, the local files it
    names and latentmill's sources; None when part of it cannot be seen (a hub id)."""
    data = recipe.to_dict()
    files = _files_named(data)
    if files is None:
        return None
    return {"recipe": {k: v for k, v in data.items() if k != "runner"}, "files": files, "code": _code_rows()}


def source_signature(recipe: Any) -> str | None:
    """A hash of ``(path, size, mtime_ns, inode)`` of every file below a local folder ``ingest.source``; None for
    another source, or when a file was modified within ``FileHashes.RACY_SECONDS`` (its next change could keep
    its ``stat``). Files combine in any order (a sum of their hashes), so a folder's names are never sorted."""
    from latentmill.core.filehashes import FileHashes

    root = Path(str(recipe.ingest.source or "")).expanduser()
    if not root.is_dir():
        return None
    now, total, count = time.time(), 0, 0
    folders = [str(root)]
    while folders:  # scandir's entries one at a time: a flat folder of a million files builds no list of names
        with os.scandir(folders.pop()) as it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
                        continue
                    st = entry.stat()
                except OSError:
                    return None
                if now - st.st_mtime_ns / 1e9 < FileHashes.RACY_SECONDS:
                    return None
                row = marshal.dumps((entry.path, st.st_size, st.st_mtime_ns, st.st_ino), 2)
                total += int.from_bytes(hashlib.sha256(row).digest()[:16], "big")
                count += 1
    return f"{count}:{total % (1 << 128):032x}"


def run_key(base: dict[str, Any] | None, ingest_units: list[str]) -> str | None:
    """The key of a prep: :func:`key_base` and the ids of its ingest units (its inputs' content)."""
    return None if base is None else stable_hash({**base, "ingest_units": list(ingest_units)})


def remember(recipe: Any, summary: dict[str, Any], key: str | None, ingest_units: list[str] | None = None,
             source: str | None = None) -> None:
    """After a prep that finished: its key (what it was run on), summary and snapshot, for the next; with
    ``source`` (:func:`source_signature` before the run) also its ingest unit ids, which that signature stands for."""
    path = Path(recipe.prep_dir) / LAST_RUN
    if key is None or not summary.get("snapshot"):
        path.unlink(missing_ok=True)
        return
    record = {"key": key, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "summary": summary}
    if source is not None and ingest_units is not None:
        record.update({"source": source, "ingest_units": list(ingest_units)})
    durable.write_json(path, record, sort_keys=False)  # the summary's stages in the order they ran


def _as_reused(name: str, counts: dict[str, Any]) -> dict[str, Any]:
    """A stage's summary as a re-run that reuses every unit reports it."""
    counts = {**counts, "processed": 0, "reused": counts["in"], "seconds": 0.0}
    counts.pop("compaction", None)
    if name == "curate":  # a reused unit neither scores nor reuses scores
        counts.update({k: 0 for k in ("scored", "scores_reused", "unscored", "embedded", "embeddings_reused",
                                      "clips_scored", "clip_scores_reused") if k in counts})
        if counts.get("near_duplicates"):
            counts["near_duplicates"] = {**counts["near_duplicates"], "entered": 0, "units_read": 0,
                                         "vectors_read": 0, "decided": 0, "new_near_duplicates": 0}
    if name == "cache" and "components" in counts:  # every component of a reused unit is reused
        counts["components"] = {comp: {"processed": 0, "reused": c["processed"] + c["reused"]}
                                for comp, c in counts["components"].items()}
    return counts


def _snapshot_on_disk(folder: Path) -> bool:
    """Whether the snapshot's manifest, every shard it names and each shard's index (at its size) are there."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        for shard in manifest["shards"]:
            tar = folder / shard["path"]
            index = shard.get("index")
            if not tar.is_file() or (index and tar.with_name(index["name"]).stat().st_size != index["size"]):
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def unchanged_summary(recipe: Any) -> dict[str, Any] | None:
    """The summary of a prep of ``recipe`` that would change nothing, from the last one; None when it might.

    ``unchanged_since`` says when the reported run finished."""
    return check(recipe)[0]


def check(recipe: Any) -> tuple[dict[str, Any] | None, str | None]:
    """:func:`unchanged_summary`, and the :func:`source_signature` it was compared with: the prep that runs next
    records that one (``run_prep``'s ``source``) rather than walking the source folder again."""
    from latentmill.pipelines.retention import OutputBusyError, check_not_busy
    from latentmill.pipelines.snapshot import latest_name
    from latentmill.stages import ingest
    from latentmill.stages.shardio import StageDir

    if is_url(recipe.output_dir):  # on a store, the prep itself finds every unit committed
        return None, None
    source = source_signature(recipe)
    try:
        last = json.loads((Path(recipe.prep_dir) / LAST_RUN).read_text())
        check_not_busy(recipe.output_dir)
    except (OSError, ValueError, OutputBusyError):
        return None, source
    summary = last.get("summary") or {}
    snapshot = summary.get("snapshot") or {}
    if not snapshot or latest_name(recipe.output_dir) != snapshot.get("name"):
        return None, source
    if not _snapshot_on_disk(Path(snapshot.get("path", ""))):
        return None, source
    base = key_base(recipe)
    if base is None:
        return None, source
    stage_dir = StageDir(recipe.stage_dir("ingest"), "ingest")
    if source is None and Path(str(recipe.ingest.source or "")).expanduser().is_dir():
        return None, None  # a file modified a moment ago is a change, like a touch: planning here would list it twice
    if source is not None and last.get("source") is not None:
        if source != last["source"]:
            return None, source  # a file changed, came or went: the prep plans the ingest once, in the flow
        units = list(last.get("ingest_units") or [])
    else:
        units = [unit.unit_id for unit in ingest.plan(recipe.ingest, stage_dir)]
    if run_key(base, units) != last.get("key") or not all(stage_dir.unit_path(u).is_file() for u in units):
        return None, source
    stages = {name: _as_reused(name, counts) for name, counts in (summary.get("stages") or {}).items()}
    return {**summary, "stages": stages, "snapshot": {**snapshot, "new": False},
            "unchanged_since": last.get("finished")}, source
