"""Ingest: a folder of images (+ sidecar ``.txt`` captions) into raw shards with per-sample metadata.

Ingest reads headers, not pixels (pixels are decoded once, in the cache stage). Files that are not
readable images, or that the recipe does not accept, go to the quarantine list with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from stages.shardio import StageDir, UnitOutput, WorkUnit, json_bytes, sha256_bytes, sha256_file, stable_hash

STAGE = "ingest"
IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp"}
SIDECAR_EXTENSIONS = {".txt"}


@dataclass
class IngestConfig:
    """Where raw media comes from and how it is grouped into shards."""

    source: str = "data/demo/images"
    shard_size: int = 64  # samples per raw shard (= one work unit)
    max_bytes: int = 64 << 20  # larger files are quarantined instead of read
    max_pixels: int = 8192 * 8192  # decompression-bomb guard, checked on the header
    extensions: list[str] = field(default_factory=lambda: sorted(IMAGE_EXTENSIONS))

    def validate(self) -> None:
        from latentmill.config import ConfigError

        if self.shard_size < 1:
            raise ConfigError(f"ingest.shard_size: must be >= 1, got {self.shard_size}")
        bad = [e for e in self.extensions if e.lower() not in IMAGE_EXTENSIONS]
        if bad:
            raise ConfigError(
                f"ingest.extensions: {bad[0]!r} is not one of {', '.join(sorted(IMAGE_EXTENSIONS))}"
            )


def fingerprint(cfg: IngestConfig) -> dict[str, Any]:
    """What, besides the input bytes, decides ingest's output (the source path does not)."""
    return {"stage": STAGE, "version": 1, "max_bytes": cfg.max_bytes, "max_pixels": cfg.max_pixels,
            "extensions": sorted(e.lower() for e in cfg.extensions)}


def _list_files(root: Path) -> list[Path]:
    if not root.is_dir():
        raise FileNotFoundError(f"ingest.source {root} is not a folder")
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def plan(cfg: IngestConfig) -> list[WorkUnit]:
    """Group the source files into units of ``shard_size`` media files, each keyed by content."""
    root = Path(cfg.source)
    files = _list_files(root)
    accepted = {e.lower() for e in cfg.extensions}
    media, others = [], []
    for path in files:
        suffix = path.suffix.lower()
        if suffix in SIDECAR_EXTENSIONS:
            continue
        (media if suffix in accepted else others).append(path)
    fp = fingerprint(cfg)
    # Odd files (unknown extensions) are samples too: they get quarantined, so nothing disappears silently.
    entries = media + others
    units = []
    for start in range(0, len(entries), cfg.shard_size):
        group = entries[start : start + cfg.shard_size]
        items, ids = [], []
        for path in group:
            rel = path.relative_to(root).as_posix()
            sidecar = path.with_suffix(".txt")
            # Identity = path inside the source + bytes of the file and its caption, never mtimes:
            # a fresh clone or a copy of the same data reuses every unit.
            content_id = stable_hash([rel, sha256_file(path), sha256_file(sidecar) if sidecar.is_file() else None])
            items.append({"path": str(path), "rel": rel, "sidecar": str(sidecar) if sidecar.is_file() else None})
            ids.append(content_id)
        unit_id = stable_hash({"fingerprint": fp, "inputs": ids})
        units.append(WorkUnit(unit_id=unit_id, inputs=ids, payload={"items": items, "root": str(root)},
                              samples_in=len(group)))
    return units


def _probe(data: bytes, cfg: IngestConfig) -> dict[str, Any]:
    """Read an image header: format and size, without decoding pixels."""
    import io

    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        fmt = (img.format or "").lower()
    if width * height > cfg.max_pixels:
        raise ValueError(f"{width}x{height} exceeds ingest.max_pixels={cfg.max_pixels}")
    if width < 1 or height < 1:
        raise ValueError(f"degenerate size {width}x{height}")
    return {"width": width, "height": height, "format": fmt}


def process(cfg: IngestConfig, unit: WorkUnit, out: UnitOutput) -> None:
    """Read each file of the unit; write raw samples or quarantine them with a reason."""
    accepted = {e.lower() for e in cfg.extensions}
    for item in unit.payload["items"]:
        path, rel = Path(item["path"]), item["rel"]
        key = sha256_bytes(rel.encode())[:16]
        suffix = path.suffix.lower()
        if suffix not in accepted:
            out.quarantine(key, rel, f"unsupported file type {suffix or '(none)'}; accepted: "
                           + ", ".join(sorted(accepted)))
            continue
        size = path.stat().st_size
        if size > cfg.max_bytes:
            out.quarantine(key, rel, f"file is {size} bytes, over ingest.max_bytes={cfg.max_bytes}")
            continue
        if size == 0:
            out.quarantine(key, rel, "empty file")
            continue
        data = path.read_bytes()
        try:
            header = _probe(data, cfg)
        except UnidentifiedImageError:
            out.quarantine(key, rel, "not a readable image: unknown format or corrupt header")
            continue
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            out.quarantine(key, rel, f"not a readable image: {err}")
            continue
        caption = None
        if item["sidecar"]:
            caption = Path(item["sidecar"]).read_text(encoding="utf-8", errors="replace").strip()
        meta = {
            "key": key,
            "source": rel,
            "source_root": unit.payload["root"],
            "sha256": sha256_bytes(data),
            "kind": "image",
            "bytes": size,
            **header,
            "sidecar_caption": caption,
        }
        ext = IMAGE_EXTENSIONS[suffix]
        out.add({"__key__": key, ext: data, "json": json_bytes(meta)})


def run(cfg: IngestConfig, stage_dir: StageDir, units: list[WorkUnit] | None = None):
    """Run every unit in this process (the Prefect flow maps ``process`` over units instead)."""
    units = plan(cfg) if units is None else units
    return [stage_dir.run_unit(u, lambda unit, out: process(cfg, unit, out)) for u in units]
