"""HunyuanVideo 1.5 image-to-video under torchrun on CPU (gloo, 2 ranks): FSDP2 LoRA and FSDP2 full fine-tune over
the image-conditioned call train, resume bit for bit from a checkpoint, and export what
HunyuanVideo15ImageToVideoPipeline loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from latentmill.stages.families import family_streams

from tests.trainer_helpers import run_and_resume, write_fake_cache

# heavy: a family's repeat of FSDP2 LoRA and full, which make test runs on FLUX.1 and Wan (test_trainer_fsdp.py,
# test_trainer_wan22_parallel.py)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _launch(root: Path, pretrained: Path, mode: str, **cfg) -> dict:
    """An FSDP2 run of 6 steps and its resume from step 3 (tests.trainer_helpers.run_and_resume); rank 0's
    summary. Uneven shards: 3 + 2 samples in two video buckets, batches of 1 per rank."""
    write_fake_cache(root / "cache", {(48, 32, 9): 3, (32, 48, 5): 2}, family="hunyuanvideo1.5-i2v", channels=16,
                     seq_len=8, smooth=True, shards_per_bucket=2, trimmed=True,
                     streams=[s.to_json() for s in family_streams("hunyuanvideo1.5-i2v")])
    rank0, _ = run_and_resume(root, root / "cache", pretrained, {"strategy": "fsdp2"}, 6, mode=mode, batch_size=1,
                              shift=5.0, **cfg)
    assert rank0["family"] == "hunyuanvideo1.5-i2v"
    return rank0


def test_fsdp2_lora_resumes_exactly_and_exports(tiny_hunyuan_video15_i2v, tmp_path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    rank0 = _launch(tmp_path, tiny_hunyuan_video15_i2v, "lora", lora_rank=4, learning_rate=1e-2)
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(tiny_hunyuan_video15_i2v)
    pipe.transformer.load_lora_adapter(rank0["export_dir"], use_safetensors=True)
    (name,) = pipe.transformer.active_adapters()
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k]
    assert pipe.transformer.peft_config[name].r == 4 and lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)


@pytest.mark.heavy  # the second variant: FSDP2 full runs in make test for text-to-video (the same adapter's blocks)
def test_fsdp2_full_resumes_exactly_and_exports(tiny_hunyuan_video15_i2v, tmp_path):
    from diffusers import DiffusionPipeline, HunyuanVideo15ImageToVideoPipeline

    rank0 = _launch(tmp_path, tiny_hunyuan_video15_i2v, "full")
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, HunyuanVideo15ImageToVideoPipeline) and pipe.image_encoder is not None
    base = HunyuanVideo15ImageToVideoPipeline.from_pretrained(tiny_hunyuan_video15_i2v).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys()
    # compared in the export's storage dtype (bf16): rounding alone is no change
    changed = {k for k in base if not torch.equal(base[k].bfloat16(), exported[k].bfloat16())}
    assert any(k.startswith("transformer_blocks.1.") for k in changed)
    assert any(k.startswith("image_embedder.") for k in changed)  # the image tokens' projection trained
