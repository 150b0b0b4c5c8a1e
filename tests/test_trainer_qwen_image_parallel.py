"""Qwen-Image under torchrun on CPU (gloo): FSDP2 over the adapter's blocks (full, activation checkpointing)
with a sharded checkpoint and an exact resume and a gathered export for QwenImagePipeline; DDP LoRA with the
community target modules, an exact resume, and a LoRA export that load_lora_weights takes. The cache's text is
trimmed (a mask stream): each rank's batches hold captions of different lengths, padded and masked."""

import pytest
import torch
from latentmill.trainer.checkpoint import list_checkpoints
from latentmill.trainer.qwen_image import QWEN_IMAGE_LORA_TARGETS

from tests.trainer_helpers import launch_jobs, read_metrics, write_fake_cache

# heavy: a family's repeat of FSDP2 full and DDP LoRA, which make test runs on FLUX.1 (test_trainer_fsdp.py,
# test_trainer_ddp.py); a torchrun launch starts two interpreters
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def runs(tiny_qwen_image, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-parallel")
    pretrained = tiny_qwen_image
    write_fake_cache(root / "cache", {(48, 64, 1): 5, (64, 32, 1): 3}, family="qwen-image", smooth=True,
                     trimmed=True, seq_len=8, shards_per_bucket=2)
    out = root / "runs"

    def job(name, parallel, **cfg):
        cfg = {"max_steps": 8, "batch_size": 2, "learning_rate": 3e-3, "save_every": 4, "keep_latest_k": 0,
               "export": False, "lora_rank": 4, **cfg}
        return {"cfg": cfg, "cache": str(root / "cache"), "pretrained": str(pretrained),
                "train_dir": str(out / name), "parallel": parallel}

    fsdp, ddp = {"strategy": "fsdp2"}, {"strategy": "ddp"}
    lora = {"mode": "lora", "learning_rate": 1e-2, "lora_target_modules": list(QWEN_IMAGE_LORA_TARGETS)}
    jobs = [
        job("a", fsdp, mode="full", activation_checkpointing=True, export=True),
        job("b", fsdp, mode="full", activation_checkpointing=True, resume=str(out / "a/checkpoints/step-000004")),
        job("c", ddp, **lora, export=True),
        job("d", ddp, **lora, resume=str(out / "c/checkpoints/step-000004")),
    ]
    summaries = dict(zip("abcd", launch_jobs(root, jobs)))
    return pretrained, out, summaries


def test_fsdp2_full_trains_resumes_exactly_and_exports(runs):
    from diffusers import DiffusionPipeline, QwenImagePipeline

    pretrained, out, summaries = runs
    rank0, rank1 = summaries["a"]
    assert rank0["family"] == "qwen-image" and rank0["world_size"] == 2
    assert rank0["steps"] == rank1["steps"] == 8 and rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(out / "a")]
    assert len(losses) == 8 and all(0 < x < 1e3 for x in losses)
    step4 = list_checkpoints(out / "a" / "checkpoints")[0][1]
    assert len(list((step4 / "dcp").glob("*.distcp"))) == 2  # sharded: one file per rank
    assert [r["loss"] for r in read_metrics(out / "b")] == losses[4:]  # steps 5-8 replayed bit for bit
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, QwenImagePipeline) and rank1["export_dir"] is None
    base = QwenImagePipeline.from_pretrained(pretrained).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys() and any(not torch.equal(base[k], exported[k].to(base[k].dtype))
                                                  for k in base)
    image = pipe("a red square", height=32, width=32, num_inference_steps=2, max_sequence_length=16).images[0]
    assert image.size == (32, 32)


def test_ddp_lora_resumes_exactly_and_exports(runs):
    from diffusers import QwenImagePipeline

    pretrained, out, summaries = runs
    rank0, rank1 = summaries["c"]
    assert rank0["steps"] == rank1["steps"] == 8 and rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(out / "c")]
    assert [r["loss"] for r in read_metrics(out / "d")] == losses[4:]
    pipe = QwenImagePipeline.from_pretrained(pretrained)
    pipe.load_lora_weights(rank0["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert set(pipe.transformer.peft_config[adapter].target_modules) == set(QWEN_IMAGE_LORA_TARGETS)
