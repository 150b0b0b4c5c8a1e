"""End to end on the demo videos with Wan 2.2 I2V A14B (configs/demo-wan2.2-i2v.yaml): videos → clips → latents with
the first frame's condition latents in the VAE member (no image embedding) → both experts trained in one run → an
export that WanImageToVideoPipeline loads with both trained experts and samples from an image."""

from __future__ import annotations

import json

import pytest
import torch
from latentmill.stages.shardio import read_shard
from latentmill.trainer.wan21_i2v import wan_prompt_embeds
from safetensors.torch import load as load_safetensors

from latentmill.cli import main
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # tests/test_wan22_i2v.py checks the cache in make test


def test_i2v_a14b_demo_caches_the_condition_and_exports_both_experts(tiny_wan22_i2v, tmp_path):
    out = tmp_path / "i2v"
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-wan2.2-i2v.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_wan22_i2v}", f"ingest.source={REPO_ROOT / 'data' / 'demo' / 'videos'}",
                 "trainer.max_steps=8", "trainer.save_every=0", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    cache = summary["stages"]["cache"]
    assert (cache["out"], cache["quarantined"]) == (13, 0)
    assert (summary["train"]["family"], summary["train"]["expert"]) == ("wan2.2-i2v", "both")
    manifest = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    assert [s["name"] for s in manifest["streams"]] == ["latents", "condition_latents", "prompt_embeds"]
    assert set(manifest["models"]) == {"vae", "text_encoder"}
    shard = sorted((out / "prep" / "cache").rglob("*.tar"))[0]
    vae = load_safetensors(next(iter(read_shard(shard)))["vae.safetensors"])
    assert set(vae) == {"latents", "condition_latents"} and vae["condition_latents"].shape == vae["latents"].shape

    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    pipe = WanImageToVideoPipeline.from_pretrained(summary["train"]["export_dir"])
    base = WanImageToVideoPipeline.from_pretrained(tiny_wan22_i2v)
    for slot in ("transformer", "transformer_2"):  # 8 steps at shift 3: both experts got micro-batches
        trained, untrained = getattr(pipe, slot).state_dict(), getattr(base, slot).state_dict()
        assert any(not torch.equal(trained[k], untrained[k]) for k in untrained), slot
    frames = pipe(image=Image.new("RGB", (32, 32), (200, 40, 40)), prompt_embeds=wan_prompt_embeds(pipe, ["a"], 32),
                  height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=1.0, output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 9, 32, 32, 3)
