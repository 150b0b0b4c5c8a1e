"""Where each model component of a recipe comes from, and whether a latent cache was made by those components.

A recipe names a Diffusers pipeline (``model.pretrained``: a local folder or a hub id such as
``black-forest-labs/FLUX.1-dev``) and may override single components (``model.vae=PATH``). Everything that
loads a component goes through :func:`component_source`; the fingerprints of what it finds are
:mod:`latentmill.core.fingerprints`' (:func:`cached_model_fingerprints` takes those of the cached components).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from latentmill.core.fingerprints import ComponentSource, component_dir, component_fingerprint

# Components whose outputs are cached; the trainer never loads them.
CACHED_COMPONENTS = ("vae", "text_encoder", "text_encoder_2")


class CacheMismatchError(RuntimeError):
    """Cached latents were produced by other models or settings than the recipe asks for."""


@dataclass
class ModelConfig:
    """Which pretrained pipeline to use, with optional per-component overrides."""

    pretrained: str
    # "auto": read from the pipeline's model_index.json; else a family of latentmill.stages.families.FAMILIES
    family: str = "auto"
    vae: Optional[str] = None
    text_encoder: Optional[str] = None
    text_encoder_2: Optional[str] = None
    # A tiny-model recipe (e.g. data/tiny-flux.yaml): build `pretrained` from it when the folder is missing.
    tiny_recipe: Optional[str] = None


def known_families() -> list[str]:
    """The model families latentmill caches and trains, found without importing them (no torch): one module
    ``stages/family_<name>.py`` each, ``_`` in the module name for ``-`` in the family's, and for ``.``
    between two digits (``family_wan2_2_ti2v``: ``wan2.2-ti2v``)
    (``latentmill.stages.families.FAMILIES`` registers their classes)."""
    import pkgutil
    import re

    import latentmill.stages

    return sorted(re.sub(r"(?<=\d)_(?=\d)", ".", module.name.removeprefix("family_")).replace("_", "-")
                  for module in pkgutil.iter_modules(latentmill.stages.__path__) if module.name.startswith("family_"))


def component_source(model: ModelConfig, name: str) -> ComponentSource:
    """Resolve component ``name`` (``vae``, ``text_encoder``, ``tokenizer``...) to a loadable source."""
    override = getattr(model, name, None)
    if override:
        # An override is either a component folder itself or a pipeline folder that has the subfolder.
        if (Path(override) / name / "config.json").is_file():
            return ComponentSource(override, name)
        return ComponentSource(override, None)
    return ComponentSource(model.pretrained, name)


class LoadedOnce:
    """Models (or anything costly to load) kept once per process by key: the threads of one worker share
    them, and a key that changes (a changed folder's fingerprint) loads anew. ``release`` forgets them all
    (``pipelines.prep.release_prep_models``)."""

    def __init__(self) -> None:
        self._items: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, load: Any) -> Any:
        """The item under ``key``, made by ``load()`` the first time."""
        with self._lock:
            if key not in self._items:
                self._items[key] = load()
            return self._items[key]

    def release(self) -> int:
        """Forget every item; returns how many there were."""
        with self._lock:
            count = len(self._items)
            self._items.clear()
        return count


def read_component_config(src: ComponentSource) -> dict[str, Any]:
    """The component's ``config.json`` as a dict."""
    return json.loads((component_dir(src) / "config.json").read_text())


# An encoder's output depends on its tokenizer (an image encoder's: its image processor) too, so that joins
# its fingerprint.
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "image_encoder": "image_processor"}
# the other folder name a pipeline gives an encoder's processor (HunyuanVideo 1.5 I2V's SigLIP processor)
OTHER_TOKENIZER_NAME = {"image_encoder": "feature_extractor"}


def tokenizer_source(model: ModelConfig, encoder: str) -> ComponentSource:
    """Where the tokenizer of text encoder ``encoder`` lives: beside an override, else in the pipeline; an image
    encoder's processor in ``image_processor/`` (Wan) or, when the pipeline has none, ``feature_extractor/``."""
    name = TOKENIZER_OF[encoder]
    override = getattr(model, encoder, None)
    if override and (Path(override) / name).is_dir():
        return ComponentSource(override, name)
    if encoder in OTHER_TOKENIZER_NAME and not component_dir(ComponentSource(model.pretrained, name)).is_dir():
        return ComponentSource(model.pretrained, OTHER_TOKENIZER_NAME[encoder])
    return ComponentSource(model.pretrained, name)


def cached_model_fingerprints(model: ModelConfig, components: tuple[str, ...] = CACHED_COMPONENTS) -> dict[str, str]:
    """Fingerprints of the components whose outputs the cache stores (text encoders with tokenizers)."""
    prints = {}
    for name in components:
        fp = component_fingerprint(component_source(model, name))
        if name in TOKENIZER_OF:
            fp = hashlib.sha256((fp + component_fingerprint(tokenizer_source(model, name))).encode()).hexdigest()
        prints[name] = fp
    return prints


def check_cache_compatible(manifest: dict[str, Any], model: ModelConfig, family: str | None = None) -> None:
    """Refuse a latent cache whose producing models differ from the recipe's, saying what differs.
    ``family``: the recipe's model family when ``model.family`` is ``auto`` (read from its pipeline)."""
    cached = manifest.get("family", "flux")
    wanted = model.family if model.family != "auto" else family
    if wanted is not None and wanted != cached:
        raise CacheMismatchError(f"the latent cache was made for the {cached!r} family, the recipe's model "
                                 f"({model.pretrained}) is {wanted!r}: run `latentmill prep` with this recipe "
                                 "to cache its latents")
    recorded = manifest.get("models") or {}
    expected = cached_model_fingerprints(model, tuple(recorded) or CACHED_COMPONENTS)
    problems = []
    for name, fp in expected.items():
        have = (recorded.get(name) or {}).get("fingerprint")
        if have != fp:
            src = component_source(model, name)
            where = os.path.join(src.path, src.subfolder or "")
            problems.append(
                f"{name}: cache was made with fingerprint {str(have)[:12]}, recipe's {where} is {fp[:12]}"
            )
    if problems:
        raise CacheMismatchError(
            "the latent cache does not match the recipe's models:\n  "
            + "\n  ".join(problems)
            + "\nRe-run `latentmill prep` with this recipe to re-encode (only the changed components are "
            "redone), or point model.* at the models that made the cache."
        )
