"""Captioners: what turns a raw sample into caption text, behind one small interface.

A captioner is an object with a ``name``, a ``fingerprint()`` (everything that decides its output, so it
can key content-addressed work units) and ``caption(items) -> list[CaptionResult]`` over a batch of
samples. The caption stage (``stages/caption.py``) owns everything around it: which samples need a new
caption (the policy), post-processing, provenance, quarantine.

Implementations:

* ``sidecar`` (:mod:`latentmill.stages.captioners.sidecar`): the caption ingest found next to the media file;
* ``template`` (:mod:`latentmill.stages.captioners.template`): a Python format string over the sample's metadata;
* ``transformers`` (:mod:`latentmill.stages.captioners.hf`): any Hugging Face image-to-text / image-text-to-text
  model (BLIP, BLIP-2, Florence-2, Qwen2-VL class), loaded once per worker with ``from_pretrained``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class CaptionItem:
    """One sample to caption: its key, decoded JSON metadata, raw members and existing captions."""

    key: str
    meta: dict[str, Any]
    sample: dict[str, Any]  # webdataset members: {"__key__": ..., "jpg": bytes, "json": bytes, ...}
    existing: list[str] = field(default_factory=list)  # cleaned existing captions, primary first


@dataclass
class CaptionResult:
    """What a captioner made of one item: captions (primary first) with one provenance dict each.

    ``error`` is set when the item could not be captioned at all (e.g. undecodable media); the stage then
    quarantines it with that reason (or keeps it with an empty caption when ``caption.on_missing`` says so).
    """

    texts: list[str] = field(default_factory=list)
    provenance: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


class Captioner(Protocol):
    """The interface every captioner implements."""

    name: str

    def fingerprint(self) -> dict[str, Any]:
        """JSON-able description of everything that decides this captioner's output."""
        ...

    def caption(self, items: list[CaptionItem]) -> list[CaptionResult]:
        """One result per item, in order."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for the unit record (batches, seconds...); never part of the sample bytes."""
        ...


__all__ = ["CaptionItem", "CaptionResult", "Captioner"]
