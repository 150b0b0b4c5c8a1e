"""The model card written with every export: ``README.md`` in the Hugging Face card format.

YAML front matter (``base_model``, ``library_name: diffusers``, ``license`` from ``trainer.license``, ``tags``,
``instance_prompt`` when the captions share a trigger phrase, a ``widget`` of the validation images), then what
made the weights: family, full or LoRA (rank), steps, learning rate and schedule, the dataset snapshot and its
prep (samples, buckets, captioner, curation thresholds, counts per stage) and the last validation grid, copied
into ``images/`` beside the card. A card never holds a local absolute path (a local folder shows as its name)
nor anything read from the environment, so it can be pushed as it is (``latentmill push``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Iterable

import yaml

IMAGES = "images"  # the card's pictures, beside README.md


def public(value: Any) -> str:
    """``value`` as it may appear on a public card: a local path becomes its last name, a URL loses its
    user and password."""
    text = str(value)
    if text.startswith(("/", "~", "file:")) or re.match(r"^[A-Za-z]:[\\/]", text):
        return re.split(r"[\\/]", text.rstrip("\\/"))[-1]  # a Windows path too, on any system
    return re.sub(r"://[^/@\s]+@", "://", text)


def is_hub_id(pretrained: str) -> bool:
    """``owner/name`` of the Hugging Face Hub (not a local folder)."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", pretrained)) and not Path(pretrained).exists()


def trigger_phrase(captions: Iterable[str]) -> str | None:
    """The phrase every caption starts with, up to its first comma (``ohwx dog, on a sofa`` -> ``ohwx dog``),
    when there are two captions or more and all share it; None otherwise (stops at the first that differs)."""
    shared, seen = None, 0
    for caption in captions:
        head = caption.split(",")[0].strip()
        if not head or (shared is not None and head != shared):
            return None
        shared, seen = head, seen + 1
    return shared if seen >= 2 else None


def model_card(*, cfg: Any, info: dict[str, Any], pretrained: str, steps: int, final_loss: float,
               video: bool, trigger: str | None, images: list[str], prompts: list[str]) -> str:
    """The card's text. ``info``: the run's provenance (``snapshot``, ``snapshot_content_id``, ``family``,
    ``samples``, ``buckets``, ``prep``); ``images``: paths relative to the card."""
    family, lora = info.get("family", "flux"), cfg.mode == "lora"
    front: dict[str, Any] = {}
    if is_hub_id(pretrained):
        front["base_model"] = pretrained
    front["library_name"] = "diffusers"
    if cfg.license:
        front["license"] = cfg.license
    front["tags"] = ["text-to-video" if video else "text-to-image", "diffusers", "latentmill", family,
                     *(["lora"] if lora else [])]
    if trigger:
        front["instance_prompt"] = trigger
    if images:
        front["widget"] = [{"text": prompts[0] if prompts else "", "output": {"url": images[-1]}}]
    base = pretrained if is_hub_id(pretrained) else f"a local pipeline folder ({public(pretrained)})"
    kind = f"LoRA (rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g})" if lora else "full fine-tune"
    prep = info.get("prep") or {}
    curation = prep.get("curation") or {}
    rows = [
        ("base model", base), ("family", family), ("training", kind), ("steps", steps),
        ("final loss", f"{final_loss:.5f}"),
        ("learning rate", f"{cfg.learning_rate:g}, {cfg.lr_schedule} schedule, {cfg.warmup_steps} warmup steps"),
        ("batch size", f"{cfg.batch_size} per rank x {cfg.grad_accum_steps} accumulation"),
        ("timesteps", f"{cfg.timestep_sampling}, shift {cfg.shift:g} ({cfg.shift_mode})"),
        ("dataset snapshot", f"{info.get('snapshot', '?')} (content id {str(info.get('snapshot_content_id', '?'))[:16]})"),
        ("samples", f"{info.get('samples', '?')}" + (f" ({info['held_out']} held out for evaluation, never trained on)"
                                                       if info.get("held_out") else "")),
        ("captioner", prep.get("captioner") or "?"),
        ("curation scorers", ", ".join(curation.get("scorers", [])) or "none"),
        ("curation thresholds", ", ".join(f"{k} {v}" for k, v in sorted(curation.get("thresholds", {}).items()))
         or "none"),
    ]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {family} {'LoRA' if lora else 'fine-tune'} trained with latentmill", "",
             f"A {kind} of {base}, trained for {steps} steps with latentmill's flow-matching trainer on dataset "
             f"snapshot `{info.get('snapshot', '?')}`.", ""]
    if trigger:
        lines += ["## Trigger words", "", f"Every training caption starts with `{trigger}`: use it in prompts.", ""]
    lines += ["## Training", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {public(v)} |" for k, v in rows]
    buckets = info.get("buckets") or {}
    if buckets:
        lines += ["", "## Resolution buckets (width x height x frames)", "", "| bucket | samples |", "|---|---:|"]
        lines += [f"| {name} | {count} |" for name, count in buckets.items()]
    stages = prep.get("stages") or {}
    if stages:
        lines += ["", "## Data preparation", "", "| stage | in | out | quarantined |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {c['in']} | {c['out']} | {c['quarantined']} |" for name, c in stages.items()]
    if images:
        lines += ["", "## Validation samples", "", f"Prompts: {'; '.join(public(p) for p in prompts)}", ""]
        lines += [f"![{Path(image).stem}]({image})" for image in images]
    load = (f'pipe = DiffusionPipeline.from_pretrained("{base if is_hub_id(pretrained) else "BASE_MODEL"}")\n'
            'pipe.load_lora_weights("THIS_REPO")') if lora else 'pipe = DiffusionPipeline.from_pretrained("THIS_REPO")'
    lines += ["", "## Use", "", "```python", "from diffusers import DiffusionPipeline", "", load, "```", ""]
    return "\n".join(lines)


def write_model_card(folder: Path, *, cfg: Any, info: dict[str, Any], pretrained: str, steps: int,
                     final_loss: float, video: bool, validations: list[str], trigger: str | None) -> Path:
    """Write ``<folder>/README.md`` and copy the last validation grid into ``<folder>/images/``."""
    images = []
    if validations:
        (folder / IMAGES).mkdir(exist_ok=True)
        last = Path(validations[-1])
        shutil.copyfile(last, folder / IMAGES / last.name)
        images.append(f"{IMAGES}/{last.name}")
    text = model_card(cfg=cfg, info=info, pretrained=pretrained, steps=steps, final_loss=final_loss, video=video,
                      trigger=trigger, images=images, prompts=list(cfg.validation_prompts))
    path = folder / "README.md"
    path.write_text(text)
    return path


def public_data(data: Any) -> Any:
    """JSON-like ``data`` with every string made ``public`` (a ``latentmill.json`` or manifest to publish)."""
    if isinstance(data, dict):
        return {key: public_data(value) for key, value in data.items()}
    if isinstance(data, list):
        return [public_data(value) for value in data]
    return public(data) if isinstance(data, str) else data
