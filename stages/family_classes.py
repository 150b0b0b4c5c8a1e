"""Which component classes make each model family, without torch: the recipe's preflight refuses a recipe that mixes
families (a FLUX.1 VAE under a FLUX.2 transformer, a Wan text encoder with FLUX.1...) before any work starts.

``COMPONENT_CLASSES[family][component]`` lists the ``_class_name`` (diffusers) or ``architectures[0]``
(transformers) values a component of that family may have. ``latentmill.stages.families.FAMILIES`` holds the same
family names (``tests/test_flux2.py`` checks the two agree).
"""

from __future__ import annotations

import json
from pathlib import Path

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig, component_source

COMPONENT_CLASSES: dict[str, dict[str, tuple[str, ...]]] = {
    "flux": {"transformer": ("FluxTransformer2DModel",), "vae": ("AutoencoderKL",),
             "text_encoder": ("CLIPTextModel",), "text_encoder_2": ("T5EncoderModel",)},
    "wan": {"transformer": ("WanTransformer3DModel",), "vae": ("AutoencoderKLWan",),
            "text_encoder": ("UMT5EncoderModel",)},
    "flux2": {"transformer": ("Flux2Transformer2DModel",), "vae": ("AutoencoderKLFlux2",),
              "text_encoder": ("Mistral3ForConditionalGeneration",)},
    "flux2-klein": {"transformer": ("Flux2Transformer2DModel",), "vae": ("AutoencoderKLFlux2",),
                    "text_encoder": ("Qwen3ForCausalLM",)},
}
# model_index.json ``_class_name`` -> family (as the Encoders' PIPELINES say)
PIPELINE_CLASSES = {"FluxPipeline": "flux", "WanPipeline": "wan", "Flux2Pipeline": "flux2",
                    "Flux2KleinPipeline": "flux2-klein"}


def _local_class(model: ModelConfig, name: str) -> tuple[str, str] | None:
    """(class name, where) of component ``name`` when it is in a local folder; None for a hub id or no config."""
    src = component_source(model, name)
    if not src.is_local:
        return None
    folder = Path(src.path) / (src.subfolder or "")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cls = config.get("_class_name") or (config.get("architectures") or [None])[0]
    return (cls, str(folder)) if cls else None


def check_family_components(model: ModelConfig) -> None:
    """ConfigError (one line) when a locally stored component of the recipe belongs to another family than the
    recipe's (``model.family``, or the pipeline's ``model_index.json``). Components behind hub ids are checked
    when they load (the cache stage's encoders, the trainer's first batch)."""
    family = model.family
    if family == "auto":
        root = Path(model.pretrained).expanduser()
        try:
            name = json.loads((root / "model_index.json").read_text()).get("_class_name", "")
        except (OSError, ValueError):
            return
        family = PIPELINE_CLASSES.get(name)
        if family is None:
            return  # an unknown pipeline: detect_family says so, in its own words
    expected = COMPONENT_CLASSES.get(family)
    if expected is None:
        return  # an unknown family: the cache stage says so (stages.families.family_class)
    for name, allowed in expected.items():
        found = _local_class(model, name)
        if found is None or found[0] in allowed:
            continue
        cls, where = found
        owners = [f for f, parts in COMPONENT_CLASSES.items() if cls in parts.get(name, ())]
        key = f"model.{name}" if getattr(model, name, None) else "model.pretrained"
        raise ConfigError(f"{key}: {where} is a {cls}" + (f" (a {'/'.join(owners)} {name})" if owners else "")
                          + f"; the {family!r} family's {name} is a {' or '.join(allowed)}: the recipe mixes "
                          "components of different model families")
