"""Wan 2.1 I2V under torchrun on CPU (gloo, 2 ranks): FSDP2 full fine-tune and FSDP2 LoRA over the conditioned
input train, resume bit for bit from a checkpoint, and export what WanImageToVideoPipeline loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from latentmill.stages.families import WanI2VEncoders

from tests.trainer_helpers import run_and_resume, write_fake_cache

# heavy: a 2-rank launch per mode; make test keeps FSDP2 on the other families, and this family's step is checked
# against the objective by hand in tests/test_trainer_wan21_i2v.py
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _launch(root: Path, pretrained: Path, mode: str, **cfg) -> dict:
    """An FSDP2 run of 6 steps and its resume from step 3 (tests.trainer_helpers.run_and_resume); rank 0's
    summary. Uneven shards: 3 + 2 samples in two buckets, batches of 1 per rank."""
    write_fake_cache(root / "cache", {(48, 32, 9): 3, (32, 48, 5): 2}, family="wan2.1-i2v", seq_len=8, smooth=True,
                     shards_per_bucket=2, streams=[s.to_json() for s in WanI2VEncoders.STREAMS])
    rank0, _ = run_and_resume(root, root / "cache", pretrained, {"strategy": "fsdp2"}, 6, mode=mode, batch_size=1,
                              shift=3.0, **cfg)
    assert rank0["family"] == "wan2.1-i2v"
    return rank0


def test_fsdp2_full_resumes_exactly_and_exports(tiny_wan_i2v, tmp_path):
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    rank0 = _launch(tmp_path, tiny_wan_i2v, "full")
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, WanImageToVideoPipeline) and pipe.image_encoder is not None
    base = WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys()
    changed = [k for k in base if not torch.equal(base[k], exported[k].to(base[k].dtype))]
    # the blocks, and the image side: the image projection and the cross-attention's image keys
    assert any(k.startswith("blocks.1.") for k in changed) and any("image_embedder" in k for k in changed)
    assert any("add_k_proj" in k for k in changed)


def test_fsdp2_lora_resumes_exactly_and_exports(tiny_wan_i2v, tmp_path):
    from diffusers import WanImageToVideoPipeline

    rank0 = _launch(tmp_path, tiny_wan_i2v, "lora", lora_rank=4, learning_rate=1e-2)
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v)
    pipe.load_lora_weights(rank0["export_dir"])
    (name,) = pipe.get_active_adapters()
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k and "add_" not in k]
    assert pipe.transformer.peft_config[name].r == 4 and lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)
