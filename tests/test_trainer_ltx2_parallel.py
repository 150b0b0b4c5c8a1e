"""LTX-2 under torchrun on CPU (gloo, 2 ranks): FSDP2 full fine-tune and FSDP2 LoRA train on the demo videos'
sound and frames, resume bit for bit from a checkpoint (the audio noise draws included), and export what
LTX2Pipeline loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from latentmill.trainer.checkpoint import list_checkpoints

from tests.conftest import REPO_ROOT
from tests.trainer_helpers import JOBS_WORKER as WORKER
from tests.trainer_helpers import read_metrics

# heavy: 70 s a launch on 2 busy cores, as Wan 2.2 TI2V's; make test keeps FSDP2 on the other families, and this
# family's noise draws (the audio's included) are checked step by step in tests/test_trainer_ltx2.py
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def snapshot(ltx2_prep):
    """The demo videos with sound prepped with the tiny LTX-2 set: 8 clips of 64 x 64 px x 17 frames."""
    (path,) = (ltx2_prep / "snapshots").glob("0001-*")
    return path


def _launch(root: Path, snapshot: Path, pretrained: Path, mode: str, **extra) -> dict:
    """One 2-rank launch: an FSDP2 run of 6 steps (r) and its resume from step 3 (s); rank 0's summary."""
    root.mkdir()
    (root / "worker.py").write_text(WORKER)

    def job(name, **cfg):
        cfg = {"mode": mode, "max_steps": 6, "batch_size": 1, "learning_rate": 3e-3, "save_every": 3,
               "keep_latest_k": 0, "export": False, "audio_loss_weight": 0.5, **extra, **cfg}
        return {"cfg": cfg, "cache": str(snapshot), "pretrained": str(pretrained), "train_dir": str(root / name),
                "parallel": {"strategy": "fsdp2"}}

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
    assert rank0["family"] == "ltx2" and rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(root / "r")]
    assert len(losses) == 6 and all(0 < x < 1e3 for x in losses)
    assert [s for s, _ in list_checkpoints(root / "r" / "checkpoints")] == [3, 6]
    assert summaries["s"][0]["resumed_from"].endswith("step-000003")
    assert [r["loss"] for r in read_metrics(root / "s")] == losses[3:]  # steps 4-6 bit for bit
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
