"""End to end on the demo videos with Wan 2.2 TI2V (configs/demo-wan2.2-ti2v.yaml): videos → 4k+1-frame clips
at multiples of 32 px → 48-channel latents → text- and image-to-video training → an export that
WanImageToVideoPipeline loads and samples from an image."""

from __future__ import annotations

import json

import pytest
import torch

from latentmill.cli import main
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # the Wan 2.1 demo test runs the same stages in make test


def test_ti2v_demo_runs_and_exports_an_image_to_video_pipeline(tiny_wan_ti2v, tmp_path):
    out = tmp_path / "ti2v"
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-wan2.2-ti2v.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_wan_ti2v}", f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}",
                 "trainer.max_steps=4", "trainer.save_every=2", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    stages = summary["stages"]
    assert (stages["ingest"]["in"], stages["ingest"]["quarantined"]) == (8, 1)  # broken.mp4
    bucket = stages["bucket"]
    assert (bucket["videos"], bucket["clips"], bucket["out"], bucket["quarantined"]) == (7, 14, 13, 2)
    assert sorted(bucket["buckets"]) == ["64x64x17", "64x64x9", "96x32x17"]  # step 32: 16x VAE x 2x2 patches
    assert stages["cache"]["out"] == 13 and summary["train"]["family"] == "wan2.2-ti2v"
    reasons = [json.loads(x)["reason"] for x in (out / "prep" / "bucket" / "quarantine.jsonl").read_text().splitlines()]
    (short,) = [r for r in reasons if r.startswith("video too short")]
    assert short.endswith("the smallest bucket needs 5 frames (bucket.frame_counts; clips are 4k+1 frames, "
                          "bucket.frame_step)")

    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    pipe = WanImageToVideoPipeline.from_pretrained(out / "export")
    assert pipe.config.expand_timesteps and pipe.vae.config.z_dim == 48
    # WanImageToVideoPipeline's own prompt cleaning needs ftfy: it is given WanPipeline's prompt_embeds
    embeds = WanPipeline.from_pretrained(out / "export").encode_prompt(
        "a red ball", do_classifier_free_guidance=False, max_sequence_length=32)[0]
    image = Image.new("RGB", (64, 64), (200, 40, 40))
    frames = pipe(image=image, prompt_embeds=embeds, height=64, width=64, num_frames=9, num_inference_steps=2,
                  guidance_scale=1.0, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 9, 64, 64, 3)
