"""Z-Image under torchrun on CPU (gloo, 2 ranks): DDP LoRA and FSDP2 full (with activation checkpointing over the
adapter's blocks: refiners and main layers) train, resume exactly from a checkpoint, and export what
ZImagePipeline loads."""

from __future__ import annotations

import statistics

import pytest
import torch
from latentmill.trainer.checkpoint import list_checkpoints

from tests.test_trainer_zimage import LORA_REGEX, LORA_TARGETS, fake_cache
from tests.trainer_helpers import launch_jobs, read_metrics

# heavy: the DDP and FSDP2 paths make test runs for FLUX.1, Wan, FLUX.2 klein and Qwen-Image (make test-all)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def runs(tiny_zimage, tmp_path_factory):
    """One 2-rank launch: DDP LoRA (a) and its resume from step 4 (b); FSDP2 full with activation
    checkpointing (c) and its resume from step 4 (d). Uneven shards: 5 + 3 samples in batches of 2."""
    root = tmp_path_factory.mktemp("zimage-parallel")
    fake_cache(root / "cache", {(48, 64, 1): 5, (64, 32, 1): 3}, smooth=True, shards_per_bucket=2, seq_len=12)
    ddp, fsdp = {"strategy": "ddp"}, {"strategy": "fsdp2"}

    def job(name, parallel, **cfg):
        cfg = {"max_steps": 8, "batch_size": 2, "learning_rate": 3e-3, "save_every": 4, "keep_latest_k": 0,
               "export": False, "shift": 3.0, **cfg}
        return {"cfg": cfg, "cache": str(root / "cache"), "pretrained": str(tiny_zimage),
                "train_dir": str(root / name), "parallel": parallel}

    lora = {"mode": "lora", "lora_rank": 4, "lora_target_modules": list(LORA_TARGETS), "learning_rate": 1e-2}
    jobs = [
        job("a", ddp, export=True, **lora),
        job("b", ddp, resume=str(root / "a" / "checkpoints" / "step-000004"), **lora),
        job("c", fsdp, mode="full", export=True, activation_checkpointing=True),
        job("d", fsdp, mode="full", activation_checkpointing=True,
            resume=str(root / "c" / "checkpoints" / "step-000004")),
    ]
    summaries = dict(zip("abcd", launch_jobs(root, jobs)))
    return root, summaries


def _check_run_and_resume(root, summaries, run, resumed, falls=True):
    rank0, rank1 = summaries[run]
    assert rank0["world_size"] == 2 and rank0["steps"] == rank1["steps"] == 8
    assert rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(root / run)]
    assert len(losses) == 8 and all(0 < x < 1e3 for x in losses)
    if falls:  # (8 steps of a rank-4 LoRA, B initialised to 0, move the loss less than its batch noise)
        assert statistics.mean(losses[-3:]) < statistics.mean(losses[:3])
    assert [s for s, _ in list_checkpoints(root / run / "checkpoints")] == [4, 8]
    assert summaries[resumed][0]["resumed_from"].endswith("step-000004")
    assert [r["loss"] for r in read_metrics(root / resumed)] == losses[4:]  # steps 5-8 bit for bit
    return rank0


def test_ddp_lora_resumes_exactly_and_exports(runs, tiny_zimage):
    from diffusers import ZImagePipeline

    root, summaries = runs
    rank0 = _check_run_and_resume(root, summaries, "a", "b", falls=False)
    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    pipe.load_lora_weights(rank0["export_dir"])
    (name,) = pipe.get_active_adapters()
    assert pipe.transformer.peft_config[name].target_modules == LORA_REGEX
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k]
    assert len(lora_b) == 2 * 7 and all(bool(v.abs().sum() > 0) for v in lora_b)  # every B trained from 0
    image = pipe("a red square", height=32, width=32, num_inference_steps=2, guidance_scale=0.0,
                 max_sequence_length=32).images[0]
    assert image.size == (32, 32)


def test_fsdp2_full_resumes_exactly_and_exports(runs, tiny_zimage):
    from diffusers import DiffusionPipeline, ZImagePipeline

    root, summaries = runs
    rank0 = _check_run_and_resume(root, summaries, "c", "d")
    step4 = list_checkpoints(root / "c" / "checkpoints")[0][1]
    assert len(list((step4 / "dcp").glob("*.distcp"))) == 2  # sharded: one file per rank
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, ZImagePipeline) and summaries["c"][1]["export_dir"] is None
    base = ZImagePipeline.from_pretrained(tiny_zimage).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys()
    changed = [k for k in base if not torch.equal(base[k], exported[k].to(base[k].dtype))]
    assert any(k.startswith("noise_refiner.") for k in changed) and any(k.startswith("layers.1.") for k in changed)
    image = pipe("a red square", height=32, width=32, num_inference_steps=2, guidance_scale=0.0,
                 max_sequence_length=32).images[0]
    assert image.size == (32, 32)
