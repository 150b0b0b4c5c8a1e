"""Wan 2.2 I2V A14B under torchrun on CPU (gloo, 2 ranks), FSDP2: both experts in one run over the conditioned
input (each sharded on its own, micro-batches routed alike on every rank) and, as a second variant, the low-noise
expert's LoRA; each resumes bit for bit from a step-4 checkpoint and exports what WanImageToVideoPipeline loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from latentmill.stages.families import WanI2VA14BEncoders
from latentmill.trainer.checkpoint import list_checkpoints
from latentmill.trainer.wan21_i2v import wan_prompt_embeds

from tests.test_trainer_wan21_i2v import _image
from tests.trainer_helpers import read_metrics, run_and_resume, write_fake_cache

pytestmark = pytest.mark.slow


def _launch(root: Path, pretrained: Path, **cfg) -> dict:
    """An FSDP2 run of 8 steps (checkpoints at 4 and 8, export) and its resume from step 4
    (tests.trainer_helpers.run_and_resume), each checkpoint sharded; rank 0's summary. Uneven shards: 3 + 2 and
    2 + 1 samples in two buckets."""
    write_fake_cache(root / "cache", {(48, 32, 9): 5, (32, 32, 5): 3}, family="wan2.2-i2v", smooth=True,
                     shards_per_bucket=2, trimmed=True, seq_len=16,
                     streams=[s.to_json() for s in WanI2VA14BEncoders.STREAMS])
    rank0, _ = run_and_resume(root, root / "cache", pretrained, {"strategy": "fsdp2"}, 8, batch_size=1,
                              grad_accum_steps=2, shift=3.0, **cfg)
    assert rank0["family"] == "wan2.2-i2v"
    step4 = list_checkpoints(root / "run" / "checkpoints")[0][1]
    assert len(list((step4 / "dcp").glob("*.distcp"))) == 2  # sharded
    return rank0


def _generate(pipe) -> tuple:
    return pipe(image=_image(), prompt_embeds=wan_prompt_embeds(pipe, ["a red ball"], 16), guidance_scale=1.0,
                height=32, width=48, num_frames=9, num_inference_steps=4, output_type="np",
                generator=torch.Generator().manual_seed(0)).frames.shape


@pytest.mark.heavy  # the mechanism (two experts, FSDP2, exact resume, both exported) runs in make test for
# text-to-video (tests/test_trainer_wan22_parallel.py); the I2V conditioning in tests/test_wan22_i2v.py
def test_fsdp2_both_experts_full_resume_exactly_and_export_both(tiny_wan22_i2v, tmp_path):
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    rank0 = _launch(tmp_path, tiny_wan22_i2v, mode="full", expert="both")
    routed = [r["expert_micro_batches"] for r in read_metrics(tmp_path / "run")]
    assert {name for r in routed for name in r} == {"high", "low"} and all(sum(r.values()) == 2 for r in routed)
    step4 = list_checkpoints(tmp_path / "run" / "checkpoints")[0][1]
    assert len(list((step4 / "transformer_2" / "dcp").glob("*.distcp"))) == 2  # the second expert, sharded apart
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, WanImageToVideoPipeline) and pipe.image_encoder is None
    base = WanImageToVideoPipeline.from_pretrained(tiny_wan22_i2v)
    for slot in ("transformer", "transformer_2"):
        trained, untrained = getattr(pipe, slot).state_dict(), getattr(base, slot).state_dict()
        # the blocks and the 36-channel patch embedding (its condition channels included)
        changed = [k for k in untrained if not torch.equal(untrained[k], trained[k].to(untrained[k].dtype))]
        assert any(k.startswith("blocks.1.") for k in changed) and "patch_embedding.weight" in changed, slot
    assert _generate(pipe) == (1, 9, 32, 48, 3)


@pytest.mark.heavy  # the second variant of the path above (LoRA, one expert)
def test_fsdp2_low_expert_lora_resumes_exactly_and_exports(tiny_wan22_i2v, tmp_path):
    from diffusers import WanImageToVideoPipeline

    rank0 = _launch(tmp_path, tiny_wan22_i2v, mode="lora", expert="low", lora_rank=4, learning_rate=1e-2)
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan22_i2v)
    pipe.load_lora_weights(Path(rank0["export_dir"]) / "low_noise", load_into_transformer_2=True)
    (name,) = pipe.transformer_2.peft_config
    assert pipe.transformer_2.peft_config[name].r == 4 and not getattr(pipe.transformer, "peft_config", None)
    assert _generate(pipe) == (1, 9, 32, 48, 3)
