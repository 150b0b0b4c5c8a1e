"""Wan 2.2 A14B experts under torchrun on CPU (gloo, 2 ranks), FSDP2: both experts in one run (each sharded on its
own, micro-batches routed alike on every rank), the low-noise expert alone (transformer_2, built on meta and
filled from its own folder rank by rank) and the high-noise expert as a LoRA train, resume exactly from a step-4
checkpoint, and export into their slots of WanPipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import read_metrics, run_and_resume, write_fake_cache

pytestmark = pytest.mark.slow
GENERATE = dict(prompt="a red ball", height=32, width=48, num_frames=9, num_inference_steps=2, output_type="np",
                max_sequence_length=16)


def _launch(root: Path, pretrained: Path, name: str, **cfg) -> dict:
    """One 2-rank FSDP2 launch: a run of 8 steps (checkpoints at 4 and 8, export) in ``root/name/run`` and its
    resume from step 4 (tests.trainer_helpers.run_and_resume); rank 0's summary."""
    if not (root / "cache").exists():  # uneven: shards of 3 + 2 and 2 + 1 samples in batches of 2
        write_fake_cache(root / "cache", {(48, 32, 9): 5, (32, 32, 5): 3}, family="wan", smooth=True,
                         shards_per_bucket=2, trimmed=True, seq_len=16)
    rank0, _ = run_and_resume(root / name, root / "cache", pretrained, {"strategy": "fsdp2"}, 8, shift=3.0, **cfg)
    step4 = list_checkpoints(root / name / "run" / "checkpoints")[0][1]
    assert len(list((step4 / "dcp").glob("*.distcp"))) == 2  # sharded
    return rank0


@pytest.mark.heavy  # make test: both experts route, resume and export in one process (test_wan22.py), and FSDP2
# trains and resumes on 2 ranks for FLUX.1 (test_trainer_fsdp.py)
def test_fsdp2_both_experts_full_resume_exactly_and_export_both(tiny_wan22, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline

    rank0 = _launch(tmp_path, tiny_wan22, "both", mode="full", expert="both", batch_size=1, grad_accum_steps=2)
    routed = [r["expert_micro_batches"] for r in read_metrics(tmp_path / "both" / "run")]
    assert {name for r in routed for name in r} == {"high", "low"} and all(sum(r.values()) == 2 for r in routed)
    step4 = list_checkpoints(tmp_path / "both" / "run" / "checkpoints")[0][1]
    assert len(list((step4 / "transformer_2" / "dcp").glob("*.distcp"))) == 2  # the second expert, sharded apart
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    base = WanPipeline.from_pretrained(tiny_wan22)
    for slot in ("transformer", "transformer_2"):
        trained, untrained = getattr(pipe, slot).state_dict(), getattr(base, slot).state_dict()
        assert any(not torch.equal(untrained[k], trained[k].to(untrained[k].dtype)) for k in untrained), slot
    assert pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames.shape == (1, 9, 32, 48, 3)


@pytest.mark.heavy  # a second variant: one expert alone (the low-noise one, from its own folder)
def test_fsdp2_low_expert_full_resumes_exactly_and_exports(tiny_wan22, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline

    rank0 = _launch(tmp_path, tiny_wan22, "low", mode="full", expert="low", activation_checkpointing=True)
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    base = WanPipeline.from_pretrained(tiny_wan22)
    low, base_low = pipe.transformer_2.state_dict(), base.transformer_2.state_dict()
    assert low.keys() == base_low.keys()
    assert any(not torch.equal(base_low[k], low[k].to(base_low[k].dtype)) for k in low if k.startswith("blocks.1."))
    assert all(torch.equal(v, pipe.transformer.state_dict()[k]) for k, v in base.transformer.state_dict().items())
    assert pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames.shape == (1, 9, 32, 48, 3)


@pytest.mark.heavy  # the second variant of the path above (LoRA, the other expert)
def test_fsdp2_high_expert_lora_resumes_exactly_and_exports(tiny_wan22, tmp_path):
    from diffusers import WanPipeline

    rank0 = _launch(tmp_path, tiny_wan22, "high", mode="lora", expert="high", lora_rank=4, learning_rate=1e-2)
    pipe = WanPipeline.from_pretrained(tiny_wan22)
    pipe.load_lora_weights(Path(rank0["export_dir"]) / "high_noise")
    (name,) = pipe.transformer.peft_config
    assert pipe.transformer.peft_config[name].r == 4 and not getattr(pipe.transformer_2, "peft_config", None)
    assert pipe(generator=torch.Generator().manual_seed(0), **GENERATE).frames.shape == (1, 9, 32, 48, 3)
