"""Expected messages are silenced; what tells the user something is kept (issue 14, item 14)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VIDEOS = REPO / "data" / "demo" / "videos"

pytestmark = pytest.mark.slow  # loads transformers image processors in a subprocess


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stderr


def test_a_broken_video_is_refused_without_decord_chatter():
    err = _stderr("from stages.video import probe_video\n"
                  "try:\n    probe_video('data/demo/videos/broken.mp4')\n"
                  "except ValueError as e:\n    print(e)\n")
    assert "ERROR opening" not in err and "moov atom" not in err, err


def test_no_torchvision_fallback_warnings_from_image_processors():
    code = "from transformers import CLIPImageProcessor, SiglipImageProcessor\n"
    pytest.importorskip("transformers")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert "requires torchvision" in _stderr(code)  # the message latentmill drops
    assert "requires torchvision" not in _stderr("import latentmill\n" + code)


def test_scene_detection_logs_no_line_per_video(caplog):
    pytest.importorskip("scenedetect")
    from latentmill.stages.video import detect_cuts

    with caplog.at_level(logging.INFO):
        assert detect_cuts(str(VIDEOS / "cut_64x48_12fps.mp4")) == [18]
    assert not [r for r in caplog.records if r.name.startswith("pyscenedetect") and r.levelno < logging.WARNING]
