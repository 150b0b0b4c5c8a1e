"""The ``sidecar`` captioner: the caption ingest found with the media (a ``.txt`` / ``.json`` sidecar file, a
manifest column, a webdataset ``txt`` member), stored as ``sidecar_caption`` with its ``caption_origin``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from latentmill.stages.captioners import CaptionItem, CaptionResult


def sidecar_provenance(meta: dict[str, Any]) -> dict[str, Any]:
    """Where an ingest caption came from: ingest's ``caption_origin``, else the ``.txt`` beside the source."""
    if meta.get("caption_origin"):
        return {"captioner": "sidecar", "origin": meta["caption_origin"]}
    return {"captioner": "sidecar", "file": str(Path(meta.get("source", "?")).with_suffix(".txt"))}


class SidecarCaptioner:
    """The captions ingest found with the media (``sidecar_caption``)."""

    name = "sidecar"

    def fingerprint(self) -> dict[str, Any]:
        return {"captioner": self.name, "version": 1}

    def caption(self, items: list[CaptionItem]) -> list[CaptionResult]:
        results = []
        for item in items:
            text = item.meta.get("sidecar_caption")
            if text is None or not text.strip():
                problem = item.meta.get("sidecar_problem")
                results.append(CaptionResult(error=f"its caption sidecar gave no caption: {problem}" if problem else
                                             "ingest found no caption for it (no sidecar file, column or member)"))
            else:
                results.append(CaptionResult([text], [sidecar_provenance(item.meta)]))
        return results

    def stats(self) -> dict[str, Any]:
        return {}
