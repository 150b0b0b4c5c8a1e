"""Wan 2.2 TI2V under torchrun on CPU (gloo, 2 ranks), with image-to-video draws (trainer.i2v_probability):
FSDP2 full fine-tune and FSDP2 LoRA train, resume bit for bit from a checkpoint, and export what WanPipeline
loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_helpers import run_and_resume, write_fake_cache

# heavy: 50 s a launch on 2 busy cores; make test keeps FSDP2 on the other families, and this family's image-to-video
# draws are checked step by step in tests/test_trainer_wan22_ti2v.py
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _launch(root: Path, pretrained: Path, mode: str, **cfg) -> dict:
    """An FSDP2 run of 6 steps and its resume from step 3 (tests.trainer_helpers.run_and_resume); rank 0's
    summary. Uneven shards: 3 + 2 samples of 64 x 32 px x 9 frames in batches of 1 per rank."""
    write_fake_cache(root / "cache", {(64, 32, 9): 3, (32, 64, 5): 2}, family="wan2.2-ti2v", channels=48,
                     seq_len=8, smooth=True, shards_per_bucket=2)
    rank0, _ = run_and_resume(root, root / "cache", pretrained, {"strategy": "fsdp2"}, 6, mode=mode, batch_size=1,
                              shift=5.0, i2v_probability=0.5, **cfg)
    assert rank0["family"] == "wan2.2-ti2v"
    return rank0


def test_fsdp2_full_resumes_exactly_and_exports(tiny_wan_ti2v, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline

    rank0 = _launch(tmp_path, tiny_wan_ti2v, "full")
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, WanPipeline) and pipe.config.expand_timesteps
    base = WanPipeline.from_pretrained(tiny_wan_ti2v).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys()
    changed = [k for k in base if not torch.equal(base[k], exported[k].to(base[k].dtype))]
    assert any(k.startswith("blocks.0.") for k in changed) and any(k.startswith("blocks.1.") for k in changed)


def test_fsdp2_lora_resumes_exactly_and_exports(tiny_wan_ti2v, tmp_path):
    from diffusers import WanPipeline

    rank0 = _launch(tmp_path, tiny_wan_ti2v, "lora", lora_rank=4, learning_rate=1e-2)
    pipe = WanPipeline.from_pretrained(tiny_wan_ti2v)
    pipe.load_lora_weights(rank0["export_dir"])
    (name,) = pipe.get_active_adapters()
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k]
    assert pipe.transformer.peft_config[name].r == 4 and lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)
