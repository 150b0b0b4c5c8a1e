"""A recipe whose components belong to different model families stops before any work, in one line.

``model.pretrained`` names a pipeline; ``model.vae`` / ``model.text_encoder`` / ``model.text_encoder_2`` may swap
single components. A Wan VAE under a Z-Image transformer, or a T5 encoder where Qwen3 is expected, would
otherwise fail deep inside the cache stage or, worse, cache latents the transformer cannot read. Checked from
config files only: ``model.family``, when set, must be the family of the pipeline's ``_class_name``; and an
overridden local component must be of the kind the pipeline's own component is:

* when the pipeline's component folder is on this machine: the same Diffusers ``_class_name`` (a VAE), the same
  Transformers ``model_type`` (a text encoder);
* else by the class its ``model_index.json`` names (a local folder, the local Hugging Face cache, or the
  published ``model_index.json`` shipped in ``configs/models/<name>/`` for plan): the same Diffusers class, or
  a Transformers class of the same architecture stem (``T5EncoderModel`` ~ ``T5ForConditionalGeneration``,
  ``Qwen3Model`` ~ ``Qwen3ForCausalLM``, but not ``UMT5EncoderModel``).

Nothing is downloaded: a component or pipeline not on this machine is not checked here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig, component_source, read_component_config

OVERRIDABLE = ("vae", "text_encoder", "text_encoder_2")
_HEADS = re.compile(r"(Encoder)?(Model|TextModel|TextModelWithProjection|ForCausalLM|ForConditionalGeneration)$")


def _stem(cls: str) -> str:
    """The architecture of a Transformers class name: ``T5EncoderModel`` -> ``T5``, ``Qwen3ForCausalLM`` -> ``Qwen3``."""
    return _HEADS.sub("", cls)


def _model_index(pretrained: str) -> dict[str, Any] | None:
    """The pipeline's ``model_index.json`` from a local folder, the local HF cache or the shipped published
    configs (``configs/models/<repo name>``); None when none is on this machine."""
    root = Path(pretrained).expanduser()
    if (root / "model_index.json").is_file():
        return json.loads((root / "model_index.json").read_text())
    if root.exists() or pretrained.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(pretrained, "model_index.json")
    except Exception:  # noqa: BLE001 (an id the hub client refuses: nothing cached)
        cached = None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    from latentmill.resources import resource_root

    shipped = resource_root() / "configs" / "models" / pretrained.split("/")[1] / "model_index.json"
    return json.loads(shipped.read_text()) if shipped.is_file() else None


def check_family_components(model: ModelConfig) -> None:
    """ConfigError naming ``model.family`` when the pipeline is another family's, or the first overridden
    component of ``model`` that is not of its pipeline's kind."""
    index = None
    if model.family != "auto":  # (the recipe's validation has imported the registry already)
        from latentmill.stages.families import PIPELINE_FAMILIES

        index = _model_index(model.pretrained) or {}
        other = PIPELINE_FAMILIES.get(index.get("_class_name", ""))
        if other is not None and other != model.family:
            raise ConfigError(f"model.family: {model.family!r}, but model.pretrained {model.pretrained} is a "
                              f"{index['_class_name']} (family {other!r}): components of different model "
                              "families cannot be mixed")
    for name in OVERRIDABLE:
        if not getattr(model, name, None):
            continue
        src = component_source(model, name)
        if not src.is_local:
            continue  # a hub id: its config is not read before work starts (that would download)
        try:
            have = read_component_config(src)
        except (OSError, ValueError):
            continue  # no config to read (check_model_ref reports a missing folder)
        have_cls = have.get("_class_name") or (have.get("architectures") or [""])[0]
        own = Path(model.pretrained).expanduser() / name / "config.json"
        if own.is_file():
            want = json.loads(own.read_text())
            want_cls = want.get("_class_name") or (want.get("architectures") or [""])[0]
            if have.get("model_type") and want.get("model_type"):
                same = have["model_type"].startswith(want["model_type"]) or want["model_type"].startswith(
                    have["model_type"])  # clip_text_model within clip
            else:
                same = have_cls == want_cls
        else:
            index = index if index is not None else (_model_index(model.pretrained) or {})
            entry = index.get(name)
            if not entry:
                continue
            want_cls = entry[1]
            same = have_cls == want_cls if entry[0] == "diffusers" else _stem(have_cls) == _stem(want_cls)
        if not same:
            pipeline = (index or {}).get("_class_name") or _model_index(model.pretrained) or {}
            pipeline = pipeline if isinstance(pipeline, str) else pipeline.get("_class_name", "pipeline")
            raise ConfigError(f"model.{name}: {getattr(model, name)} ({have_cls}) does not match the {pipeline}'s "
                              f"{name} ({want_cls}) of model.pretrained {model.pretrained}: components of "
                              "different model families cannot be mixed")
