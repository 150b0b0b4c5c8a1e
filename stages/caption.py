"""Caption: give every raw sample a ``.txt`` caption and record where it came from.

Captioners are pluggable: an object with a ``name``, a ``fingerprint()`` (what decides its output) and
``caption(metas) -> list[str | None]`` over a batch of sample metadata. ``sidecar`` uses the captions that
ingest found next to the media files; model-based captioners plug in through :data:`CAPTIONERS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from stages.shardio import (
    StageDir,
    UnitOutput,
    WorkUnit,
    json_bytes,
    read_shard,
    sample_json,
    units_per_shard,
)

STAGE = "caption"


@dataclass
class CaptionConfig:
    """Which captioner runs and what happens to samples without a caption."""

    captioner: Literal["sidecar"] = "sidecar"
    on_missing: Literal["quarantine", "keep_empty"] = "quarantine"
    max_chars: int = 1000  # longer captions are cut at a word boundary


class Captioner(Protocol):
    name: str

    def fingerprint(self) -> dict[str, Any]: ...

    def caption(self, metas: list[dict[str, Any]]) -> list[str | None]: ...


class SidecarCaptioner:
    """Captions from ``.txt`` files next to the media (read by ingest into ``sidecar_caption``)."""

    name = "sidecar"

    def fingerprint(self) -> dict[str, Any]:
        return {"captioner": self.name, "version": 1}

    def caption(self, metas: list[dict[str, Any]]) -> list[str | None]:
        return [m.get("sidecar_caption") for m in metas]


CAPTIONERS: dict[str, type] = {"sidecar": SidecarCaptioner}


def build_captioner(cfg: CaptionConfig) -> Captioner:
    """The captioner named by ``caption.captioner``."""
    return CAPTIONERS[cfg.captioner]()


def clean_caption(text: str | None, max_chars: int) -> str:
    """Normalise whitespace and cut overlong captions at a word boundary."""
    text = re.sub(r"\s+", " ", text or "").strip()
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0]
    return text


def fingerprint(cfg: CaptionConfig, captioner: Captioner) -> dict[str, Any]:
    return {"stage": STAGE, "version": 1, "captioner": captioner.fingerprint(),
            "on_missing": cfg.on_missing, "max_chars": cfg.max_chars}


def plan(cfg: CaptionConfig, upstream: StageDir, captioner: Captioner | None = None) -> list[WorkUnit]:
    """One unit per upstream shard, keyed by the shard's hash and the captioning fingerprint."""
    return units_per_shard(upstream, fingerprint(cfg, captioner or build_captioner(cfg)))


def process(cfg: CaptionConfig, unit: WorkUnit, out: UnitOutput, captioner: Captioner | None = None) -> None:
    """Caption every sample of the unit's shard; samples without a caption follow ``on_missing``."""
    captioner = captioner or build_captioner(cfg)
    samples = list(read_shard(unit.payload["shard"]))
    metas = [sample_json(s) for s in samples]
    captions = captioner.caption(metas)
    for sample, meta, text in zip(samples, metas, captions):
        text = clean_caption(text, cfg.max_chars)
        if not text and cfg.on_missing == "quarantine":
            out.quarantine(sample["__key__"], meta["source"],
                           f"no caption from captioner {captioner.name!r} (set caption.on_missing=keep_empty "
                           "to train it unconditionally)")
            continue
        meta["caption"] = text
        meta["caption_provenance"] = {"captioner": captioner.name, **captioner.fingerprint()}
        if meta.get("sidecar_caption") is not None and captioner.name == "sidecar":
            meta["caption_provenance"]["file"] = str(Path(meta["source"]).with_suffix(".txt"))
        out.add({**sample, "txt": text.encode("utf-8"), "json": json_bytes(meta)})
