"""The ``template`` captioner: captions from Python format strings over the sample's metadata.

Useful for style datasets with a trigger token (``"trtcrd, {caption}"``) or captions made of folder names
and tags (``"{folder}, {tags}"``). Fields a template can use:

* ``caption`` — the existing caption (sidecar file or upstream metadata; "" when there is none). A
  template that uses it yields one caption per existing caption;
* ``name`` (file name without extension), ``filename``, ``ext``, ``path`` (source path inside the ingest
  source), ``folder`` (the file's parent folder name; "" at the top), ``folders`` (the whole parent path);
* ``tags`` — the sample's ``tags`` metadata joined with ", " ("" when absent);
* every other top-level metadata field (``width``, ``height``, ``kind``, ``key``, ...).
"""

from __future__ import annotations

import string
from pathlib import PurePosixPath
from typing import Any

from latentmill.stages.captioners import CaptionItem, CaptionResult

DERIVED_FIELDS = ("caption", "name", "filename", "ext", "path", "folder", "folders", "tags")


def template_fields(template: str) -> list[str]:
    """The field names ``template`` uses; ValueError on bad syntax or attribute / index access."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        if not field or not field.isidentifier():
            raise ValueError(f"field {{{field}}} must be a plain name such as {{caption}} or {{folder}}")
        names.append(field)
    return names


def _as_text(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return "" if value is None else value


def template_values(meta: dict[str, Any], caption: str) -> dict[str, Any]:
    """The fields a template sees for one sample (see the module docstring)."""
    path = PurePosixPath(str(meta.get("source", "")))
    values = {k: _as_text(v) for k, v in meta.items() if not isinstance(v, dict)}
    values.update({
        "caption": caption,
        "name": path.stem,
        "filename": path.name,
        "ext": path.suffix.lstrip("."),
        "path": str(path),
        "folder": path.parent.name,
        "folders": "" if str(path.parent) == "." else str(path.parent),
        "tags": _as_text(meta.get("tags")),
    })
    return values


class TemplateCaptioner:
    """One caption per template (and per existing caption when the template uses ``{caption}``)."""

    name = "template"

    def __init__(self, templates: list[str]):
        self.templates = list(templates)
        for template in self.templates:
            template_fields(template)

    def fingerprint(self) -> dict[str, Any]:
        return {"captioner": self.name, "version": 1, "templates": self.templates}

    def caption(self, items: list[CaptionItem]) -> list[CaptionResult]:
        results = []
        for item in items:
            result = CaptionResult()
            for template in self.templates:
                uses_caption = "caption" in template_fields(template)
                for base in (item.existing or [""]) if uses_caption else [""]:
                    values = template_values(item.meta, base)
                    missing = [f for f in template_fields(template) if f not in values]
                    if missing:
                        raise KeyError(
                            f"caption.template {template!r}: field {{{missing[0]}}} is not in the metadata of "
                            f"{item.meta.get('source', item.key)}; available: {', '.join(sorted(values))}")
                    result.texts.append(template.format_map(values))
                    result.provenance.append({"captioner": self.name, "template": template})
            results.append(result)
        return results

    def stats(self) -> dict[str, Any]:
        return {}
