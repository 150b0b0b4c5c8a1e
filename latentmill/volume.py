"""The persistent volume of a rented GPU pod: one setting puts every long-lived thing on it.

A pod's container disk is wiped when the pod stops; its volume (``/workspace`` on Runpod-style pods) is not.
Weights downloaded to ``~/.cache/huggingface``, a weight-hash store in ``~/.cache/latentmill`` and Prefect's
database in ``~/.prefect`` are lost at every restart, and the next start downloads and hashes again. Set the
volume once, by the environment variable ``LATENTMILL_VOLUME`` or the recipe's top-level ``volume:`` key (the
recipe key wins), and the CLI and ``make`` put these under it:

==========================  ==================================  ===========================================
what                        where, under the volume ``V``       explicit setting that wins
==========================  ==================================  ===========================================
Hugging Face cache          ``V/hf``                            ``HF_HOME``
a relative ``output_dir``   ``V/<output_dir>``                  an absolute ``output_dir``
weight-hash store           ``V/latentmill/weight-hashes.sqlite``  ``LATENTMILL_HASH_STORE``
Prefect home                ``V/prefect``                       ``PREFECT_HOME``
examples' tiny models       ``V/latentmill/models``             ``LATENTMILL_MODELS``
==========================  ==================================  ===========================================

The environment variables are set (when unset) before Hugging Face or Prefect is imported, because both read
them once at import; child processes (torchrun ranks, Prefect workers) inherit them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ENV = "LATENTMILL_VOLUME"
KEY = "volume"  # the recipe's top-level key
# environment variable -> its place under the volume
LAYOUT = {"HF_HOME": "hf", "LATENTMILL_HASH_STORE": "latentmill/weight-hashes.sqlite", "PREFECT_HOME": "prefect",
          "LATENTMILL_MODELS": "latentmill/models"}


@dataclass
class VolumeLayout:
    """Where the volume put things: ``applied`` the variables set from it, ``kept`` those set explicitly."""

    root: str | None
    source: str | None  # "recipe", "env" or None
    applied: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)


def check_volume(value: object, key: str = KEY) -> str | None:
    """Validate a volume setting: None, or an absolute path that is not a file (``ConfigError`` naming ``key``)."""
    from latentmill.core.config import ConfigError

    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: the persistent volume's folder (an absolute path such as /workspace), "
                          f"got {value!r}")
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise ConfigError(f"{key}: must be an absolute path (the pod's volume mount, e.g. /workspace), got {value!r}")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}: {value} exists and is not a folder")
    return str(path)


def volume_root(recipe_volume: str | None = None, env: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """The volume in force and where it came from: the recipe's ``volume`` key, else ``$LATENTMILL_VOLUME``."""
    env = os.environ if env is None else env
    if recipe_volume:
        return check_volume(recipe_volume), "recipe"
    if env.get(ENV):
        return check_volume(env[ENV], ENV), "env"
    return None, None


def apply_volume(recipe_volume: str | None = None, env: dict[str, str] | None = None) -> VolumeLayout:
    """Set ``HF_HOME``, ``LATENTMILL_HASH_STORE``, ``PREFECT_HOME`` and ``LATENTMILL_MODELS`` under the volume
    where they are unset.

    ``env`` is changed in place (``os.environ`` by default). Call it before ``huggingface_hub`` or
    ``prefect`` is imported. Without a volume nothing changes.
    """
    env = os.environ if env is None else env
    root, source = volume_root(recipe_volume, env)
    layout = VolumeLayout(root, source)
    if root is None:
        return layout
    for var, rel in LAYOUT.items():
        if env.get(var):
            layout.kept[var] = env[var]
        else:
            env[var] = layout.applied[var] = str(Path(root) / rel)
    return layout


def resolve_output_dir(output_dir: str, root: str | None) -> str:
    """A relative ``output_dir`` under the volume ``root``; an absolute one (or a URL), or no volume: as is."""
    if root is None or "://" in output_dir or Path(output_dir).expanduser().is_absolute():
        return output_dir
    return str(Path(root) / output_dir)


def peek_recipe_volume(config: str | None, overrides: list[str] | None = None) -> str | None:
    """The ``volume`` key of a recipe (with its overrides), read as plain YAML without importing the models'
    libraries, so the CLI can set the environment before they read it. None when absent or unreadable (the
    full recipe load reports a broken recipe with its own message)."""
    if config is None:
        return None
    try:
        from latentmill.core.config import apply_overrides, load_yaml
        from latentmill.resources import find_recipe

        found, _ = find_recipe(config)
        data = apply_overrides(load_yaml(found), list(overrides or []))
    except Exception:
        return None
    value = data.get(KEY) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
