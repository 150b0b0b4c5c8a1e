"""LTX-2 under torchrun on CPU (gloo, 2 ranks): FSDP2 full fine-tune and FSDP2 LoRA train on the demo videos'
sound and frames, resume bit for bit from a checkpoint (the audio noise draws included), and export what
LTX2Pipeline loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_helpers import run_and_resume

# heavy: 70 s a launch on 2 busy cores, as Wan 2.2 TI2V's; make test keeps FSDP2 on the other families, and this
# family's noise draws (the audio's included) are checked step by step in tests/test_trainer_ltx2.py
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def snapshot(ltx2_prep):
    """The demo videos with sound prepped with the tiny LTX-2 set: 8 clips of 64 x 64 px x 17 frames."""
    (path,) = (ltx2_prep / "snapshots").glob("0001-*")
    return path


def _launch(root: Path, snapshot: Path, pretrained: Path, mode: str, **cfg) -> dict:
    """An FSDP2 run of 6 steps and its resume from step 3 (tests.trainer_helpers.run_and_resume); rank 0's
    summary."""
    rank0, _ = run_and_resume(root, snapshot, pretrained, {"strategy": "fsdp2"}, 6, mode=mode, batch_size=1,
                              audio_loss_weight=0.5, **cfg)
    assert rank0["family"] == "ltx2"
    return rank0


def test_fsdp2_full_resumes_exactly_and_exports(tiny_ltx2, snapshot, tmp_path):
    from diffusers import DiffusionPipeline, LTX2Pipeline

    rank0 = _launch(tmp_path / "full", snapshot, tiny_ltx2, "full")
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, LTX2Pipeline)
    base = LTX2Pipeline.from_pretrained(tiny_ltx2).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys()
    changed = [k for k in base if not torch.equal(base[k], exported[k].to(base[k].dtype))]
    assert any(k.startswith("transformer_blocks.0.audio") for k in changed)
    assert any(k.startswith("transformer_blocks.1.") for k in changed)


def test_fsdp2_lora_resumes_exactly_and_exports(tiny_ltx2, snapshot, tmp_path):
    from diffusers import LTX2Pipeline

    rank0 = _launch(tmp_path / "lora", snapshot, tiny_ltx2, "lora", lora_rank=4, learning_rate=1e-2)
    pipe = LTX2Pipeline.from_pretrained(tiny_ltx2)
    pipe.load_lora_weights(rank0["export_dir"])
    (name,) = pipe.get_active_adapters()
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k]
    assert pipe.transformer.peft_config[name].r == 4 and lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)
