"""Checks that run before any stage, model load or Prefect start-up: a wrong path fails in one line, at once.

* model references (``model.pretrained``, ``model.vae``, ``model.text_encoder``, ``model.text_encoder_2``,
  ``caption.model``): a local folder must exist (``model.pretrained``: with a ``model_index.json``);
  anything else must look like a Hugging Face id (``owner/name``). A tiny-model recipe
  (``model.tiny_recipe``) builds only into its own folder (:func:`tiny_target`), so a typo in
  ``model.pretrained`` never becomes a new model with random weights; a hub id or an existing folder in
  ``model.pretrained`` takes the normal ``from_pretrained`` path and the tiny recipe is not used;
* ``ingest.source`` (``prep``, ``run``): set, present when it is a local path, and a local folder holds at
  least one image or video;
* the model family: an explicit ``model.family`` agrees with the pipeline folder's, and a component override
  (``model.vae``, ``model.text_encoder``...) is of the class the pipeline's ``model_index.json`` names, so a
  recipe never mixes components of two families (a FLUX.1 VAE under a FLUX.2 transformer);
* ``train``: a published snapshot to train on (``run`` publishes one first);
* the process layout (``--nproc``, ``--nnodes``) against ``parallel.strategy``;
* context parallelism (``parallel.cp_size``): the family has a plan, and cp divides the token counts of every
  bucket the prep can make and of the validation size (else the trainer would refuse them at their first batch);
* ``trainer.expert`` against a local pipeline's experts (a Wan 2.2 A14B folder needs ``high`` or ``low``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from latentmill.core.config import ConfigError
from latentmill.core.store import check_store, is_url
from latentmill.models import ModelConfig, component_source, read_component_config
from latentmill.recipe import Recipe
from latentmill.stages.bucket import BucketConfig

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


def check_components(model: ModelConfig) -> None:
    """An explicit ``model.family`` matches the pipeline folder's, and each component override is of the
    class the pipeline names in its ``model_index.json``: one line naming the key otherwise. A hub id (or a
    tiny folder not built yet) is checked when it loads."""
    root = Path(model.pretrained).expanduser()
    if not (root / "model_index.json").is_file():
        return
    index = json.loads((root / "model_index.json").read_text())
    pipeline = index.get("_class_name", "?")
    if model.family != "auto":
        from latentmill.stages.families import index_family  # (imports torch: only when it decides)

        family = index_family(index)
        if family is not None and family != model.family:
            raise ConfigError(f"model.family: {model.family!r}, but {model.pretrained} is a {pipeline} (the "
                              f"{family!r} family); set model.family to {family!r} or 'auto'")
    for name in ("vae", "text_encoder", "text_encoder_2"):
        override = getattr(model, name, None)
        if not override:
            continue
        expected = (index.get(name) or [None, None])[1]
        if expected is None:
            raise ConfigError(f"model.{name}: the {pipeline} at {model.pretrained} has no {name}; remove "
                              f"model.{name}")
        try:
            config = read_component_config(component_source(model, name))
        except Exception:  # a hub id not downloaded yet: from_pretrained checks it when it loads
            continue
        have = config.get("_class_name") or (config.get("architectures") or [None])[0]
        if have is not None and have != expected:
            raise ConfigError(f"model.{name}: {override} is a {have}; the {pipeline} at {model.pretrained} "
                              f"takes a {expected}: a recipe cannot mix components of different model families")


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


def _has_edit_pair(folder: str) -> bool:
    """Whether an image ``<name>.src.<ext>`` is below ``folder`` (stops at the first one)."""
    from latentmill.stages.pixels import IMAGE_EXTENSIONS
    from latentmill.stages.sources import REFERENCE_MARK

    for _, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            stem, suffix = os.path.splitext(name)
            if stem.endswith(REFERENCE_MARK) and suffix.lower() in IMAGE_EXTENSIONS and not name.startswith("."):
                return True
    return False


def check_edit_source(source: str, local: Path | None, reference_column: str | None) -> None:
    """ConfigError unless an edit recipe's source holds pairs: paired ``source/`` and ``target/`` folders or
    a ``<name>.src.<ext>`` image in a folder, or a manifest with the source column."""
    from latentmill.stages.sources import (
        PAIRED_FOLDERS,
        REFERENCE_COLUMN,
        edit_layout,
        manifest_rows,
        source_kind,
    )

    if local is not None and local.is_dir():
        if edit_layout(local) == "paired" or _has_edit_pair(str(local)):
            return
        raise ConfigError(f"ingest.edit: {source} holds no edit pairs; put each source image beside its target "
                          f"as <name>.src.<ext>, or the two sets in {PAIRED_FOLDERS[0]}/ and {PAIRED_FOLDERS[1]}/ "
                          "folders with the same names (docs/prep.md, \"Edit datasets\")")
    if source_kind(source) == "manifest":
        column = reference_column or REFERENCE_COLUMN
        first = next(manifest_rows(source), None)
        if first is None or column not in first:
            raise ConfigError(f"ingest.edit: the manifest {source} has no {column!r} column of source images; "
                              "name it with ingest.reference_column")


def check_expert(recipe: Recipe) -> None:
    """``trainer.expert`` fits the local pipeline folder's experts (Wan 2.2 A14B: high, low; one-transformer
    pipelines: null). A hub id or a folder not built yet is checked when the trainer loads it."""
    root = Path(recipe.model.pretrained).expanduser()
    if not (root / "model_index.json").is_file():
        return
    from latentmill.stages.families import detect_family
    from latentmill.trainer.adapter import choose_experts
    from latentmill.trainer.adapters import get_adapter

    adapter = get_adapter(detect_family(recipe.model))
    choose_experts(adapter.experts(str(root)), recipe.trainer.expert, recipe.model.pretrained)


def check_bucket(family: str, bucket: BucketConfig) -> None:
    """The bucket keys fit the model family, before any work (else training would refuse the whole cache):

    * ``bucket.step`` gives sizes its latents can patchify (``PIXEL_MULTIPLE``);
    * every clip length the recipe admits is one its VAE takes (``FRAME_STEP``·k + 1);
    * a family whose batches hold each clip's sound (a stream ``from_audio``: LTX-2's audio latents, as long as
      the clip lasts) gets one frame rate for every clip: ``bucket.exact_fps`` with ``bucket.target_fps``."""
    if family == "auto":
        return
    from latentmill.stages.families import family_class

    cls = family_class(family)
    if bucket.step % cls.PIXEL_MULTIPLE:
        raise ConfigError(f"bucket.step: {bucket.step} px, but {family} needs sizes in multiples of "
                          f"{cls.PIXEL_MULTIPLE} px (VAE downsampling x transformer patch); set bucket.step to "
                          f"{cls.PIXEL_MULTIPLE} or a multiple of it")
    rule = cls.FRAME_STEP
    bad = [n for n in bucket.frame_count_list() if n > 1 and (n - 1) % rule] if rule else []
    if bad:
        key = "bucket.frame_counts" if bucket.frame_counts is not None else "bucket.frame_step"
        raise ConfigError(f"{key}: clips of {bad[:4]} frames, but {family} takes clips of {rule}k+1 frames (its VAE "
                          f"keeps frame 0 alone and packs {rule} frames per latent frame); set bucket.frame_step: "
                          f"{rule} (or bucket.frame_counts of {rule}k+1)")
    if any(stream.from_audio for stream in cls.STREAMS) and not bucket.exact_fps:
        raise ConfigError(f"bucket.exact_fps: false, but a {family} batch stacks its clips' sound, as long as each "
                          "clip lasts, so every clip needs the one rate bucket.target_fps; set bucket.exact_fps: "
                          "true (a slower source is then quarantined)")


def check_recipe(recipe: Recipe, command: str) -> None:
    """Everything about ``recipe`` that can be checked before work starts, for ``command``
    (``prep``, ``train``, ``run`` or ``demo``); ConfigError or FileNotFoundError naming the key."""
    if is_url(recipe.output_dir):  # an object store: reachable, its bucket there, before anything else
        check_store(recipe.output_dir)
    model = recipe.model
    check_model_ref("model.pretrained", model.pretrained, model.tiny_recipe, pipeline=True)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        check_model_ref(f"model.{name}", getattr(model, name))
    check_components(model)
    if command in ("prep", "run", "demo"):
        check_bucket(model.family, recipe.bucket)
        source = recipe.ingest.require_source()
        local = _local_source(source)
        if local is not None and not local.exists():
            raise ConfigError(f"ingest.source: {source} does not exist")
        if local is not None and local.is_dir():
            check_media_folder(local, recipe.ingest.extensions)
        if recipe.ingest.edit:
            check_edit_source(source, local, recipe.ingest.reference_column)
        elif model.family != "auto":
            from latentmill.stages.families import family_class  # (imports torch: an explicit family only)

            if family_class(model.family).needs_reference():  # else every sample would be quarantined at the cache
                raise ConfigError(f"ingest.edit: the {model.family} family trains on edit pairs; set ingest.edit: "
                                  "true over a source of pairs (docs/prep.md, \"Edit datasets\")")
        if recipe.caption.captioner == "transformers":
            check_model_ref("caption.model", recipe.caption.model)
    if model.family != "auto" and (recipe.trainer.i2v_probability > 0 or recipe.trainer.validate_every):
        from latentmill.trainer.adapters import check_i2v, check_validation

        check_i2v(recipe.trainer.i2v_probability, model.family)
        check_validation(recipe.trainer.validate_every, model.family)
    if model.family != "auto" and recipe.parallel.cp_size > 1:
        from latentmill.trainer.adapters import get_adapter
        from latentmill.trainer.context import check_context_parallel, check_cp_buckets, check_cp_validation

        adapter, text = get_adapter(model.family), recipe.cache.max_sequence_length
        check_context_parallel(recipe.parallel, adapter)
        if command in ("prep", "run", "demo"):  # the buckets and text length this recipe's prep makes
            check_cp_buckets(recipe.parallel, adapter, recipe.bucket, model.pretrained, text)
            if recipe.trainer.validate_every:
                check_cp_validation(recipe.parallel, adapter, recipe.trainer.validation_size, model.pretrained, text)
    if command in ("train", "run", "demo"):
        check_expert(recipe)
    if command == "train" and is_url(recipe.output_dir):
        from latentmill.pipelines.objectstore import check_snapshot

        check_snapshot(recipe.output_dir, recipe.snapshot)
    elif command == "train":
        from latentmill.pipelines.snapshot import resolve_snapshot

        resolve_snapshot(recipe.output_dir, recipe.snapshot)
