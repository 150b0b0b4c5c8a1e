"""A recipe whose components belong to different model families stops before any work, in one line.

``model.pretrained`` names a pipeline (its ``model_index.json`` says which family); ``model.family`` may name one
too, and ``model.vae`` / ``model.text_encoder`` / ``model.text_encoder_2`` may swap single components. A Wan VAE
under a Z-Image transformer, or a T5 encoder where Qwen3 is expected, would otherwise fail deep inside the cache
stage or, worse, cache latents the transformer cannot read. Checked from config files only (no weights):

* the pipeline's family (its ``_class_name``) must be ``model.family`` when that is set;
* an overridden component must be of the kind the pipeline's own component is: the same Diffusers class for a
  VAE, the same ``model_type`` for a Transformers text encoder; without a local pipeline folder (a hub id not on
  this machine, a tiny model still to build), the classes the family declares (``COMPONENT_CLASSES``), if any.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig, component_source, read_component_config

OVERRIDABLE = ("vae", "text_encoder", "text_encoder_2")


def _kind(config: dict[str, Any]) -> tuple[str, str]:
    """(class, model_type) of a component config: a Diffusers ``_class_name`` or Transformers architecture."""
    cls = config.get("_class_name") or (config.get("architectures") or [""])[0]
    return cls, str(config.get("model_type") or "")


def _same_kind(have: tuple[str, str], want: tuple[str, str]) -> bool:
    if have[1] and want[1]:  # transformers: the model type (clip_text_model within clip, t5, umt5, qwen3...)
        return have[1] == want[1] or have[1].startswith(want[1]) or want[1].startswith(have[1])
    return have[0] == want[0]


def check_family_components(model: ModelConfig) -> None:
    """ConfigError naming the first component of ``model`` that belongs to another family (see module doc)."""
    from latentmill.stages.families import PIPELINE_FAMILIES, family_class

    root = Path(model.pretrained).expanduser()
    index_path = root / "model_index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    pipeline_family = PIPELINE_FAMILIES.get((index or {}).get("_class_name", ""))
    if model.family != "auto" and pipeline_family and pipeline_family != model.family:
        raise ConfigError(f"model.family: {model.family!r}, but model.pretrained {model.pretrained} is a "
                          f"{index['_class_name']} (family {pipeline_family!r}); use one family's components")
    family = model.family if model.family != "auto" else pipeline_family
    if family is None:
        return
    declared = getattr(family_class(family), "COMPONENT_CLASSES", {})
    for name in OVERRIDABLE:
        if not getattr(model, name, None):
            continue
        src = component_source(model, name)
        if not src.is_local:
            continue  # a hub id: its config is not read before work starts (that would download)
        try:
            have = _kind(read_component_config(src))
        except (OSError, ValueError):
            continue  # no config to read (check_model_ref reports a missing folder)
        if index is not None and name in index and (root / name / "config.json").is_file():
            want = _kind(read_component_config(component_source(ModelConfig(pretrained=model.pretrained), name)))
            if not _same_kind(have, want):
                raise ConfigError(f"model.{name}: {getattr(model, name)} ({have[0] or have[1]}) does not match the "
                                  f"{family} pipeline's {name} ({want[0] or want[1]}): components of different "
                                  "model families cannot be mixed")
        elif name in declared and have[0] not in declared[name]:
            raise ConfigError(f"model.{name}: {getattr(model, name)} ({have[0] or have[1]}) is not a {family} "
                              f"{name} ({' or '.join(declared[name])}): components of different model families "
                              "cannot be mixed")
