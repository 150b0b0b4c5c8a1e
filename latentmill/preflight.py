"""Checks that run before any stage, model load or Prefect start-up: a wrong path fails in one line, at once.

* model references (``model.pretrained``, ``model.vae``, ``model.text_encoder``, ``model.text_encoder_2``,
  ``caption.model``): a local folder must exist; anything else must look like a Hugging Face id
  (``owner/name``). A tiny-model recipe (``model.tiny_recipe``) builds only into its own folder
  (:func:`tiny_target`), so a typo in ``model.pretrained`` never becomes a new model with random weights;
* ``ingest.source`` (``prep``, ``run``): set, and present when it is a local path;
* ``train``: a published snapshot to train on (``run`` publishes one first);
* the process layout (``--nproc``, ``--nnodes``) against ``parallel.strategy``.
"""

from __future__ import annotations

import re
from pathlib import Path

from latentmill.config import ConfigError
from latentmill.recipe import Recipe

# owner/name, as the Hub allows them (letters, digits, '-', '_', '.'; not starting with '.' or '-')
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def tiny_target(tiny_recipe: str | Path) -> Path:
    """The one folder a tiny-model recipe builds into: ``data/tiny-flux.yaml`` -> ``data/models/tiny-flux``."""
    recipe = Path(tiny_recipe)
    return recipe.parent / "models" / recipe.stem


def check_model_ref(key: str, value: str | None, tiny_recipe: str | None = None) -> None:
    """``value`` is an existing folder, a folder ``tiny_recipe`` will build, or looks like a hub id."""
    if not value:
        return
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}: {value} is a file; name a Diffusers pipeline folder or a hub id")
        return
    if tiny_recipe and path.resolve() == tiny_target(tiny_recipe).resolve():
        return  # built from the tiny recipe before the first stage
    if tiny_recipe:
        raise ConfigError(f"{key}: {value} does not exist; the tiny recipe {tiny_recipe} builds only into "
                          f"{tiny_target(tiny_recipe)} (set {key} to that, to an existing folder, or to a hub id)")
    if value.startswith((".", "/", "~")) or not HUB_ID.match(value):
        raise ConfigError(f"{key}: {value} does not exist, and is not a Hugging Face id (owner/name)")


def _local_source(source: str) -> Path | None:
    """The local path ``ingest.source`` names, or None for URLs, fsspec URIs and brace patterns."""
    if "://" in source or "::" in source or any(c in source for c in "{}*?["):
        return None
    return Path(source).expanduser()


def check_recipe(recipe: Recipe, command: str) -> None:
    """Everything about ``recipe`` that can be checked before work starts, for ``command``
    (``prep``, ``train``, ``run`` or ``demo``); ConfigError or FileNotFoundError naming the key."""
    model = recipe.model
    check_model_ref("model.pretrained", model.pretrained, model.tiny_recipe)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        check_model_ref(f"model.{name}", getattr(model, name))
    if command in ("prep", "run", "demo"):
        source = recipe.ingest.require_source()
        local = _local_source(source)
        if local is not None and not local.exists():
            raise ConfigError(f"ingest.source: {source} does not exist")
        if recipe.caption.captioner == "transformers":
            check_model_ref("caption.model", recipe.caption.model)
    if command == "train":
        from latentmill.pipelines.snapshot import resolve_snapshot

        resolve_snapshot(recipe.output_dir, recipe.snapshot)
