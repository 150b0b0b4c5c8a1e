"""End to end on the demo videos with Wan 2.1 I2V (configs/demo-wan2.1-i2v.yaml): videos → clips → latents with the
first frame's condition latents and CLIP image embeddings in the VAE member → conditioned training → an export
that WanImageToVideoPipeline loads and samples from an image."""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages.shardio import read_shard
from latentmill.trainer.wan21_i2v import wan_prompt_embeds
from safetensors.torch import load as load_safetensors

from latentmill.cli import main
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # tests/test_wan21_i2v.py preps a smaller cache in make test


def test_i2v_demo_caches_the_conditioning_and_exports_an_image_to_video_pipeline(tiny_wan_i2v, tmp_path):
    out = tmp_path / "i2v"
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-wan2.1-i2v.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_wan_i2v}", f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}",
                 "trainer.max_steps=2", "trainer.save_every=0", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    cache = summary["stages"]["cache"]
    assert (cache["out"], cache["quarantined"]) == (13, 0) and summary["train"]["family"] == "wan2.1-i2v"
    manifest = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    assert [s["name"] for s in manifest["streams"]] == ["latents", "condition_latents", "image_embeds", "prompt_embeds"]
    assert set(manifest["models"]) == {"vae", "text_encoder", "image_encoder"}
    shard = sorted((out / "prep" / "cache").rglob("*.tar"))[0]
    sample = next(iter(read_shard(shard)))
    vae = load_safetensors(sample["vae.safetensors"])
    assert set(vae) == {"latents", "condition_latents", "image_embeds"}
    assert vae["condition_latents"].shape == vae["latents"].shape and vae["image_embeds"].shape == (17, 32)
    # the condition's first latent frame is the clip's first frame alone, as the latents' is (the causal VAE)
    torch.testing.assert_close(vae["condition_latents"][:, 0], vae["latents"][:, 0], rtol=0, atol=1e-4)
    assert float((vae["condition_latents"][:, 1:] - vae["latents"][:, 1:]).abs().max()) > 0.1

    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    pipe = WanImageToVideoPipeline.from_pretrained(out / "export")
    frames = pipe(image=Image.new("RGB", (32, 32), (200, 40, 40)), prompt_embeds=wan_prompt_embeds(pipe, ["a"], 32),
                  height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=1.0, output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 9, 32, 32, 3)
