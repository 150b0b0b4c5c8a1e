"""The committed demo dataset is exactly what data/make_demo.py generates, and fits the issue's spec."""

from __future__ import annotations

import hashlib
import importlib.util

from PIL import Image

from tests.conftest import DEMO_IMAGES, REPO_ROOT


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_generator_reproduces_committed_files(tmp_path):
    spec = importlib.util.spec_from_file_location("make_demo", REPO_ROOT / "data" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    assert _digests(tmp_path) == _digests(DEMO_IMAGES)


def test_mixed_sizes_formats_and_captions():
    images = [p for p in DEMO_IMAGES.iterdir() if p.name.startswith("img_") and p.suffix != ".txt"]
    assert len(images) >= 24
    shapes = set()
    formats = set()
    for path in images:
        with Image.open(path) as img:
            img.load()
            w, h = img.size
            formats.add(img.format)
        shapes.add("square" if w == h else "landscape" if w > h else "portrait")
        assert path.with_suffix(".txt").read_text().strip()
    assert shapes == {"square", "landscape", "portrait"}
    assert formats == {"JPEG", "PNG"}
