"""End to end on the embedded video default: videos → clips → Wan latents → training → WanPipeline export."""

from __future__ import annotations

import json

import pytest

from latentmill.cli import main
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def test_video_demo_runs_and_exports_a_generating_pipeline(tiny_wan, tmp_path):
    out = tmp_path / "video"
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-video.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_wan}", f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}",
                 "trainer.max_steps=6", "trainer.save_every=3", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    stages = summary["stages"]
    assert (stages["ingest"]["in"], stages["ingest"]["quarantined"]) == (7, 1)  # broken.mp4
    bucket = stages["bucket"]
    assert bucket["in"] + bucket["expanded"] == bucket["out"] + bucket["quarantined"]
    assert bucket["clips"] == bucket["out"] == stages["cache"]["out"] > bucket["videos"]
    assert all(int(name.split("x")[2]) in (5, 9, 17) for name in bucket["buckets"])
    assert summary["train"]["steps"] == 6 and summary["train"]["family"] == "wan"

    from diffusers import DiffusionPipeline, WanPipeline

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, WanPipeline)
    frames = pipe(prompt="a red ball", height=32, width=48, num_frames=9, num_inference_steps=2,
                  output_type="np").frames
    assert frames.shape == (1, 9, 32, 48, 3)
