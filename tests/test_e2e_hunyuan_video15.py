"""End to end on the demo videos with HunyuanVideo 1.5 (configs/demo-hunyuanvideo1.5.yaml): videos → 4k+1-frame
clips at multiples of 16 px → latents and both masked text streams → training → an export that
HunyuanVideo15Pipeline loads and samples from."""

from __future__ import annotations

import json

import pytest
import torch

from latentmill.cli import main
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # the Wan 2.1 demo test runs the same stages in make test


def test_hunyuan_video15_demo_runs_and_exports_a_pipeline(tiny_hunyuan_video15, tmp_path):
    out = tmp_path / "hunyuan"
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-hunyuanvideo1.5.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_hunyuan_video15}", f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}",
                 "trainer.max_steps=4", "trainer.save_every=2", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    stages = summary["stages"]
    assert (stages["ingest"]["in"], stages["ingest"]["quarantined"]) == (8, 1)  # broken.mp4
    bucket = stages["bucket"]
    assert bucket["in"] + bucket.get("expanded", 0) == bucket["out"] + bucket["quarantined"]
    assert all(w % 16 == 0 and h % 16 == 0 and (f - 1) % 4 == 0
               for w, h, f in (map(int, b.split("x")) for b in bucket["buckets"]))
    assert stages["cache"]["out"] == bucket["out"] and summary["train"]["family"] == "hunyuanvideo1.5"
    reasons = [json.loads(x)["reason"] for x in (out / "prep" / "bucket" / "quarantine.jsonl").read_text().splitlines()]
    (short,) = [r for r in reasons if r.startswith("video too short")]
    assert short.endswith("the smallest bucket needs 5 frames (bucket.frame_counts; clips are 4k+1 frames, "
                          "bucket.frame_step)")
    manifest = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    assert [(s["name"], s["pad"], s.get("pad_to")) for s in manifest["streams"]] == [
        ("latents", "none", None), ("prompt_embeds", "mask", None), ("prompt_embeds_2", "mask", 256)]
    assert manifest["models"]["vae"]["scaling_factor"] == pytest.approx(1.1341)

    from diffusers import DiffusionPipeline, HunyuanVideo15Pipeline

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, HunyuanVideo15Pipeline)
    frames = pipe('a red ball and a sign that reads "GO"', height=64, width=64, num_frames=9, num_inference_steps=2,
                  output_type="np", generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 9, 64, 64, 3)
