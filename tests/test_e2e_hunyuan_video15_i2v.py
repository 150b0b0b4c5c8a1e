"""End to end on the demo videos with HunyuanVideo 1.5 I2V (configs/demo-hunyuanvideo1.5-i2v.yaml): videos → clips →
latents with the first frame's VAE latent and SigLIP embedding in the VAE member → image-conditioned training → an
export that HunyuanVideo15ImageToVideoPipeline loads and samples from an image."""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages.shardio import read_shard
from safetensors.torch import load as load_safetensors

from latentmill.cli import main
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # tests/test_hunyuan_video15_i2v.py preps a smaller cache in make test


def test_i2v_demo_caches_the_first_frame_and_exports_an_image_to_video_pipeline(tiny_hunyuan_video15_i2v, tmp_path):
    out = tmp_path / "i2v"
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-hunyuanvideo1.5-i2v.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_hunyuan_video15_i2v}", f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}",
                 "trainer.max_steps=2", "trainer.save_every=0", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    cache = summary["stages"]["cache"]
    assert cache["out"] == summary["stages"]["bucket"]["out"] and cache["quarantined"] == 0
    assert summary["train"]["family"] == "hunyuanvideo1.5-i2v"
    manifest = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    assert [s["name"] for s in manifest["streams"]] == ["latents", "image_latents", "image_embeds", "prompt_embeds",
                                                        "prompt_embeds_2"]
    shard = sorted((out / "prep" / "cache").rglob("*.tar"))[0]
    vae = load_safetensors(next(iter(read_shard(shard)))["vae.safetensors"])
    assert vae["image_latents"].shape == (16, 1, *vae["latents"].shape[2:]) and vae["image_embeds"].shape == (16, 16)

    from diffusers import DiffusionPipeline, HunyuanVideo15ImageToVideoPipeline
    from PIL import Image

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, HunyuanVideo15ImageToVideoPipeline)
    frames = pipe(image=Image.new("RGB", (64, 64), (200, 40, 40)), prompt="a red ball", num_frames=9,
                  num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape[:2] == (1, 9) and frames.std() > 0
