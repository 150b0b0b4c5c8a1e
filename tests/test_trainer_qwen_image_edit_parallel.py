"""Qwen-Image-Edit under torchrun on CPU (gloo), as Qwen-Image's 2-rank test: FSDP2 over the adapter's blocks
(full, activation checkpointing) with a sharded checkpoint, an exact resume and a gathered export for
QwenImageEditPipeline (make test); DDP LoRA with an exact resume and a LoRA export (make test-all). Every
batch carries the sources' latents beside the targets' and masked text of different lengths."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import read_metrics, write_fake_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a torchrun launch starts two interpreters

WORKER = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from latentmill.trainer import ParallelConfig, TrainerConfig, train

torch.set_num_threads(1)
dist.init_process_group("gloo")
for job in json.loads(sys.argv[1]):
    summary = train(TrainerConfig(**job["cfg"]), cache_dir=job["cache"], pretrained=job["pretrained"],
                    train_dir=job["train_dir"], seed=0, progress=False, parallel=ParallelConfig(**job["parallel"]))
    Path(job["train_dir"], f"summary-{os.environ['RANK']}.json").write_text(json.dumps(summary))
dist.barrier()
dist.destroy_process_group()
"""


def _run(root: Path, parallel: dict, **cfg) -> tuple[Path, Path, dict]:
    """Train 8 steps (checkpoint at 4) and resume from step 4 on 2 ranks; the runs' folders and summaries."""
    from latentmill.stages.families import family_streams

    from latentmill.tiny_qwen_image import build_tiny_qwen_image_edit

    pretrained = build_tiny_qwen_image_edit(root / "tiny-qwen-image-edit")
    write_fake_cache(root / "cache", {(48, 64, 1): 5, (64, 32, 1): 3}, family="qwen-image-edit", smooth=True,
                     trimmed=True, seq_len=8, shards_per_bucket=2, reference=True,
                     streams=[s.to_json() for s in family_streams("qwen-image-edit")])
    (root / "worker.py").write_text(WORKER)
    out = root / "runs"
    cfg = {"max_steps": 8, "batch_size": 2, "learning_rate": 3e-3, "save_every": 4, "keep_latest_k": 0,
           "lora_rank": 4, **cfg}
    jobs = [{"cfg": {**cfg, "export": True}, "train_dir": str(out / "a")},
            {"cfg": {**cfg, "export": False, "resume": str(out / "a/checkpoints/step-000004")},
             "train_dir": str(out / "b")}]
    jobs = [{**j, "cache": str(root / "cache"), "pretrained": str(pretrained), "parallel": parallel} for j in jobs]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "worker.py"), json.dumps(jobs)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "rror" in line or "issing" in line]
    assert done.returncode == 0, "\n".join(errors)[-3000:]
    summaries = {name: [json.loads((out / name / f"summary-{r}.json").read_text()) for r in (0, 1)] for name in "ab"}
    return pretrained, out, summaries


# the second variant of Qwen-Image's 2-rank FSDP2 path (tests/test_trainer_qwen_image_parallel.py, in make test):
# make test-all
@pytest.mark.heavy
def test_fsdp2_full_trains_resumes_exactly_and_exports(tmp_path):
    import torch
    from diffusers import DiffusionPipeline, QwenImageEditPipeline

    from tests.helpers import qwen2vl_processor

    pretrained, out, summaries = _run(tmp_path, {"strategy": "fsdp2"}, mode="full", activation_checkpointing=True)
    rank0, rank1 = summaries["a"]
    assert rank0["family"] == "qwen-image-edit" and rank0["world_size"] == 2
    assert rank0["steps"] == rank1["steps"] == 8 and rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(out / "a")]
    assert len(losses) == 8 and all(0 < x < 1e3 for x in losses)
    step4 = list_checkpoints(out / "a" / "checkpoints")[0][1]
    assert len(list((step4 / "dcp").glob("*.distcp"))) == 2  # sharded: one file per rank
    assert [r["loss"] for r in read_metrics(out / "b")] == losses[4:]  # steps 5-8 replayed bit for bit
    export = rank0["export_dir"]
    pipe = DiffusionPipeline.from_pretrained(export, processor=qwen2vl_processor(export))
    assert isinstance(pipe, QwenImageEditPipeline) and rank1["export_dir"] is None
    base = QwenImageEditPipeline.from_pretrained(pretrained, processor=None).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys() and any(not torch.equal(base[k], exported[k].to(base[k].dtype))
                                                  for k in base)


@pytest.mark.heavy  # the second variant of the 2-rank path (DDP LoRA), in make test-all
def test_ddp_lora_resumes_exactly_and_exports(tmp_path):
    from diffusers import QwenImageEditPipeline
    from latentmill.trainer.qwen_image import QWEN_IMAGE_LORA_TARGETS

    pretrained, out, summaries = _run(tmp_path, {"strategy": "ddp"}, mode="lora", learning_rate=1e-2)
    rank0, rank1 = summaries["a"]
    assert rank0["steps"] == rank1["steps"] == 8 and rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(out / "a")]
    assert [r["loss"] for r in read_metrics(out / "b")] == losses[4:]
    pipe = QwenImageEditPipeline.from_pretrained(pretrained, processor=None)
    pipe.load_lora_weights(rank0["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert set(pipe.transformer.peft_config[adapter].target_modules) == set(QWEN_IMAGE_LORA_TARGETS)
