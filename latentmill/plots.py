"""Pictures of a prep: a histogram per score with its thresholds, the bucket histogram, and a contact sheet of
the quarantined samples per reason (``latentmill inspect --plots OUT``, and the prep flow's ``prep/plots``).

Everything here is generic over what the curate stage scored: one histogram per score column of
``prep/scores.parquet`` (or, without pyarrow or the table, of the curate units' score rows),
with the thresholds of the curate manifest (``min_X`` / ``max_X`` drawn on score ``X``). The cost does not
grow with the pixels of the dataset: the histograms read the scores table and the manifests; only the
contact sheets decode samples, at most ``cap`` per reason and ``max_sheets`` reasons.

Output is deterministic: Agg, matplotlib's default style whatever the user's matplotlibrc says, fixed
figure sizes and dpi, no ``Software`` or date in the PNG metadata, so the same prep gives the same bytes
(with the same matplotlib and fonts).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

PLOTS_EXTRA = "pip install 'latentmill[plots]'"
STAGE_ORDER = ("ingest", "caption", "curate", "bucket", "cache")
SCORE_META_COLUMNS = ("key", "source", "kind", "status", "threshold")  # the other columns are scores
CAP = 48  # thumbnails per contact sheet
MAX_SHEETS = 24  # contact sheets (the most frequent reasons first); the others are listed in index.md
THUMB_SIDE = 128  # thumbnail's longer side in pixels
DPI = 100
KEPT_COLOUR, QUARANTINED_COLOUR = "#4C72B0", "#DD5555"
THRESHOLD_COLOURS = ("#222222", "#8C564B", "#9467BD", "#2CA02C")


class MissingExtra(RuntimeError):
    """An optional dependency is not installed; the message names the extra that brings it."""


@dataclass
class Plot:
    """One picture written: its file, a one-line summary, and the numbers it draws (for tests and readers)."""

    name: str  # the file name, e.g. ``score_sharpness.png``
    path: Path
    summary: str
    data: dict[str, Any] = field(default_factory=dict)


def require_matplotlib() -> Any:
    """``matplotlib``, or :class:`MissingExtra` naming ``latentmill[plots]``. Pictures are drawn on
    ``matplotlib.figure.Figure`` objects (Agg canvas), never through pyplot: no GUI backend, no global list
    of open figures, whatever backend the calling program chose."""
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401
        import matplotlib.style  # noqa: F401
        import matplotlib.ticker  # noqa: F401
    except ImportError as err:
        raise MissingExtra(f"plots need matplotlib, which is not installed: {PLOTS_EXTRA}") from err
    return matplotlib


# ---------------------------------------------------------------------------------------------------------
# Reading a prep
# ---------------------------------------------------------------------------------------------------------


def prep_dir_of(path: Path) -> Path:
    """The prep folder (``<output_dir>/prep``) of a recipe, an output_dir, a snapshot, a stage or a prep folder."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml") and not path.is_dir():
        from latentmill.recipe import load_recipe

        return Path(load_recipe(path).prep_dir)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file():  # snapshots/LATEST
        path = path.parent
    # the prep folder itself, an output_dir, a stage folder, snapshots/, a snapshot folder
    candidates = [path, path / "prep", path.parent, path.parent / "prep", path.parent.parent / "prep"]
    for folder in candidates:
        if any((folder / stage / "manifest.json").is_file() for stage in STAGE_ORDER):
            return folder
    raise FileNotFoundError(f"no prep folder (stage manifests) at or around {path}; run `latentmill prep` first")


def _manifest(prep_dir: Path, stage: str) -> dict[str, Any] | None:
    path = prep_dir / stage / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_scores(prep_dir: Path, light: bool = False) -> dict[str, Any]:
    """The scores table as columns (lists): ``prep/scores.parquet`` when pyarrow reads it, else the same rows
    built from the curate units' score rows (``StageDir.unit_detail``). Empty when the prep has no curate
    stage.

    ``light``: only the scores and ``status``, from the table as numpy arrays, for the histograms: a score is
    float (null: NaN) and ``status`` is True where the sample was quarantined (no string object per row)."""
    table = prep_dir / "scores.parquet"
    if table.is_file():
        try:
            import pyarrow.parquet as pq
        except ImportError:
            pass
        else:
            if not light:
                return pq.read_table(table).to_pydict()
            names = [c for c in pq.read_schema(table).names if c == "status" or c not in SCORE_META_COLUMNS]
            import pyarrow.compute as pc

            read = pq.read_table(table, columns=names)
            return {c: (pc.equal(read.column(c), "quarantined").fill_null(False) if c == "status" else read.column(c))
                    .to_numpy(zero_copy_only=False) for c in names}
    manifest = _manifest(prep_dir, "curate")
    if manifest is None:
        return {}
    from latentmill.stages.curate import score_rows
    from latentmill.stages.shardio import StageDir

    stage_dir = StageDir(prep_dir / "curate", "curate")
    records = [r for u in manifest.get("units", []) if (r := stage_dir.load_record(u)) is not None]
    rows = score_rows(stage_dir, records)
    names = list(dict.fromkeys(n for r in rows for n in r if n not in SCORE_META_COLUMNS))
    return {col: [r.get(col) for r in rows] for col in (*SCORE_META_COLUMNS, *names)}


def score_thresholds(prep_dir: Path) -> dict[str, dict[str, float]]:
    """Score name -> ``{"min_sharpness": 50.0}``: the curate manifest's thresholds, ``min_X`` / ``max_X`` on
    score ``X`` (any other threshold, e.g. a similarity for deduplication, is on no score and not drawn)."""
    manifest = _manifest(prep_dir, "curate") or {}
    found: dict[str, dict[str, float]] = {}
    for name, value in (manifest.get("thresholds") or {}).items():
        match = re.fullmatch(r"(min|max)_(\w+)", name)
        if match and value is not None:
            found.setdefault(match.group(2), {})[name] = float(value)
    return found


def quarantine_entries(prep_dir: Path) -> list[dict[str, Any]]:
    """Every stage's quarantine entries, in pipeline order (each list is sorted by source and key)."""
    entries = []
    for stage in STAGE_ORDER:
        path = prep_dir / stage / "quarantine.jsonl"
        if path.is_file():
            entries.extend({"stage": stage, **json.loads(line)} for line in path.read_text().splitlines() if line)
    return entries


# ---------------------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------------------


def _style(mpl: Any) -> Any:
    """matplotlib's default style plus a few settings, whatever a user's matplotlibrc says: a picture depends
    on its data only."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(mpl.style.context("default"))
    stack.enter_context(mpl.rc_context({"figure.dpi": DPI, "savefig.dpi": DPI, "font.size": 9,
                                        "axes.titlesize": 10, "svg.hashsalt": "latentmill"}))
    return stack


def _save(fig: Any, path: Path) -> None:
    """Write a PNG with no metadata that changes between runs or versions (``Software``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
    tmp.replace(path)


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def score_histogram(name: str, columns: dict[str, Any], thresholds: dict[str, float], out: Path,
                    bins: int = 30) -> Plot:
    """``score_<name>.png``: kept and quarantined samples stacked per bin, each threshold a vertical line
    with its value in the legend. ``data``: bin ``edges`` and the drawn ``kept`` / ``quarantined`` heights."""
    mpl = require_matplotlib()
    column = columns[name]
    values = (column.astype(np.float64) if isinstance(column, np.ndarray)
              else np.asarray([np.nan if v is None else float(v) for v in column], np.float64))
    status = np.asarray(columns["status"]) if "status" in columns else np.zeros(len(values), bool)
    dropped = status if status.dtype == bool else status == "quarantined"  # load_scores(light=True): a mask
    scored = np.isfinite(values)  # a null (NaN) or infinite score is not drawn
    kept_values, quarantined_values = values[scored & ~dropped], values[scored & dropped]
    lo, hi = (float(values[scored].min()), float(values[scored].max())) if scored.any() else (0.0, 1.0)
    # one value: a unit-wide range around it
    edges = np.linspace(lo, hi, bins + 1) if hi > lo else np.linspace(lo - 0.5, hi + 0.5, bins + 1)
    kept, _ = np.histogram(kept_values, edges)
    quarantined, _ = np.histogram(quarantined_values, edges)
    widths = np.diff(edges)
    with _style(mpl):
        fig = mpl.figure.Figure(figsize=(6.4, 3.6))
        ax = fig.subplots()
        bars_kept = ax.bar(edges[:-1], kept, widths, align="edge", color=KEPT_COLOUR, label=f"kept ({kept.sum()})")
        bars_quarantined = ax.bar(edges[:-1], quarantined, widths, bottom=kept, align="edge",
                                  color=QUARANTINED_COLOUR, label=f"quarantined ({quarantined.sum()}, any threshold)")
        for i, (key, bound) in enumerate(sorted(thresholds.items())):
            ax.axvline(bound, color=THRESHOLD_COLOURS[i % len(THRESHOLD_COLOURS)], linestyle="--", linewidth=1.5,
                       label=f"curate.{key} = {_fmt(bound)}")
        ax.set_xlabel(name)
        ax.set_ylabel("samples")
        ax.yaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
        ax.set_title(f"{name}: {int(scored.sum())} scored samples")
        ax.legend(loc="best", frameon=False)
        fig.tight_layout()
        path = out / f"score_{name}.png"
        _save(fig, path)
        drawn_kept = [int(round(b.get_height())) for b in bars_kept]
        drawn_quarantined = [int(round(b.get_height())) for b in bars_quarantined]
        lines = {key: float(line.get_xdata()[0]) for key, line in zip(sorted(thresholds), ax.get_lines())}
    line = (f"{name}: {int(scored.sum())} scored ({int(kept.sum())} kept, {int(quarantined.sum())} quarantined), "
            f"{_fmt(lo)}..{_fmt(hi)}")
    if scored.any():
        line += f", median {_fmt(float(np.median(values[scored])))}"
    if thresholds:
        line += "; " + ", ".join(f"curate.{k}={_fmt(v)}" for k, v in sorted(thresholds.items()))
    return Plot(path.name, path, line, {"edges": edges.tolist(), "kept": drawn_kept,
                                        "quarantined": drawn_quarantined, "thresholds": lines})


def bucket_histogram(prep_dir: Path, out: Path) -> Plot | None:
    """``buckets.png``: samples per bucket ``WxHxF`` of the cache manifest (what training reads), else of the
    bucket manifest; None when neither stage has run."""
    from latentmill.stages.bucket import histogram

    stage = next((s for s in ("cache", "bucket") if _manifest(prep_dir, s) is not None), None)
    if stage is None:
        return None
    counts = histogram(_manifest(prep_dir, stage))

    def order(bucket: str) -> tuple[int, ...]:
        return tuple(int(n) for n in bucket.split("x")) if re.fullmatch(r"\d+(x\d+)*", bucket) else (1 << 30,)

    names = sorted(counts, key=order)
    mpl = require_matplotlib()
    with _style(mpl):
        fig = mpl.figure.Figure(figsize=(6.4, max(2.0, 0.8 + 0.28 * len(names))))
        ax = fig.subplots()
        bars = ax.barh(range(len(names)), [counts[n] for n in names], color=KEPT_COLOUR)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.bar_label(bars, padding=2)
        ax.set_xlabel("samples")
        ax.xaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("bucket (W×H×F)")
        ax.set_title(f"{sum(counts.values())} samples in {len(names)} buckets ({stage} manifest)")
        fig.tight_layout()
        path = out / "buckets.png"
        _save(fig, path)
        drawn = {n: int(round(b.get_width())) for n, b in zip(names, bars)}
    top = ", ".join(f"{n}: {counts[n]}" for n in sorted(names, key=lambda n: (-counts[n], order(n)))[:3])
    return Plot(path.name, path, f"buckets: {sum(counts.values())} samples in {len(names)} buckets ({stage}); "
                                 f"largest {top or '-'}", {"counts": drawn, "stage": stage})


def slug(text: str, limit: int = 60) -> str:
    """A file-name-safe form of a reason: lower case, ``[a-z0-9-]``; a long one is cut and given a short hash."""
    from latentmill.core.hashing import stable_hash

    plain = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "reason"
    return plain if len(plain) <= limit else f"{plain[:limit].rstrip('-')}-{stable_hash(text)[:8]}"


def _read_members(tar: Path, entry: dict[str, Any], wanted: set[str]) -> dict[str, dict[str, Any]]:
    """The samples of ``wanted`` keys in one shard (through its index when it has one)."""
    from latentmill.stages.shardindex import ShardIndexError, load_shard_index
    from latentmill.stages.tarshard import read_shard

    found: dict[str, dict[str, Any]] = {}
    try:
        index = load_shard_index(tar, entry)
    except ShardIndexError:
        return {s["__key__"]: s for s in read_shard(tar) if s["__key__"] in wanted}
    with open(tar, "rb") as fh:
        for i in range(index.num_samples):
            key = index.key(i)
            if key not in wanted:
                continue
            sample: dict[str, Any] = {"__key__": key}
            for member, (offset, size) in index.members(i).items():
                fh.seek(offset)
                sample[member] = fh.read(size)
            found[key] = sample
    return found


def find_samples(prep_dir: Path, stage: str, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The samples a stage quarantined, as its upstream stage wrote them (key -> members). The upstream
    shards are read through their indexes, shard by shard, until every key is found: reading stops early."""
    wanted = set(keys)
    # the nearest earlier stage that ran (a prep made before the curate stage existed has none)
    earlier = STAGE_ORDER[:STAGE_ORDER.index(stage)] if stage in STAGE_ORDER else ()
    upstream = next((s for s in reversed(earlier) if _manifest(prep_dir, s) is not None), None)
    manifest = _manifest(prep_dir, upstream) if upstream else None
    found: dict[str, dict[str, Any]] = {}
    for entry in (manifest or {}).get("shards", []):
        if not wanted - found.keys():
            break
        tar = prep_dir / upstream / entry["path"]
        if tar.is_file():
            found.update(_read_members(tar, entry, wanted - found.keys()))
    return found


def _source_sample(prep_dir: Path, entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """An ingest quarantine entry's source file, as a sample: ``source`` under the ingest manifest's local
    ``source`` folder. None when the source is not a local folder or the file is gone."""
    from latentmill.stages import pixels
    from latentmill.stages.video import VIDEO_EXTENSIONS

    root = (_manifest(prep_dir, "ingest") or {}).get("source")
    if not isinstance(root, str) or not Path(root).is_dir():
        return None
    path = Path(root) / entry["source"]
    if not path.is_file():
        return None
    if path.suffix.lower() in VIDEO_EXTENSIONS:
        return {}, {"kind": "video", "source_uri": str(path)}
    return {pixels.IMAGE_MEMBER: path.read_bytes()}, {"kind": "image"}


def thumbnail(sample: dict[str, Any], meta: dict[str, Any], side: int = THUMB_SIDE) -> Any:
    """An RGB thumbnail (PIL) of an image, or of a video's first frame (of its clip window when it has one),
    decoded by the same rules and reader as captioning and the cache."""
    from PIL import Image

    from latentmill.stages.captioners.media import fit_within, load_image, media_member

    kind, member = media_member(sample, meta)
    if kind == "image":
        return load_image(sample[member], side)
    from latentmill.stages.video import read_frames

    source = sample[member] if member else meta["source_uri"]
    start = int((meta.get("clip") or {}).get("start_frame") or 0)
    rotation = int(meta.get("rotation", 0)) if meta.get("frames") else None
    # PyAV: one frame, and a file that does not open raises without decord's line on stderr
    frame_HWC = read_frames(source, [start], backend="pyav", rotation=rotation).numpy()[0]
    return fit_within(Image.fromarray(frame_HWC), side)


def _tile_caption(entry: dict[str, Any], width: int = 22) -> str:
    lines = [entry["key"], Path(str(entry.get("source", "?"))).name[:width]]
    if entry.get("duplicate_of"):
        lines.append(f"dup of {entry['duplicate_of']}")
    for name, value in sorted((entry.get("scores") or {}).items()):
        lines.append(f"{name} {_fmt(float(value))}")
    return "\n".join(lines)


def contact_sheet(stage: str, reason: str, entries: list[dict[str, Any]], prep_dir: Path, out: Path,
                  cap: int = CAP, columns: int = 8) -> Plot:
    """``quarantine_<stage>-<reason-slug>.png``: thumbnails of the first ``cap`` samples quarantined for one
    reason, each with its key, source and scores; "+N more" beyond. A sample that cannot be decoded (or
    found) is a grey tile saying "cannot decode". ``data``: ``tiles`` drawn, their ``keys``, ``more``,
    ``undecodable``."""
    mpl = require_matplotlib()
    shown = entries[:cap]
    # a clip the bucket stage quarantined (key <video>-c<j>) is found as its video, drawn at its first frame
    wanted = [k for e in shown for k in (e["key"], e.get("video_key")) if k]
    samples = find_samples(prep_dir, stage, wanted) if stage != "ingest" else {}
    thumbs: list[Any] = []
    for entry in shown:
        try:
            if stage == "ingest":
                found = _source_sample(prep_dir, entry)
                if found is None:
                    raise FileNotFoundError(entry.get("source"))
                sample, meta = found
            else:
                sample = samples.get(entry["key"]) or samples[entry["video_key"]]
                meta = json.loads(sample.get("json") or b"{}")
                if entry["key"] not in samples:
                    meta["clip"] = entry["clip"]
            thumbs.append(thumbnail(sample, meta))
        except Exception:  # any decoder's error, a missing sample: the tile says so
            thumbs.append(None)
    cols = max(min(4, columns), min(columns, len(shown)))  # at least 4 wide, so the title fits
    rows = max(1, math.ceil(len(shown) / cols))
    more = len(entries) - len(shown)
    captions = [_tile_caption(e) for e in shown]
    caption_h = 0.12 * max((len(c.splitlines()) for c in captions), default=2) + 0.08
    tile_w, image_h, title_h = 1.6, 1.45, 0.9  # inches
    width, height = cols * tile_w, title_h + rows * (image_h + caption_h)
    with _style(mpl):
        fig = mpl.figure.Figure(figsize=(width, height))
        # the reason on at most two lines (a decoder's message can be long)
        head = textwrap.wrap(f"{stage}: {reason}", width=int(width * 13))
        head = "\n".join(head[:1] + [textwrap.shorten(" ".join(head[1:]), width=int(width * 13), placeholder="...")]
                         if len(head) > 1 else head)
        count = f"{len(entries)} sample{'s' if len(entries) != 1 else ''}" + (f", first {len(shown)} shown, +{more} more" if more else "")
        fig.text(0.5, 1 - 0.1 / height, head, ha="center", va="top", fontsize=9)
        fig.text(0.5, 1 - 0.62 / height, count, ha="center", va="center", fontsize=8)
        for i, (caption, thumb) in enumerate(zip(captions, thumbs)):
            row, col = divmod(i, cols)
            top = height - title_h - row * (image_h + caption_h)  # inches from the bottom
            ax = fig.add_axes(((col * tile_w + 0.05) / width, (top - image_h + 0.05) / height,
                               (tile_w - 0.1) / width, (image_h - 0.1) / height))
            ax.set_xticks([])
            ax.set_yticks([])
            if thumb is None:
                ax.imshow(np.full((THUMB_SIDE, THUMB_SIDE, 3), 170, np.uint8))
                ax.text(THUMB_SIDE / 2, THUMB_SIDE / 2, "cannot decode", ha="center", va="center", fontsize=8)
            else:
                ax.imshow(np.asarray(thumb))
            fig.text((col + 0.5) * tile_w / width, (top - image_h) / height, caption, ha="center", va="top",
                     fontsize=6, family="monospace", linespacing=1.1)
        path = out / f"quarantine_{stage}-{slug(reason)}.png"
        _save(fig, path)
        tiles = len(fig.axes)
    undecodable = sum(t is None for t in thumbs)
    line = (f"quarantine at {stage}, {reason}: {len(entries)} sample{'s' if len(entries) != 1 else ''}, "
            f"{len(shown)} shown"
            + (f" (+{more} more)" if more else "") + (f", {undecodable} cannot be decoded" if undecodable else ""))
    return Plot(path.name, path, line, {"stage": stage, "reason": reason, "tiles": tiles,
                                        "keys": [e["key"] for e in shown], "more": more,
                                        "undecodable": undecodable})


# ---------------------------------------------------------------------------------------------------------
# All of them
# ---------------------------------------------------------------------------------------------------------


def write_plots(prep_dir: Path, out: Path, cap: int = CAP, max_sheets: int = MAX_SHEETS,
                prune: bool = False) -> list[Plot]:
    """Write every picture of a prep into ``out`` and an ``index.md`` linking them; return them in order:
    score histograms (one per score column), the bucket histogram, contact sheets per (stage, reason).

    ``prune``: remove the pictures of an earlier call that this one did not draw (a reason gone, a scorer
    off), matched by this module's file names only; for a folder this module owns (``prep/plots``)."""
    require_matplotlib()
    prep_dir, out = Path(prep_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Plot] = []
    columns = load_scores(prep_dir, light=True)
    thresholds = score_thresholds(prep_dir)
    for name in [c for c in columns if c not in SCORE_META_COLUMNS]:
        plots.append(score_histogram(name, columns, thresholds.get(name, {}), out))
    buckets = bucket_histogram(prep_dir, out)
    if buckets is not None:
        plots.append(buckets)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for entry in quarantine_entries(prep_dir):
        groups.setdefault((entry["stage"], entry["reason"]), []).append(entry)
    # the most frequent reasons first; ties in pipeline order, then by reason
    ranked = sorted(groups, key=lambda g: (-len(groups[g]), STAGE_ORDER.index(g[0]), g[1]))
    for stage, reason in ranked[:max_sheets]:
        plots.append(contact_sheet(stage, reason, groups[(stage, reason)], prep_dir, out, cap))
    left = [(g, len(groups[g])) for g in ranked[max_sheets:]]
    if prune:
        drawn = {p.name for p in plots}
        for pattern in ("score_*.png", "buckets.png", "quarantine_*.png"):
            for stale in sorted(out.glob(pattern)):
                if stale.name not in drawn:
                    stale.unlink()
    (out / "index.md").write_text(index_markdown(plots, prep_dir, left))
    return plots


PLOTS_VERSION = 1  # in the inputs key of a plots folder: a change in what is drawn redraws
INPUTS_FILE = "plots.json"  # a plots folder's inputs key and pictures, for update_plots


def inputs_key(prep_dir: Path) -> str:
    """What the pictures of a prep are drawn from: the hashes of the stage manifests, quarantine lists and
    scores table (small files next to the data, never the shards), and this module's version."""
    from latentmill.core.hashing import sha256_file, stable_hash

    files = [prep_dir / "scores.parquet"] + [prep_dir / stage / name for stage in STAGE_ORDER
                                             for name in ("manifest.json", "quarantine.jsonl")]
    return stable_hash({"version": PLOTS_VERSION, "cap": CAP, "max_sheets": MAX_SHEETS,
                        "files": {p.relative_to(prep_dir).as_posix(): sha256_file(p) for p in files if p.is_file()}})


def update_plots(prep_dir: Path, out: Path) -> tuple[list[Plot], bool]:
    """The pictures of a prep in a folder this module owns (``prep/plots``), drawn again only when what they
    are drawn from changed (:func:`inputs_key`): a prep that changed nothing draws nothing. Returns the
    pictures and whether they were drawn now; stale pictures of an earlier prep are removed."""
    prep_dir, out = Path(prep_dir), Path(out)
    key, saved = inputs_key(prep_dir), out / INPUTS_FILE
    if saved.is_file():
        try:
            known = json.loads(saved.read_text())
            found = [Plot(p["name"], out / p["name"], p["summary"], p["data"]) for p in known["plots"]]
            if known["key"] == key and all(p.path.is_file() for p in found):
                return found, False
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: draw again
    drawn = write_plots(prep_dir, out, prune=True)
    tmp = saved.with_name(saved.name + ".tmp")
    tmp.write_text(json.dumps({"key": key, "plots": [{"name": p.name, "summary": p.summary, "data": p.data}
                                                     for p in drawn]}, indent=1))
    tmp.replace(saved)
    return drawn, True


def index_markdown(plots: list[Plot], prep_dir: Path, left: list[tuple[tuple[str, str], int]] = ()) -> str:
    """``index.md``: one section per picture, its summary line and the image (linked by file name)."""
    lines = [f"# Pictures of {prep_dir}", ""]
    for plot in plots:
        lines += [f"## {plot.name}", "", plot.summary, "", f"![{plot.name}]({plot.name})", ""]
    if left:
        lines += ["## Reasons without a contact sheet", ""]
        lines += [f"- {stage}: {reason} ({count} samples)" for (stage, reason), count in left]
        lines.append("")
    return "\n".join(lines)


def artifact_markdown(plots: list[Plot], inline_bytes: int = 1 << 20) -> str:
    """Markdown for a Prefect artifact: every picture with its summary, inline (base64 PNG) while their total
    stays under ``inline_bytes``, else as a ``file://`` link (a server's UI cannot show a worker's disk)."""
    import base64

    lines, inlined = ["# Prep pictures", ""], 0
    for plot in plots:
        size = plot.path.stat().st_size
        lines += [f"### {plot.name}", "", plot.summary, ""]
        if inlined + size <= inline_bytes:
            inlined += size
            data = base64.b64encode(plot.path.read_bytes()).decode("ascii")
            lines += [f"![{plot.name}](data:image/png;base64,{data})", ""]
        else:
            lines += [f"[{plot.name}]({plot.path.resolve().as_uri()})", ""]
    return "\n".join(lines)
