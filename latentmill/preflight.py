"""Checks that run before any stage, model load or Prefect start-up: a wrong path fails in one line, at once.

* model references (``model.pretrained``, ``model.vae``, ``model.text_encoder``, ``model.text_encoder_2``,
  ``caption.model``): a local folder must exist (``model.pretrained``: with a ``model_index.json``);
  anything else must look like a Hugging Face id (``owner/name``). A tiny-model recipe
  (``model.tiny_recipe``) builds only into its own folder (:func:`tiny_target`), so a typo in
  ``model.pretrained`` never becomes a new model with random weights; a hub id or an existing folder in
  ``model.pretrained`` takes the normal ``from_pretrained`` path and the tiny recipe is not used;
* ``ingest.source`` (``prep``, ``run``): set, present when it is a local path, and a local folder holds at
  least one image or video;
* components of one family: for a family that declares its classes (``latentmill.component_classes``), a local
  pipeline or component folder of another family's class (a FLUX.1 VAE in a Qwen-Image recipe) fails in one
  line naming the key, the class found and the class needed (:func:`check_component_classes`);
* ``train``: a published snapshot to train on (``run`` publishes one first);
* the process layout (``--nproc``, ``--nnodes``) against ``parallel.strategy``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig
from latentmill.recipe import Recipe

# owner/name, as the Hub allows them (letters, digits, '-', '_', '.'; not starting with '.' or '-')
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def tiny_target(tiny_recipe: str | Path) -> Path:
    """The one folder a tiny-model recipe builds into: ``data/tiny-flux.yaml`` -> ``data/models/tiny-flux``;
    a shipped recipe's in :func:`latentmill.resources.models_dir` (never inside an installed package)."""
    from latentmill.resources import shipped_model_target

    recipe = Path(tiny_recipe)
    return shipped_model_target(recipe) or recipe.parent / "models" / recipe.stem


def looks_like_hub_id(value: str) -> bool:
    """``value`` has the shape of a Hugging Face id (``owner/name``), not of a local path."""
    return not value.startswith((".", "/", "~")) and bool(HUB_ID.match(value))


def tiny_build_target(model: ModelConfig) -> Path | None:
    """The folder the tiny recipe builds for ``model`` (its ``model.pretrained``, when that is the recipe's own
    folder), or None: no tiny recipe, or ``model.pretrained`` names something else (a hub id, another folder),
    which loads through ``from_pretrained`` like any user's model."""
    if not model.tiny_recipe or not model.pretrained:
        return None
    path = Path(model.pretrained).expanduser()
    return path if path.resolve() == tiny_target(model.tiny_recipe).resolve() else None


def check_model_ref(key: str, value: str | None, tiny_recipe: str | None = None, pipeline: bool = False) -> None:
    """``value`` is an existing folder, a folder ``tiny_recipe`` will build, or looks like a hub id.

    ``pipeline``: an existing folder must be a Diffusers pipeline folder (hold ``model_index.json``)."""
    if not value:
        return
    path = Path(value).expanduser()
    if tiny_recipe and path.resolve() == tiny_target(tiny_recipe).resolve():
        return  # built from the tiny recipe before the first stage (an interrupted build is replaced)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}: {value} is a file; name a Diffusers pipeline folder or a hub id")
        if pipeline and not (path / "model_index.json").is_file():
            raise ConfigError(f"{key}: {value} is not a Diffusers pipeline folder (no model_index.json); name "
                              "the folder a pipeline's save_pretrained wrote, or a hub id such as "
                              "black-forest-labs/FLUX.1-dev")
        return
    if looks_like_hub_id(value):
        return  # loaded (downloaded when not cached) by from_pretrained, as without a tiny recipe
    if tiny_recipe:
        raise ConfigError(f"{key}: {value} does not exist; the tiny recipe {tiny_recipe} builds only into "
                          f"{tiny_target(tiny_recipe)} (set {key} to that, to an existing folder, or to a hub id)")
    raise ConfigError(f"{key}: {value} does not exist, and is not a Hugging Face id (owner/name)")


def _local_source(source: str) -> Path | None:
    """The local path ``ingest.source`` names, or None for URLs, fsspec URIs and brace patterns."""
    if "://" in source or "::" in source or any(c in source for c in "{}*?["):
        return None
    return Path(source).expanduser()


def _has_media(folder: str, accepted: set[str]) -> bool:
    """Whether a visible file with an accepted extension is below ``folder``, found without listing the
    whole tree first (a folder of a million inputs costs one entry at a time)."""
    try:
        with os.scandir(folder) as it:
            subfolders = []
            for entry in it:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    subfolders.append(entry.path)
                elif os.path.splitext(entry.name)[1].lower() in accepted and entry.is_file():
                    return True
    except OSError:
        return False
    return any(_has_media(path, accepted) for path in subfolders)


def check_media_folder(folder: Path, extensions: list[str], shown: int = 3) -> None:
    """ConfigError unless ``folder`` holds at least one file with an accepted media extension (as the ingest
    stage lists a folder: recursively, hidden names skipped); the walk stops at the first one found."""
    accepted = {e.lower() for e in extensions}
    if _has_media(str(folder), accepted):
        return
    skipped: list[str] = []  # the refusal names what it skipped, in the order ingest lists it
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            if os.path.splitext(name)[1].lower() in accepted:
                return
            skipped.append(os.path.relpath(os.path.join(parent, name), folder))
    if not skipped:
        raise ConfigError(f"ingest.source: no images or videos in {folder} (the folder is empty)")
    more = f", ... ({len(skipped) - shown} more)" if len(skipped) > shown else ""
    raise ConfigError(f"ingest.source: no images or videos in {folder} (skipped {len(skipped)} "
                      f"file{'s' if len(skipped) != 1 else ''}: {', '.join(skipped[:shown])}{more}; the types "
                      "accepted are ingest.extensions)")


def _local_class(folder: Path) -> str | None:
    """The class a local component folder's config names, or None when there is no such folder."""
    import json

    config = folder / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("_class_name") or (data.get("architectures") or [None])[0]


def check_component_classes(model: ModelConfig) -> None:
    """Refuse, before any work, a recipe whose local components belong to different families: a family that
    declares its classes (``latentmill.component_classes``) and is the recipe's (``model.family``, or the family
    of ``model.pretrained``'s pipeline) needs its own pipeline and, in ``model.vae`` / ``model.text_encoder``
    folders, its own component classes; anything else is a ConfigError in one line. Hub ids are not looked
    up (nothing is downloaded here), and nothing imports torch."""
    import json

    from latentmill.component_classes import FAMILY_CLASSES, component_classes, pipeline_family

    root = Path(model.pretrained).expanduser()
    index = root / "model_index.json"
    pipeline = json.loads(index.read_text()).get("_class_name", "") if index.is_file() else ""
    family = model.family if model.family != "auto" else pipeline_family(pipeline)
    expected = component_classes(family)
    if pipeline and family in FAMILY_CLASSES and pipeline not in FAMILY_CLASSES[family]["pipelines"]:
        raise ConfigError(f"model.pretrained: {model.pretrained} is a {pipeline}, model.family {family!r} needs a "
                          f"{' or '.join(FAMILY_CLASSES[family]['pipelines'])}: the components of one recipe must "
                          "be of one family")
    if pipeline_family(pipeline) and family != pipeline_family(pipeline):
        raise ConfigError(f"model.pretrained: {model.pretrained} is a {pipeline} ({pipeline_family(pipeline)} "
                          f"family), model.family is {family!r}: the components of one recipe must be of one family")
    for name, needed in expected.items():
        override = getattr(model, name, None)
        if name == "transformer" or not override:
            key, folder = "model.pretrained", root / name
        else:
            path = Path(override).expanduser()
            key, folder = f"model.{name}", path / name if (path / name / "config.json").is_file() else path
        found = _local_class(folder)
        if found is not None and found != needed:
            raise ConfigError(f"{key}: {folder} holds {found}, the {family} family needs {needed} "
                              f"({name}); the components of one recipe must be of one family")


def check_recipe(recipe: Recipe, command: str) -> None:
    """Everything about ``recipe`` that can be checked before work starts, for ``command``
    (``prep``, ``train``, ``run`` or ``demo``); ConfigError or FileNotFoundError naming the key."""
    model = recipe.model
    check_model_ref("model.pretrained", model.pretrained, model.tiny_recipe, pipeline=True)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        check_model_ref(f"model.{name}", getattr(model, name))
    check_component_classes(model)
    if command in ("prep", "run", "demo"):
        source = recipe.ingest.require_source()
        local = _local_source(source)
        if local is not None and not local.exists():
            raise ConfigError(f"ingest.source: {source} does not exist")
        if local is not None and local.is_dir():
            check_media_folder(local, recipe.ingest.extensions)
        if recipe.caption.captioner == "transformers":
            check_model_ref("caption.model", recipe.caption.model)
    if command == "train":
        from latentmill.pipelines.snapshot import resolve_snapshot

        resolve_snapshot(recipe.output_dir, recipe.snapshot)
