"""Model families: which streams a family caches, and the encoders that compute them.

Each family is one module (``stages/family_<name>.py``): a subclass of :class:`Encoders` over unmodified Diffusers /
Transformers components, loaded once per worker, that declares its streams (:class:`Stream`). This module
holds the registry and what every family shares:

- ``flux`` (FLUX.1): :mod:`latentmill.stages.family_flux`;
- ``wan`` (Wan 2.1): :mod:`latentmill.stages.family_wan`;
- ``qwen-image`` (Qwen-Image): :mod:`latentmill.stages.family_qwen_image`;
- ``qwen-image-edit`` (Qwen-Image-Edit): :mod:`latentmill.stages.family_qwen_image_edit` (Qwen-Image's, plus the
  edit's source image);
- ``flux2`` (FLUX.2 [dev]): :mod:`latentmill.stages.family_flux2`;
- ``flux2-klein`` (FLUX.2 [klein]): :mod:`latentmill.stages.family_flux2_klein` (the VAE side is flux2's);
- ``wan2.2-ti2v`` (Wan 2.2 TI2V-5B): :mod:`latentmill.stages.family_wan2_2_ti2v`;
- ``wan2.1-i2v`` (Wan 2.1 I2V-14B): :mod:`latentmill.stages.family_wan2_1_i2v`;
- ``wan2.2-i2v`` (Wan 2.2 I2V A14B, two experts): :mod:`latentmill.stages.family_wan2_2_i2v` (Wan 2.1 I2V's
  condition latents, no image embedding).
- ``hunyuanvideo1.5`` (HunyuanVideo 1.5): :mod:`latentmill.stages.family_hunyuanvideo1_5`.
- ``hunyuanvideo1.5-i2v`` (HunyuanVideo 1.5 image-to-video): :mod:`latentmill.stages.family_hunyuanvideo1_5_i2v`
  (HunyuanVideo 1.5's streams, plus the first frame's latents and SigLIP embedding).
- ``ltx2`` (LTX-2, video with audio): :mod:`latentmill.stages.family_ltx2`.

Adding a family = one module with an ``Encoders`` subclass and one entry in ``FAMILIES``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch
from latentmill.stages.devices import (  # noqa: F401  (the public names of the encoders' devices)
    CUBLAS_WORKSPACE,
    DETERMINISTIC,
    DEVICE_CLASS_ENV,
    ISA_FLAGS,
    cpu_identity,
    deterministic_encoding,
    deterministic_flags,
    device_description,
    encoded_on_key,
    prepare_cublas_determinism,
)
from latentmill.stages.encoders import Encoders, Stream
from latentmill.stages.family_flux import FluxEncoders
from latentmill.stages.family_flux2 import Flux2Encoders
from latentmill.stages.family_flux2_klein import Flux2KleinEncoders
from latentmill.stages.family_hunyuanvideo1_5 import HunyuanVideo15Encoders
from latentmill.stages.family_hunyuanvideo1_5_i2v import HunyuanVideo15I2VEncoders
from latentmill.stages.family_ltx2 import LTX2Encoders
from latentmill.stages.family_qwen_image import QwenImageEncoders
from latentmill.stages.family_qwen_image_edit import QwenImageEditEncoders
from latentmill.stages.family_wan import WanEncoders
from latentmill.stages.family_wan2_1_i2v import WanI2VEncoders
from latentmill.stages.family_wan2_2_i2v import WanI2VA14BEncoders
from latentmill.stages.family_wan2_2_ti2v import WanTI2VEncoders
from latentmill.stages.family_z_image import ZImageEncoders

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig, component_source, read_component_config

FAMILIES: dict[str, type[Encoders]] = {cls.name: cls for cls in (FluxEncoders, WanEncoders, ZImageEncoders,
                                                                QwenImageEncoders, QwenImageEditEncoders, Flux2Encoders,
                                                                Flux2KleinEncoders, WanTI2VEncoders,
                                                                WanI2VEncoders, WanI2VA14BEncoders,
                                                                HunyuanVideo15Encoders, HunyuanVideo15I2VEncoders,
                                                                LTX2Encoders)}
# model_index.json `_class_name` -> family, when the class alone decides (index_family: also its config)
PIPELINE_FAMILIES = {pipeline: cls.name for cls in FAMILIES.values() if not cls.PIPELINE_CONFIG
                     for pipeline in cls.PIPELINES}

__all__ = ["FAMILIES", "PIPELINE_FAMILIES", "index_family", "Encoders", "Stream", "FluxEncoders", "WanEncoders",
           "Flux2Encoders", "Flux2KleinEncoders", "WanI2VEncoders", "WanI2VA14BEncoders",
           "LTX2Encoders"]


def family_class(family: str) -> type[Encoders]:
    """The :class:`Encoders` subclass of ``family``; a ConfigError naming the known families otherwise."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise ConfigError(f"model.family: {family!r} is not a known family; allowed: 'auto', "
                          f"{', '.join(repr(f) for f in FAMILIES)}") from None


def index_family(index: dict[str, Any]) -> str | None:
    """The family of a pipeline's ``model_index.json``: of the families that list its ``_class_name``, the one
    whose ``PIPELINE_CONFIG`` matches the most keys (Wan 2.2 TI2V's ``expand_timesteps`` before Wan 2.1's
    plain WanPipeline); None when no family lists it."""
    matches = [cls for cls in FAMILIES.values() if index.get("_class_name") in cls.PIPELINES
               and all(index.get(key) == value for key, value in cls.PIPELINE_CONFIG.items())]
    return max(matches, key=lambda cls: len(cls.PIPELINE_CONFIG)).name if matches else None


def detect_family(model: ModelConfig) -> str:
    """The family named by the recipe, or read from the pipeline's ``model_index.json``."""
    if model.family != "auto":
        return family_class(model.family).name
    root = Path(model.pretrained)
    if root.is_dir():
        index = json.loads((root / "model_index.json").read_text())
    else:
        from huggingface_hub import hf_hub_download

        index = json.loads(Path(hf_hub_download(model.pretrained, "model_index.json")).read_text())
    family = index_family(index)
    if family is None:
        raise ConfigError(f"model.family: cannot tell the family of a {index.get('_class_name') or 'unknown'} "
                          f"pipeline; set model.family to one of {', '.join(repr(f) for f in FAMILIES)}")
    return family


def compute_dtypes(family: str, device: torch.device) -> dict[str, torch.dtype]:
    """The dtype the ``vae`` and the ``text`` encoders of ``family`` run in on ``device``
    (:meth:`Encoders.compute_dtypes`). Part of the cache's component keys (``latentmill.stages.cache``)."""
    return family_class(family).compute_dtypes(device)


def family_components(family: str) -> tuple[str, ...]:
    """The components whose outputs a family's cache stores."""
    return family_class(family).COMPONENTS


def family_streams(family: str) -> tuple[Stream, ...]:
    """The streams of a family's cached samples."""
    return family_class(family).STREAMS


def describe_components(model: ModelConfig, family: str) -> dict[str, dict[str, Any]]:
    """Class name of each cached component and the VAE normalisation, without loading any weights."""
    out = {}
    for name in family_components(family):
        config = read_component_config(component_source(model, name))
        out[name] = {"class": config.get("_class_name") or (config.get("architectures") or ["?"])[0]}
    out["vae"].update(family_class(family).describe_vae(read_component_config(component_source(model, "vae"))))
    return out


def import_encoder_classes(family: str) -> None:
    """Import the classes a family's encoders are built from, without loading any weights.

    Diffusers' and transformers' lazy modules take seconds to import (most of a small refresh's cache stage
    on a CPU). The CLI imports them while Prefect's API server boots, a wait it has anyway, so the cache
    stage does not import them afterwards.
    """
    import importlib

    for module, name in family_class(family).CLASS_IMPORTS:
        getattr(importlib.import_module(module), name)


_encoders: dict[tuple, Encoders] = {}
_encoders_lock = threading.Lock()


def get_encoders(model: ModelConfig, family: str, device: torch.device) -> Encoders:
    """Load a family's encoders once per process (the threads of one worker share them)."""
    key = (family, model.pretrained, model.vae, model.text_encoder, model.text_encoder_2, str(device))
    with _encoders_lock:
        if key not in _encoders:
            _encoders[key] = family_class(family)(model, device)
        return _encoders[key]


def release_encoders() -> int:
    """Forget every encoder set this process loaded (the memory goes once nothing else holds them);
    returns how many sets there were."""
    with _encoders_lock:
        count = len(_encoders)
        _encoders.clear()
    return count
