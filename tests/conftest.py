"""Shared fixtures: the tiny Flux pipeline (built once per session) and an isolated Prefect home."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_IMAGES = REPO_ROOT / "data" / "demo" / "images"
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"


@pytest.fixture(scope="session", autouse=True)
def _isolated_prefect_home(tmp_path_factory):
    """Flows run against a temporary local Prefect API under a throwaway PREFECT_HOME."""
    home = tmp_path_factory.mktemp("prefect-home")
    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_LOGGING_LEVEL")}
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.pop("PREFECT_API_URL", None)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> Path:
    """A complete tiny FluxPipeline folder built from data/tiny-flux.yaml with seed 0."""
    from latentmill.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux", seed=0)


@pytest.fixture()
def demo_images(tmp_path) -> Path:
    """A private copy of the embedded demo images (24 good, 2 broken), safe to modify."""
    dst = tmp_path / "images"
    shutil.copytree(DEMO_IMAGES, dst)
    return dst
