"""HunyuanVideo 1.5 under torchrun on CPU (gloo, 2 ranks): FSDP2 full fine-tune and FSDP2 LoRA train with both
masked text streams, resume bit for bit from a checkpoint, and export what HunyuanVideo15Pipeline loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from latentmill.stages.families import family_streams
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import JOBS_WORKER as WORKER
from tests.trainer_helpers import read_metrics, write_fake_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _launch(root: Path, pretrained: Path, mode: str, **extra) -> dict:
    """One 2-rank launch: an FSDP2 run of 6 steps (r) and its resume from step 3 (s); the ranks' summaries.
    Uneven shards: 3 + 2 samples of two video buckets in batches of 1 per rank."""
    root.mkdir()
    write_fake_cache(root / "cache", {(48, 32, 9): 3, (32, 48, 5): 2}, family="hunyuanvideo1.5", channels=16,
                     seq_len=8, smooth=True, shards_per_bucket=2, trimmed=True,
                     streams=[s.to_json() for s in family_streams("hunyuanvideo1.5")])
    (root / "worker.py").write_text(WORKER)

    def job(name, **cfg):
        cfg = {"mode": mode, "max_steps": 6, "batch_size": 1, "learning_rate": 3e-3, "save_every": 3,
               "keep_latest_k": 0, "export": False, "shift": 5.0, **extra, **cfg}
        return {"cfg": cfg, "cache": str(root / "cache"), "pretrained": str(pretrained),
                "train_dir": str(root / name), "parallel": {"strategy": "fsdp2"}}

    jobs = [job("r", export=True), job("s", resume=str(root / "r" / "checkpoints" / "step-000003"))]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "worker.py"), json.dumps(jobs)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = {name: [json.loads((root / name / f"summary-{r}.json").read_text()) for r in (0, 1)]
                 for name in "rs"}
    rank0, rank1 = summaries["r"]
    assert rank0["world_size"] == 2 and rank0["steps"] == rank1["steps"] == 6
    assert rank0["family"] == "hunyuanvideo1.5" and rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(root / "r")]
    assert len(losses) == 6 and all(0 < x < 1e3 for x in losses)
    assert [s for s, _ in list_checkpoints(root / "r" / "checkpoints")] == [3, 6]
    assert summaries["s"][0]["resumed_from"].endswith("step-000003")
    assert [r["loss"] for r in read_metrics(root / "s")] == losses[3:]  # steps 4-6 bit for bit
    return rank0


def test_fsdp2_full_resumes_exactly_and_exports(tiny_hunyuan_video15, tmp_path):
    from diffusers import DiffusionPipeline, HunyuanVideo15Pipeline

    rank0 = _launch(tmp_path / "full", tiny_hunyuan_video15, "full")
    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, HunyuanVideo15Pipeline)
    base = HunyuanVideo15Pipeline.from_pretrained(tiny_hunyuan_video15).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys()
    # compared in the export's storage dtype (bf16): rounding alone is no change
    changed = {k for k in base if not torch.equal(base[k].bfloat16(), exported[k].bfloat16())}
    assert any(k.startswith("transformer_blocks.0.") for k in changed)
    assert any(k.startswith("transformer_blocks.1.") for k in changed)
    # the last block's text-stream output is never read: frozen, exported as it was
    assert not any(k.startswith(("transformer_blocks.1.ff_context.", "transformer_blocks.1.attn.to_add_out."))
                   for k in changed)


@pytest.mark.heavy
def test_fsdp2_lora_resumes_exactly_and_exports(tiny_hunyuan_video15, tmp_path):
    from diffusers import HunyuanVideo15Pipeline

    rank0 = _launch(tmp_path / "lora", tiny_hunyuan_video15, "lora", lora_rank=4, learning_rate=1e-2)
    pipe = HunyuanVideo15Pipeline.from_pretrained(tiny_hunyuan_video15)
    pipe.transformer.load_lora_adapter(rank0["export_dir"], use_safetensors=True)
    (name,) = pipe.transformer.active_adapters()
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k]
    assert pipe.transformer.peft_config[name].r == 4 and lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)
