"""Writing tiny model folders atomically, and their command lines (shared by every tiny model set).

A build is saved into a hidden sibling folder (same filesystem, never mistaken for the real one) and renamed
into place when complete, so a killed build never leaves a folder that looks finished. ``marker`` files say
what "complete" means for a kind of folder (``model_index.json`` for a Diffusers pipeline).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from latentmill.core.config import ConfigError

MODEL_INDEX = "model_index.json"


def is_complete(folder: Path, markers: Sequence[str] = (MODEL_INDEX,)) -> bool:
    """Whether every marker file of a finished build is in ``folder``."""
    return all((folder / name).is_file() for name in markers)


def apply_umask(root: Path) -> None:
    """Give ``root`` (made by mkdtemp: 0700) and its files (safetensors are written 0600) the usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def publish(tmp: Path, out_dir: Path, replace: bool, markers: Sequence[str] = (MODEL_INDEX,)) -> None:
    """Rename the finished folder ``tmp`` to ``out_dir`` (atomic on one filesystem), replacing an old build."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()  # an empty placeholder, e.g. made by mkdir
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    if not (replace and out_dir.is_dir() and is_complete(out_dir, markers)):
        raise FileExistsError(
            f"{out_dir} exists and is not a finished build (no {', '.join(markers)}); refusing to replace it"
        )
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / out_dir.name)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old / out_dir.name, out_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def save_folder(out_dir: str | os.PathLike[str], save: Callable[[Path], None], *, replace: bool,
                markers: Sequence[str] = (MODEL_INDEX,)) -> Path:
    """Call ``save(tmp)`` on a hidden sibling of ``out_dir``, then rename it into place; return the path."""
    out_dir = Path(out_dir).expanduser().absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        save(tmp)
        if not is_complete(tmp, markers):
            raise RuntimeError(f"the build wrote no {', '.join(markers)} into {tmp}")
        apply_umask(tmp)
        try:
            publish(tmp, out_dir, replace, markers)
        except OSError:
            if not replace and is_complete(out_dir, markers):
                return out_dir  # another process finished the same build first
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def pipeline_folder(out_dir: str | os.PathLike[str], make_pipeline: Callable[[], object], *, replace: bool) -> Path:
    """Build a Diffusers pipeline with ``make_pipeline()`` and save it to ``out_dir`` atomically.

    ``replace=False`` keeps a finished folder already there (nothing is built); ``replace=True`` rebuilds.
    """
    path = Path(out_dir).expanduser().absolute()
    if not replace and is_complete(path):
        return path
    pipe = make_pipeline()
    return save_folder(path, lambda tmp: pipe.save_pretrained(tmp, safe_serialization=True), replace=replace)


def tiny_cli(argv: Sequence[str] | None, prog: str, description: str, build: Callable[..., Path],
             ensure: Callable[..., Path], default_recipe: Path) -> int:
    """``python -m PROG OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``: build, print the folder path."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("out_dir", type=Path, help="folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default: 0)")
    parser.add_argument("--recipe", type=Path, default=default_recipe, help="recipe YAML")
    parser.add_argument("--if-missing", action="store_true", help="keep an existing finished build")
    args = parser.parse_args(argv)
    try:
        path = (ensure if args.if_missing else build)(args.out_dir, recipe=args.recipe, seed=args.seed)
    except (ConfigError, FileExistsError) as err:
        parser.exit(2, f"error: {err}\n")
    print(path)
    return 0


# The tiny model set of each family, as "module:function" (an ``ensure_tiny_*(out_dir, recipe=...)``).
TINY_BUILDERS = {"flux": "latentmill.tiny:ensure_tiny_flux", "wan": "latentmill.tiny_wan:ensure_tiny_wan",
                 "z-image": "latentmill.tiny_zimage:ensure_tiny_zimage",
                 "flux2-klein": "latentmill.tiny_flux2:ensure_tiny_flux2",
                 "flux2": "latentmill.tiny_flux2:ensure_tiny_flux2"}
TINY_BUILDERS["qwen-image"] = "latentmill.tiny_qwen_image:ensure_tiny_qwen_image"
TINY_BUILDERS["qwen-image-edit"] = "latentmill.tiny_qwen_image:ensure_tiny_qwen_image_edit"
TINY_BUILDERS["wan2.2-ti2v"] = "latentmill.tiny_wan:ensure_tiny_wan"  # its recipe sets the Wan 2.2 options
TINY_BUILDERS["wan2.1-i2v"] = "latentmill.tiny_wan:ensure_tiny_wan"  # its recipe adds the CLIP image encoder
TINY_BUILDERS["hunyuanvideo1.5"] = "latentmill.tiny_hunyuan_video15:ensure_tiny_hunyuan_video15"
TINY_BUILDERS["hunyuanvideo1.5-i2v"] = TINY_BUILDERS["hunyuanvideo1.5"]  # its recipe adds the SigLIP image encoder
TINY_BUILDERS["ltx2"] = "latentmill.tiny_ltx2:ensure_tiny_ltx2"


def ensure_tiny(family: str, out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str]) -> Path:
    """Build ``family``'s tiny pipeline from ``recipe`` into ``out_dir`` unless it is there already."""
    import importlib

    if family not in TINY_BUILDERS:
        raise ConfigError(f"model.family: {family!r} has no tiny model set; model.tiny_recipe builds one of "
                          f"{', '.join(repr(f) for f in TINY_BUILDERS)}")
    module, name = TINY_BUILDERS[family].split(":")
    return getattr(importlib.import_module(module), name)(out_dir, recipe=recipe)
