"""Where the example recipes, the demo data and the tiny-model recipes are, in a checkout and in a wheel.

A checkout keeps them in the top-level folders ``configs/`` and ``data/``; a wheel installs the same files
as ``latentmill/configs/`` and ``latentmill/data/``. :func:`resource_root` is the folder that holds both.

A recipe argument (``latentmill run CONFIG``, a deployment's ``config`` parameter) is a YAML file, or the
name of an example recipe shipped with the package (``demo``, ``demo-video``, ``flux-dev-lora``, ...). An
example recipe's relative paths into ``data/`` point at the shipped data; its ``output_dir`` stays relative
to the folder you run from, so ``latentmill run demo`` (or ``latentmill demo``) writes ``./outputs/demo``.

The tiny models an example recipe names (``data/models/tiny-flux``) are built on first use into
:func:`models_dir`: a checkout's own ``data/models/``, but never inside an installed package (read-only on a
system install, and left behind by ``pip uninstall``): there, the user's cache folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
MODELS_ENV = "LATENTMILL_MODELS"  # where shipped tiny-model recipes build (latentmill.volume sets it on a volume)
MODELS_PREFIX = "data/models/"  # an example recipe's value under it names a built model, in models_dir()
# Recipe keys that may name shipped data (relative to the resource root in an example recipe).
DATA_KEYS = (("ingest", "source"), ("model", "pretrained"), ("model", "tiny_recipe"), ("model", "vae"),
             ("model", "text_encoder"), ("model", "text_encoder_2"), ("caption", "model"))


def resource_root() -> Path:
    """The folder holding ``configs/`` and ``data/``: the wheel's package folder, or the checkout's root."""
    return _PACKAGE if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent


def models_dir() -> Path:
    """Where the shipped tiny-model recipes build their models: ``$LATENTMILL_MODELS``; else a checkout's
    ``data/models``; else (an installed package) ``$XDG_CACHE_HOME/latentmill/models``, ``~/.cache`` by default."""
    if os.environ.get(MODELS_ENV):
        return Path(os.environ[MODELS_ENV]).expanduser()
    root = resource_root()
    if root != _PACKAGE:  # a checkout: its data/models (ignored by git) holds what it built
        return root / "data" / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "latentmill" / "models"


def shipped_model_target(tiny_recipe: str | Path) -> Path | None:
    """Where a shipped tiny-model recipe (``.../data/tiny-flux.yaml``) builds: ``models_dir()/tiny-flux``;
    None for a recipe of the user's own."""
    recipe = Path(tiny_recipe)
    if recipe.resolve().parent != (resource_root() / "data").resolve():
        return None
    return models_dir() / recipe.stem


def example_recipes() -> dict[str, Path]:
    """The shipped example recipes by name (``demo`` -> ``.../configs/demo.yaml``)."""
    return {p.stem: p for p in sorted((resource_root() / "configs").glob("*.yaml"))}


def find_recipe(config: str | Path) -> tuple[Path, bool]:
    """``(path, is_example)``: the file ``config`` names, else the example recipe of that name.

    A path that exists always wins; otherwise a bare name (no folder, with or without ``.yaml``) that names
    an example recipe is that recipe. Anything else is returned as given (loading it then says it is missing).
    """
    path = Path(config)
    if path.is_file():
        return path, path.resolve().parent == (resource_root() / "configs").resolve()
    examples = example_recipes()
    name = path.name[:-5] if path.name.endswith(".yaml") else path.name
    if path.parent == Path(".") and name in examples:
        return examples[name], True
    return path, False


def anchor_data_paths(data: dict) -> dict:
    """An example recipe's relative ``data/...`` values made absolute under :func:`resource_root`; built
    models (``data/models/...``) under :func:`models_dir`."""
    root = resource_root()
    for section, key in DATA_KEYS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and value.startswith(MODELS_PREFIX):
            data[section][key] = str(models_dir() / value[len(MODELS_PREFIX):])
        elif isinstance(value, str) and value.startswith("data/"):
            data[section][key] = str(root / value)
    return data


def init_folder(folder: str | Path) -> list[Path]:
    """Copy the example recipes, the tiny-model recipes and the demo data into ``folder`` (a starting point
    for your own recipes: run ``latentmill run configs/demo.yaml`` from there). Never overwrites a file."""
    root, folder = resource_root(), Path(folder)
    copied = []
    sources = [*sorted((root / "configs").glob("*.yaml")), *sorted((root / "data").glob("tiny-*.yaml")),
               *sorted(p for p in (root / "data" / "demo").rglob("*") if p.is_file())]
    for src in sources:
        dst = folder / src.relative_to(root)
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        copied.append(dst)
    return copied


STARTER_RECIPE = """\
# A starter recipe for your own images, written by `latentmill init`. Paths are absolute, so it runs from any
# folder:
#   latentmill prep {recipe}      # ingest, caption, curate, bucket, cache: the latent cache
#   latentmill run {recipe}       # prep, then train
#   latentmill inspect {recipe}   # every key with its default
# Any key can be overridden on the command line, e.g. trainer.max_steps=10.

output_dir: {output_dir}
seed: 0

model:
  # The tiny random-weight Flux-class models, for a trial of the whole job on a CPU (built on first use,
  # nothing downloaded). For a real model, replace these two lines with one, e.g.:
  # pretrained: black-forest-labs/FLUX.1-dev
  pretrained: {pretrained}
  tiny_recipe: {tiny_recipe}

ingest:
  source: {images}   # a folder (recursive), a .txt list, a .csv/.jsonl/.parquet manifest or .tar shards
  # shard_bytes: 268435456   # 256 MiB raw shards (the default, as for every stage below)

caption:
  captioner: sidecar   # the caption in a .txt or .json beside each image
  on_missing: keep_empty   # an image without one trains with an empty caption; quarantine: leave it out
  # Or caption with a model:
  # captioner: transformers
  # model: Salesforce/blip-image-captioning-large

# curate: sharpness and exposure are scored for every image; nothing is dropped until you set a threshold
#   min_sharpness: 50.0      # variance of the Laplacian (grey levels)
#   max_exposure: 0.5        # share of pixels blown out to 0 or 255

bucket:
  resolution: 256   # one pixel budget, small for a CPU trial; remove for the tiers 256, 512 and 1024

trainer:
  mode: full         # or lora (a real model: lora_rank, learning_rate 1e-4 ...)
  max_steps: 100
  batch_size: 4
  learning_rate: 1.0e-4
  save_every: 50

parallel:
  strategy: none     # ddp or fsdp2 with --nproc N
"""


def write_starter_recipe(folder: str | Path, images: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``folder/recipe.yaml``, a starter recipe for the user's own ``images`` (default:
    ``folder/images``, made if missing): production shard sizes and curation as the defaults have them, the
    tiny models for a CPU trial, and the line to change for a real model. Returns ``(recipe, images)``;
    an existing ``recipe.yaml`` is kept (FileExistsError)."""
    folder = Path(folder).expanduser().resolve()
    recipe = folder / "recipe.yaml"
    if recipe.exists():
        raise FileExistsError(f"{recipe} exists; remove it or choose another folder (init never overwrites)")
    images = Path(images).expanduser().resolve() if images is not None else folder / "images"
    if not images.exists() and images == folder / "images":
        images.mkdir(parents=True)
    elif not images.is_dir():
        raise FileNotFoundError(f"--images: {images} is not a folder")
    tiny_recipe = resource_root() / "data" / "tiny-flux.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    recipe.write_text(STARTER_RECIPE.format(recipe=recipe, output_dir=folder / "outputs", images=images,
                                            pretrained=shipped_model_target(tiny_recipe), tiny_recipe=tiny_recipe))
    return recipe, images
