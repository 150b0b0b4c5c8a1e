"""Shared fixtures: the tiny Flux pipeline (built once per session) and an isolated Prefect home."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Set before any test module imports Prefect, so its settings take effect: flows run against a temporary
# local API under a throwaway PREFECT_HOME, never a user's server or ~/.prefect.
_PREFECT_HOME = tempfile.mkdtemp(prefix="latentmill-test-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["LATENTMILL_HASH_STORE"] = os.path.join(_PREFECT_HOME, "weight-hashes.sqlite")  # not ~/.cache
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# A loaded machine can take longer than the default 20 s to start the temporary local API.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_IMAGES = REPO_ROOT / "data" / "demo" / "images"
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"


# Fixtures that build a model: a test that uses one (directly or through another fixture) is slow, so that
# the unit tier (`make test-unit`: not slow, heavy or served) builds no model.
MODEL_FIXTURES = frozenset({"tiny_flux", "tiny_wan", "tiny_blip"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _remove_prefect_home():
    yield
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> Path:
    """A complete tiny FluxPipeline folder built from data/tiny-flux.yaml with seed 0."""
    from latentmill.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux", seed=0)


@pytest.fixture()
def demo_images(tmp_path) -> Path:
    """A private copy of the embedded demo images (24 good, 2 broken), safe to modify; without the two
    over-exposed ones, which only the demo recipe's curate threshold is about (tests/test_curate.py)."""
    dst = tmp_path / "images"
    shutil.copytree(DEMO_IMAGES, dst, ignore=shutil.ignore_patterns("overexposed_*"))
    return dst


@pytest.fixture(scope="session")
def tiny_blip(tmp_path_factory) -> Path:
    """A tiny random-weight BLIP captioner folder built from data/tiny-blip.yaml with seed 0."""
    from latentmill.tiny_captioner import build_tiny_captioner

    return build_tiny_captioner(tmp_path_factory.mktemp("models") / "tiny-blip", seed=0)


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> Path:
    """A complete tiny WanPipeline folder built from data/tiny-wan.yaml with seed 0."""
    from latentmill.tiny_wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan", seed=0)
