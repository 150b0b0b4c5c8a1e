"""End to end on the embedded video default: videos → clips → Wan latents → training → WanPipeline export."""

from __future__ import annotations

import json

import pytest

from latentmill.cli import main
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def test_video_demo_runs_and_exports_a_generating_pipeline(tiny_wan, tmp_path, capsys):
    out = tmp_path / "video"
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-video.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_wan}", f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}",
                 "trainer.max_steps=6", "trainer.save_every=3", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    stages = summary["stages"]
    assert (stages["ingest"]["in"], stages["ingest"]["quarantined"]) == (8, 1)  # broken.mp4
    # curate.min_motion 0.7 of the recipe: pause_64x48_8fps's still first clip (motion 0.02) is the one
    # clip below it; no video goes whole, so curate quarantines nothing and bucket drops that clip
    curated = stages["curate"]
    assert (curated["in"], curated["out"], curated["quarantined"]) == (7, 7, 0)
    assert (curated["clips_scored"], curated["clips_below_threshold"]) == (14, 1)
    bucket = stages["bucket"]
    assert bucket["in"] + bucket["expanded"] == bucket["out"] + bucket["quarantined"]
    # 7 videos: short_64x48_24fps too short, the still clip below the threshold; 14 clips, 13 kept
    assert (bucket["videos"], bucket["clips"], bucket["out"], bucket["quarantined"]) == (7, 14, 13, 2)
    assert bucket["clips_below_threshold"] == 1 and stages["cache"]["out"] == 13
    assert all(int(name.split("x")[2]) in (5, 9, 17) for name in bucket["buckets"])
    assert summary["train"]["steps"] == 6 and summary["train"]["family"] == "wan"
    printed = capsys.readouterr().out
    assert "curate clips: 14 scored, 0 reused, 1 beyond a threshold" in printed

    # inspect names the still clip, its reason and its motion score
    assert main(["inspect", str(out / "prep")]) == 0
    printed = capsys.readouterr().out
    (line,) = [ln for ln in printed.splitlines() if "beyond curate.min_motion" in ln]
    assert line.startswith("  quarantined pause_64x48_8fps.mp4: motion beyond curate.min_motion=0.7 (")
    assert float(line.split("motion ")[-1].rstrip(")").split(",")[0]) < 0.1
    (entry,) = [json.loads(x) for x in (out / "prep" / "bucket" / "quarantine.jsonl").read_text().splitlines()
                if "min_motion" in x]
    assert entry["key"] == f"{entry['video_key']}-c0" and entry["clip"]["start_frame"] == 0

    from diffusers import DiffusionPipeline, WanPipeline

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, WanPipeline)
    frames = pipe(prompt="a red ball", height=32, width=48, num_frames=9, num_inference_steps=2,
                  output_type="np").frames
    assert frames.shape == (1, 9, 32, 48, 3)
