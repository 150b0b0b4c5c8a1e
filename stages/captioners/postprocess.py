"""Caption post-processing: boilerplate prefixes, whitespace, blocked and rejected phrases, length limits.

Every caption the stage writes goes through :meth:`CaptionRules.clean`, in this order:

1. ``normalise`` the text: NFC, control characters and U+FFFD (undecodable bytes) dropped, runs of spaces,
   tabs and newlines made one space, trimmed, separators left at either end dropped;
2. ``strip_prefixes``: strip boilerplate prefixes (``caption.strip_prefixes``, case-insensitive, repeatedly,
   only at a word boundary: "The image shows a cat" -> "a cat"). Only from captions a captioning model
   wrote, unless ``caption.strip_prefixes_from`` is ``all``: a hand-written sidecar that says "a picture of
   ..." is kept as written;
3. ``blocklist``: delete blocklisted phrases (``caption.blocklist``, case-insensitive, whole words) and tidy
   the separators they leave behind ("a cat, watermark, grass" -> "a cat, grass");
4. reject a caption that contains a ``caption.reject`` phrase (e.g. a model's refusal);
5. ``max_chars``: cut at ``caption.max_chars`` on a word boundary; refuse captions shorter than
   ``caption.min_chars``.

:meth:`CaptionRules.clean` names the rules (1, 2, 3, 5) that changed a caption, so the stage can count them.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

# Phrases vision-language models open captions with; they carry no information about the image.
DEFAULT_STRIP_PREFIXES: tuple[str, ...] = (
    "The image shows",
    "This image shows",
    "The image depicts",
    "This image depicts",
    "The image features",
    "This image features",
    "The image is",
    "This image is",
    "The picture shows",
    "This picture shows",
    "The photo shows",
    "This photo shows",
    "The video shows",
    "This video shows",
    "The video depicts",
    "This video depicts",
    "In this image,",
    "In the image,",
    "In this picture,",
    "In this video,",
    "In the video,",
    "This is an image of",
    "This is a picture of",
    "An image of",
    "A picture of",
)

_EDGE_PUNCT = " ,;:-"


def _phrase_pattern(phrase: str) -> re.Pattern[str]:
    """Case-insensitive match of ``phrase`` that does not start or end inside a word."""
    return re.compile(rf"(?<!\w){re.escape(phrase.strip())}(?!\w)", re.IGNORECASE)


def _tidy(text: str) -> str:
    """Collapse whitespace and the empty separators a deleted phrase leaves (" , ," -> ",")."""
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"\s+([,;:.!?])", r"\1", text)
    text = re.sub(r"([,;:])(?:\s*[,;:])+", r"\1", text)
    return text.strip(_EDGE_PUNCT)


STRIP_FROM = ("model", "all")  # caption.strip_prefixes_from


@dataclass(frozen=True)
class Cleaned:
    """A caption after the rules: its text, why none is left (``reason``), and the rules that changed it."""

    text: str
    reason: str | None = None
    rewritten_by: tuple[str, ...] = ()


def _normalise(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    text = "".join(c for c in text if c.isspace() or (c != "\ufffd" and unicodedata.category(c) != "Cc"))
    return re.sub(r"\s+", " ", text).strip()


@dataclass(frozen=True)
class CaptionRules:
    """The post-processing rules of the caption stage (part of its fingerprint)."""

    strip_prefixes: tuple[str, ...] = DEFAULT_STRIP_PREFIXES
    blocklist: tuple[str, ...] = ()
    reject: tuple[str, ...] = ()
    max_chars: int = 1000
    min_chars: int = 1
    strip_prefixes_from: str = "model"  # "model": captions a captioning model wrote; "all": every caption

    def fingerprint(self) -> dict[str, Any]:
        # version 2: prefixes are stripped from model captions only (strip_prefixes_from)
        return {"version": 2, "strip_prefixes": list(self.strip_prefixes), "blocklist": list(self.blocklist),
                "reject": list(self.reject), "max_chars": self.max_chars, "min_chars": self.min_chars,
                "strip_prefixes_from": self.strip_prefixes_from}

    def apply(self, text: str | None) -> tuple[str, str | None]:
        """``(clean caption, None)``, or ``("", reason)`` when no usable caption is left; a model caption."""
        cleaned = self.clean(text)
        return cleaned.text, cleaned.reason

    def clean(self, text: str | None, by_model: bool = True) -> Cleaned:
        """The caption after every rule that applies to it; ``by_model``: a captioning model wrote it."""
        changed: list[str] = []

        def step(rule: str, before: str, after: str) -> str:
            if after != before and rule not in changed:
                changed.append(rule)
            return after

        strip = by_model or self.strip_prefixes_from == "all"
        raw = text or ""
        text = step("normalise", raw, _normalise(raw))
        if strip:
            text = step("strip_prefixes", text, self._strip_prefixes(text))
        blocked = text
        for phrase in self.blocklist:
            if phrase.strip():
                blocked = _phrase_pattern(phrase).sub(" ", blocked)
        # What _tidy changes is the blocklist's work after a deletion, else normalising (an end's separator)
        text = step("blocklist" if blocked != text else "normalise", text, _tidy(blocked))
        if strip:  # a deleted phrase may have hidden a prefix
            text = step("strip_prefixes", text, self._strip_prefixes(text))
        for phrase in self.reject:
            if phrase.strip() and _phrase_pattern(phrase).search(text):
                return Cleaned("", f"caption contains the rejected phrase {phrase!r} (caption.reject)")
        if len(text) > self.max_chars:
            cut = text[: self.max_chars]
            # Cut on a word boundary unless the caption is one overlong word.
            text = step("max_chars", text, (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(_EDGE_PUNCT))
        if not text:
            return Cleaned("", "empty caption")
        if len(text) < self.min_chars:
            return Cleaned("", f"caption {text!r} is shorter than caption.min_chars={self.min_chars}")
        return Cleaned(text, None, tuple(changed))

    def _strip_prefixes(self, text: str) -> str:
        prefixes = sorted((p.strip() for p in self.strip_prefixes if p.strip()), key=len, reverse=True)
        changed = True
        while changed and text:
            changed = False
            lowered = text.lower()
            for prefix in prefixes:
                n = len(prefix)
                if not lowered.startswith(prefix.lower()):
                    continue
                if n == len(text) or not (text[n].isalnum() and prefix[-1].isalnum()):  # word boundary
                    text = text[n:].lstrip(_EDGE_PUNCT)
                    changed = True
                    break
        return text
