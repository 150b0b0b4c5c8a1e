"""Where raw media comes from: what ``ingest.source`` names, listed as entries with stable ids.

``ingest.source`` may be

* a local folder: every file below it (recursively, hidden files and folders skipped); captions from a
  sidecar ``<name>.txt`` or ``<name>.json`` (its ``caption`` / ``text`` / ``prompt`` field) beside a file;
* a file list (``.txt`` / ``.lst``): one path or URL a line, ``#`` comments; relative paths are relative
  to the list's folder;
* a manifest (``.csv``, ``.jsonl``, ``.parquet``): one row per sample, the media in column ``path`` or
  ``url`` (or ``ingest.path_column``), an optional caption column (``ingest.caption_column``) and an
  optional ``sha256`` column;
* existing webdataset shards: ``shards/train-{000..003}.tar`` (brace notation) or one ``.tar``.

Edit datasets (``ingest.edit``: a source image, a target image and an instruction per sample): the target is
the entry and the source its ``reference``, found by one of three layouts (:func:`edit_layout`):
``<name>.src.<ext>`` beside ``<name>.<ext>`` in a folder; ``source/`` and ``target/`` folders holding the same
relative names (any image extension); a manifest's ``source`` column (``ingest.reference_column``) beside its
``target`` (or ``path``) column. The instruction is the caption (a sidecar ``.txt`` of the target, or the
manifest's caption column).

A source is listed one entry at a time (:meth:`Source.iter_entries`): what the listing must remember (a
folder's names in order, the ids already listed) waits in the planner's scratch database
(:mod:`latentmill.stages.scratch`), not in memory.

Lists, manifests, shards and the paths inside them are read through fsspec: local paths, ``file://``,
``http(s)://`` (with aiohttp installed), ``s3://`` / ``gs://`` / ``az://`` when s3fs / gcsfs / adlfs are installed.

An entry's id is what it is called in the source (the path relative to the folder or list, the URL, or
``<shard>/<key>.<ext>``). A first ingest run groups entries into work units by a hash of that id
(:func:`latentmill.stages.ingest.hash_byte_groups`); later runs keep each entry in its unit and put new
entries into new units (:func:`latentmill.stages.ingest.layout`), so every unchanged unit keeps its id
(contract 1).
"""

from __future__ import annotations

import csv
import io
import json
import os
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from latentmill.stages.pixels import IMAGE_EXTENSIONS
from latentmill.stages.scratch import FILE, FOLDER, LINK, Scratch, chunks
from latentmill.stages.tarshard import group_samples
from latentmill.stages.video import local_path

from latentmill.core.filehashes import FileHashes
from latentmill.core.hashing import sha256_bytes, sha256_file, stable_hash

SIDECAR_EXTENSIONS = (".txt", ".json")
REFERENCE_MARK = ".src"  # <name>.src.<ext>: the source image of <name>.<ext> in an edit folder
PAIRED_FOLDERS = ("source", "target")  # an edit folder of two trees with the same relative names
EDIT_PATH_COLUMNS = ("target", "path", "url")  # an edit manifest's target image
REFERENCE_COLUMN = "source"  # an edit manifest's source image (ingest.reference_column)
LIST_SUFFIXES = (".txt", ".lst")
MANIFEST_SUFFIXES = (".csv", ".jsonl", ".parquet")
PATH_COLUMNS = ("path", "url")
CHUNK_ROWS = 1024  # Parquet manifest rows read at a time
CAPTION_FIELDS = ("caption", "text", "prompt")  # read from a sidecar .json or a shard's .json member

SourceKind = Literal["folder", "list", "manifest", "webdataset"]


@dataclass
class Entry:
    """One raw sample to ingest."""

    id: str  # stable name in the source: relative path, URL or "<shard>/<key>.<ext>"
    uri: str  # what readers open: an absolute local path or a URL
    caption: str | None = None  # from a manifest column
    caption_origin: str | None = None
    sidecars: tuple[str, ...] = ()  # local sidecar files (.txt before .json)
    sha256: str | None = None  # declared by the manifest, checked against the bytes
    error: str | None = None  # a listing problem: the entry is quarantined with this reason
    digest: str | None = None  # sha256 of a local file's bytes, found while planning
    reference: str | None = None  # an edit pair's source image (uri); None outside edit datasets

    @property
    def suffix(self) -> str:
        """The lowercased extension of the id's last path part (``os.path.splitext``'s, without a query)."""
        name = self.id.split("?", 1)[0] if "?" in self.id else self.id
        name = name[name.rfind("/") + 1:]
        dot = name.rfind(".")
        return name[dot:].lower() if dot > 0 and name[:dot].lstrip(".") else ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["sidecars"] = list(self.sidecars)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Entry":
        return cls(**{**data, "sidecars": tuple(data.get("sidecars") or ())})


@dataclass
class Source:
    """A source to list: its entries (folder, list, manifest: :meth:`iter_entries`) or its shards
    (webdataset)."""

    kind: SourceKind
    root: str  # the folder, or the folder of the list / manifest, or the source string for shards
    shards: list[str]
    spec: str = ""  # ingest.source as given (what a list or manifest source reads)
    path_column: str | None = None
    caption_column: str | None = "caption"
    edit: bool = False  # entries are edit targets with their source images (module docstring)
    reference_column: str | None = None

    def iter_entries(self, scratch: Scratch | None = None) -> Iterator[Entry]:
        """The entries in listing order, one at a time (none for webdataset shards). ``scratch`` keeps what
        the listing remembers; without it a private one lives as long as the iteration."""
        if self.kind == "webdataset":
            return
        own = scratch is None
        scratch = Scratch() if scratch is None else scratch
        try:
            if self.kind == "folder" and self.edit:
                yield from _list_edit_folder(Path(self.root), scratch)
            elif self.kind == "folder":
                yield from _list_folder(Path(self.root), scratch)
            elif self.kind == "list":
                yield from _list_file(self.spec, scratch)
            else:
                reference = (self.reference_column or REFERENCE_COLUMN) if self.edit else None
                yield from _list_manifest(self.spec, self.path_column, self.caption_column, scratch, reference)
        finally:
            if own:
                scratch.close()

    @property
    def entries(self) -> list[Entry]:
        """Every entry at once, for small sources (planning streams :meth:`iter_entries` instead)."""
        return list(self.iter_entries())


def is_remote(uri: str) -> bool:
    return local_path(uri) is None


def _join(base: str, ref: str) -> str:
    """``ref`` resolved against the folder ``base`` (both local or URL-like)."""
    if "://" in ref or os.path.isabs(ref):
        return local_path(ref) or ref
    if is_remote(base):
        return base.rstrip("/") + "/" + ref
    return str(Path(local_path(base)) / ref)


def _parent(uri: str) -> str:
    path = local_path(uri)
    if path is not None:
        return str(Path(path).resolve().parent)
    return uri.rsplit("/", 1)[0]


def source_kind(spec: str) -> SourceKind:
    """What ``ingest.source`` names, from its shape (a folder, a list, a manifest or shards)."""
    lower = spec.split("?", 1)[0].lower()
    if lower.endswith(".tar") or ("{" in spec and ".tar" in lower):
        return "webdataset"
    if lower.endswith(MANIFEST_SUFFIXES):
        return "manifest"
    if lower.endswith(LIST_SUFFIXES):
        return "list"
    path = local_path(spec)
    if path is not None and Path(path).is_dir():
        return "folder"
    raise FileNotFoundError(
        f"ingest.source {spec!r} is not a folder, a file list (.txt, .lst), a manifest (.csv, .jsonl, "
        ".parquet) or webdataset shards (.tar, brace notation such as shards-{000..009}.tar)")


def _sidecars(path: Path) -> tuple[str, ...]:
    return tuple(str(p) for ext in SIDECAR_EXTENSIONS if (p := path.with_suffix(ext)).is_file())


def _split_suffix(name: str) -> tuple[str, str]:
    """``(stem, suffix)`` of a file name as ``pathlib`` splits it (``"a.tar.gz"``: ``("a.tar", ".gz")``;
    ``"a."`` and ``".a"``: no suffix), without building a path object."""
    i = name.rfind(".")
    if 0 < i < len(name) - 1:
        return name[:i], name[i:]
    return name, ""


def _visible(it: Iterator[os.DirEntry]) -> Iterator[tuple[str, int]]:
    """``(name, kind)`` of each visible file, link to a file and folder of a ``scandir``: hidden names skipped,
    symlinked folders and broken links left out (as ``Path.rglob``), no ``stat`` where the file system reports
    types."""
    for entry in it:
        if entry.name.startswith("."):
            continue
        if entry.is_file(follow_symlinks=False):  # the common case first: one call per plain file
            yield entry.name, FILE
        elif entry.is_dir(follow_symlinks=False):
            yield entry.name, FOLDER
        elif entry.is_file():  # a symlink to a file
            yield entry.name, LINK


def _walk(folder: str, rel: str, scratch: Scratch, edit: bool = False) -> Iterator[Entry]:
    """The entries below ``folder`` (``rel``: its path below the root, ``""`` or ending in ``/``) in path order.

    One ``scandir`` per folder, its names sorted in ``scratch`` (a flat folder of a million files costs no
    memory) and each subfolder walked where its name sorts among the files: the order of sorting every
    file's path parts. A file's sidecars are the ``.txt`` / ``.json`` files beside it with its stem. With
    ``edit``, an image ``<name>.src.<ext>`` is not an entry but the ``reference`` of ``<name>.<ext>``.
    """
    with os.scandir(folder) as it:
        number = scratch.add_folder(_visible(it))
    prefix = os.path.join(folder, "")  # a name's path: prefix + name (a scandir name holds no separator)
    for page in scratch.folder_names(number):
        split = {name: _split_suffix(name) for name, kind in page if kind != FOLDER}
        media = {name: stem for name, (stem, suffix) in split.items() if suffix.lower() not in SIDECAR_EXTENSIONS
                 and not (edit and stem.endswith(REFERENCE_MARK) and suffix.lower() in IMAGE_EXTENSIONS)}
        present = scratch.files_among(number, [stem + ext for stem in media.values() for ext in SIDECAR_EXTENSIONS])
        if edit:  # the source images of this page's targets (the target's own extension first), and the
            # targets of its source images: one without a target is quarantined, not dropped
            wanted = {name: [stem + REFERENCE_MARK + ext for ext in (split[name][1], *IMAGE_EXTENSIONS)]
                      for name, stem in media.items()}
            sources = {name: stem[: -len(REFERENCE_MARK)] for name, (stem, suffix) in split.items()
                       if name not in media and stem.endswith(REFERENCE_MARK) and suffix.lower() in IMAGE_EXTENSIONS}
            present |= scratch.files_among(number, sorted({n for names in wanted.values() for n in names} | {
                base + ext for base in sources.values() for ext in IMAGE_EXTENSIONS}))
        for name, kind in page:
            if kind == FOLDER:
                yield from _walk(prefix + name, rel + name + "/", scratch, edit)
            elif name in media:
                stem, path = media[name], prefix + name
                sidecars = tuple(prefix + stem + ext for ext in SIDECAR_EXTENSIONS if stem + ext in present)
                entry = Entry(rel + name, os.path.realpath(path) if kind == LINK else path, sidecars=sidecars)
                if edit:
                    found = next((n for n in wanted[name] if n in present), None)
                    entry.reference = prefix + found if found else None
                yield entry
            elif edit and name in sources and not any(sources[name] + ext in present for ext in IMAGE_EXTENSIONS):
                yield Entry(rel + name, prefix + name, error=f"edit pair: a source image without its target "
                                                    f"({rel}{sources[name]}.<image extension>)")
    scratch.drop_folder(number)


def edit_layout(root: Path) -> str:
    """How an edit folder pairs its images: ``paired`` (``source/`` and ``target/`` folders) or ``sidecar``
    (``<name>.src.<ext>`` beside ``<name>.<ext>``)."""
    return "paired" if all((root / name).is_dir() for name in PAIRED_FOLDERS) else "sidecar"


def _list_edit_folder(root: Path, scratch: Scratch) -> Iterator[Entry]:
    """The targets of an edit folder, each with its source image as ``reference`` (None when it has none)."""
    if not root.is_dir():
        raise FileNotFoundError(f"ingest.source {root} is not a folder")
    if edit_layout(root) == "sidecar":
        yield from _walk(str(root), "", scratch, edit=True)
        return
    source, target = (str(root / name) for name in PAIRED_FOLDERS)

    def partner(folder: str, rel: str) -> str | None:  # the same relative name in ``folder``, any image ext
        stem, suffix = os.path.splitext(rel)
        candidates = (stem + suffix, *(stem + ext for ext in IMAGE_EXTENSIONS if ext != suffix.lower()))
        return next((p for c in candidates if os.path.isfile(p := os.path.join(folder, c))), None)

    for entry in _walk(target, "", scratch):
        entry.reference = partner(source, entry.id)
        yield entry
    for entry in _walk(source, "", scratch):  # a source image without a target is quarantined, not dropped
        if partner(target, entry.id) is None:
            yield Entry(f"{PAIRED_FOLDERS[0]}/{entry.id}", entry.uri,
                        error=f"edit pair: a source image without its target ({PAIRED_FOLDERS[1]}/{entry.id})")


def _list_folder(root: Path, scratch: Scratch) -> Iterator[Entry]:
    """Every visible non-sidecar file below ``root``, in path order, with its sidecars. A refresh lists the
    whole folder again, so this costs one ``scandir`` per folder, not a ``stat`` (or three) per file."""
    if not root.is_dir():
        raise FileNotFoundError(f"ingest.source {root} is not a folder")
    yield from _walk(str(root), "", scratch)


def _open_text(uri: str):
    import fsspec

    return fsspec.open(uri, "rt", encoding="utf-8")


def manifest_rows(uri: str) -> Iterator[dict[str, Any]]:
    """The rows of a CSV, JSONL or Parquet manifest as dicts, one at a time (Parquet: a batch of rows at a time)."""
    lower = uri.split("?", 1)[0].lower()
    if lower.endswith(".csv"):
        with _open_text(uri) as fh:
            yield from csv.DictReader(fh)
    elif lower.endswith(".jsonl"):
        with _open_text(uri) as fh:
            for line in fh:
                if line.strip():
                    yield json.loads(line)
    else:
        import fsspec
        import pyarrow.parquet as pq

        with fsspec.open(uri, "rb") as fh:  # a batch of rows at a time, not the whole table
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=CHUNK_ROWS):
                yield from batch.to_pylist()


def _entry_for(ref: str, base: str) -> Entry:
    uri = _join(base, ref)
    sidecars = () if is_remote(uri) else _sidecars(Path(uri))
    return Entry(ref, uri, sidecars=sidecars)


def _dedupe(entries: Iterable[Entry], where: str, scratch: Scratch) -> Iterator[Entry]:
    """Keep ids unique: a repeated entry is quarantined (its key would collide), not dropped. How often each
    id was listed is counted in ``scratch``, a chunk of entries at a time."""
    for chunk in chunks(entries):
        seen = scratch.count_listed([entry.id for entry in chunk])
        out = []
        for entry in chunk:
            n = seen.get(entry.id, 0)
            seen[entry.id] = n + 1
            if n:
                entry = Entry(f"{entry.id}#dup{n}", entry.uri, error=f"listed again in {where} ({entry.id})")
            out.append(entry)
        scratch.set_listed(seen)
        yield from out


def _list_file(uri: str, scratch: Scratch) -> Iterator[Entry]:
    base = _parent(uri)

    def listed() -> Iterator[Entry]:
        with _open_text(uri) as fh:
            for line in fh:
                ref = line.strip()
                if ref and not ref.startswith("#"):
                    yield _entry_for(ref, base)

    return _dedupe(listed(), Path(uri).name, scratch)


def _list_manifest(uri: str, path_column: str | None, caption_column: str | None, scratch: Scratch,
                   reference_column: str | None = None) -> Iterator[Entry]:
    """A manifest's rows as entries; with ``reference_column`` (an edit manifest), each row's source image
    from that column becomes the entry's ``reference``, its target from ``path_column`` or the first of
    ``target``, ``path``, ``url``."""
    base, name = _parent(uri), uri.rsplit("/", 1)[-1]
    columns = EDIT_PATH_COLUMNS if reference_column else PATH_COLUMNS

    def listed() -> Iterator[Entry]:
        for n, row in enumerate(manifest_rows(uri), start=1):
            column = path_column or next((c for c in columns if row.get(c)), None)
            ref = row.get(column) if column else None
            if not ref:
                wanted = path_column or " or ".join(PATH_COLUMNS)
                yield Entry(f"{name}#row{n}", "", error=f"{name} row {n} has no {wanted} value")
                continue
            entry = _entry_for(str(ref), base)
            caption = row.get(caption_column) if caption_column else None
            if isinstance(caption, str) and caption.strip():
                entry.caption, entry.caption_origin = caption.strip(), f"{name}:{caption_column}"
            if row.get("sha256"):
                entry.sha256 = str(row["sha256"]).lower()
            if reference_column and row.get(reference_column):
                entry.reference = _join(base, str(row[reference_column]))
            yield entry

    return _dedupe(listed(), name, scratch)


def _expand_shards(spec: str) -> list[str]:
    from braceexpand import braceexpand

    shards = []
    for uri in braceexpand(spec):
        path = local_path(uri)
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"ingest.source: shard {uri} does not exist")
            uri = str(Path(path).resolve())
        shards.append(uri)
    return shards


def list_source(spec: str, path_column: str | None = None, caption_column: str | None = "caption",
                edit: bool = False, reference_column: str | None = None) -> Source:
    """``ingest.source``: its kind, root and shards (webdataset), or what lists its entries
    (:meth:`Source.iter_entries`); ``edit``: entries of an edit dataset, each with its source image."""
    kind = source_kind(spec)
    if kind == "webdataset":
        return Source(kind, spec, _expand_shards(spec))
    root = str(Path(local_path(spec)).resolve()) if kind == "folder" else _parent(spec)
    return Source(kind, root, [], spec, path_column, caption_column, edit, reference_column)


# ---------------------------------------------------------------------------------------------------------
# Identity and grouping
# ---------------------------------------------------------------------------------------------------------


def remote_identity(uri: str) -> str:
    """A cheap content identity of a remote object: its ETag / checksum / mtime, else its bytes' hash."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return stable_hash([uri, "missing"])  # ingest quarantines it; planning goes on
    except (OSError, NotImplementedError, ValueError):
        info = {}
    lowered = {str(k).lower(): v for k, v in info.items()}
    tag = [lowered[k] for k in ("etag", "md5hash", "checksum", "last-modified", "lastmodified", "mtime",
                                "updated") if lowered.get(k)]
    if tag:
        return stable_hash([uri, lowered.get("size"), [str(t) for t in tag]])
    try:
        with fsspec.open(uri, "rb") as fh:
            return sha256_bytes(fh.read())
    except OSError as err:
        return stable_hash([uri, "unreadable", type(err).__name__])


def content_identity(entry: Entry, hashes: FileHashes | None = None) -> str:
    """What decides this entry's output: its id, the bytes of the file and its sidecars, its caption.

    Local files are hashed through ``hashes`` (remembered digests of unchanged files) when given; the
    file's digest is left in ``entry.digest`` so that ingest need not hash it again.
    """
    if entry.error:
        return stable_hash([entry.id, entry.error])
    file_sha = hashes.sha256 if hashes is not None else sha256_file
    if is_remote(entry.uri):
        data_id = entry.sha256 or remote_identity(entry.uri)
    else:
        try:  # one stat (the store's), not a second one to ask whether it is a file
            data_id = entry.digest = file_sha(entry.uri)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            data_id = "missing"
    sidecars = {os.path.splitext(p)[1]: file_sha(p) for p in entry.sidecars}
    if entry.reference is None:
        return stable_hash([entry.id, data_id, sidecars, entry.caption])
    # an edit pair: its source image's location and bytes too (an entry outside edit data keeps its identity)
    try:
        reference = remote_identity(entry.reference) if is_remote(entry.reference) else file_sha(entry.reference)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        reference = "missing"
    return stable_hash([entry.id, data_id, sidecars, entry.caption, entry.reference, reference])


def shard_identity(uri: str) -> str:
    """Content identity of an input webdataset shard."""
    return remote_identity(uri) if is_remote(uri) else sha256_file(uri)


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


def read_bytes(uri: str, limit: int | None = None) -> bytes:
    """The bytes of ``uri``; ValueError when over ``limit``."""
    import fsspec

    with fsspec.open(uri, "rb") as fh:
        data = fh.read() if limit is None else fh.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"over {limit} bytes")
    return data


def _caption_from_json(data: Any) -> str | None:
    if isinstance(data, dict):
        for name in CAPTION_FIELDS:
            if isinstance(data.get(name), str) and data[name].strip():
                return data[name].strip()
    return None


def sidecar_caption(sidecars: tuple[str, ...] | list[str]) -> tuple[str | None, str | None]:
    """``(caption, origin)`` from the first sidecar that has one: ``.txt`` text, ``.json`` caption field."""
    for path in sidecars:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if path.endswith(".json"):
            try:
                caption = _caption_from_json(json.loads(text))
            except ValueError:
                continue
        else:
            caption = text.strip()
        if caption:
            return caption, f"sidecar:{Path(path).name}"
    return None, None


def sidecar_problem(sidecars: tuple[str, ...] | list[str]) -> str:
    """Why the sidecars beside a file gave no caption, naming each: empty, no caption field, unreadable."""
    problems = []
    for path in sidecars:
        name = Path(path).name
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            problems.append(f"{name} is empty")
        elif path.endswith(".json"):
            try:
                json.loads(text)
                problems.append(f"{name} has no non-empty caption field")
            except ValueError:
                problems.append(f"{name} is not valid JSON")
    return "; ".join(problems)


def _open_tar(uri: str) -> tarfile.TarFile:
    if is_remote(uri):
        return tarfile.open(fileobj=io.BytesIO(read_bytes(uri)), mode="r")
    return tarfile.open(uri, mode="r")


def count_shard_samples(uri: str) -> int:
    """How many webdataset samples a local shard holds (``tarshard.group_samples``, the rule every reader
    groups by); 0 for remote shards (unknown)."""
    if is_remote(uri):
        return 0
    with tarfile.open(uri, mode="r") as tar:
        return sum(1 for _ in group_samples(((m.name, None) for m in tar if m.isfile()), uri))


def iter_shard_samples(uri: str) -> Iterator[dict[str, Any]]:
    """Yield ``{"__key__", "__members__": {ext: member name}, ext: bytes...}`` for each sample of a shard,
    grouped by ``tarshard.group_samples`` (extensions lowercased here: a source's ``JPG`` is a ``jpg``)."""
    with _open_tar(uri) as tar:  # each member read as the walk reaches it: a compressed tar is read once
        files = ((m.name, (m.name, tar.extractfile(m).read())) for m in tar if m.isfile())
        for key, members in group_samples(files, uri):
            sample: dict[str, Any] = {"__key__": key, "__members__": {}}
            for ext, (name, data) in members.items():
                sample[ext.lower()] = data
                sample["__members__"][ext.lower()] = name
            yield sample


def shard_member_uri(shard_uri: str, member: str) -> str:
    """An fsspec URL for one member of a tar shard, e.g. ``tar://k.mp4::file:///data/shard-000.tar``."""
    outer = shard_uri if is_remote(shard_uri) else "file://" + str(Path(shard_uri).resolve())
    return f"tar://{member}::{outer}"


def shard_sample_caption(sample: dict[str, Any]) -> tuple[str | None, str | None]:
    """A webdataset sample's caption: its ``txt`` member, else the caption field of its ``json``."""
    if sample.get("txt"):
        text = sample["txt"].decode("utf-8", errors="replace").strip()
        if text:
            return text, "webdataset:txt"
    if sample.get("json"):
        try:
            caption = _caption_from_json(json.loads(sample["json"]))
        except ValueError:
            caption = None
        if caption:
            return caption, "webdataset:json"
    return None, None
