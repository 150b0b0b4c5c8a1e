"""DDP on CPU (gloo) under torchrun: two ranks train in step, rank 0 writes once, resume is exact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import build_tiny_transformer, read_metrics, write_fake_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each torchrun launch starts two interpreters (~10 s on 2 cores)

WORKER = """
import json, os, sys
from pathlib import Path
import torch
from latentmill.trainer import ParallelConfig, TrainerConfig, train

torch.set_num_threads(1)
args = json.loads(sys.argv[1])
summary = train(TrainerConfig(**args["cfg"]), cache_dir=args["cache"], pretrained=args["pretrained"],
                train_dir=args["train_dir"], seed=0, progress=False, parallel=ParallelConfig("ddp"))
Path(args["train_dir"], f"summary-{os.environ['RANK']}.json").write_text(json.dumps(summary))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    build_tiny_transformer(root / "pretrained")
    write_fake_cache(root / "cache", {(48, 64, 1): 6, (64, 32, 1): 6}, smooth=True)
    (root / "worker.py").write_text(WORKER)
    return root


def _torchrun(root: Path, train_dir: Path, **cfg) -> list[dict]:
    cfg = {"max_steps": 6, "batch_size": 2, "learning_rate": 3e-3, "save_every": 3, "keep_latest_k": 0,
           "export": False, "lora_rank": 4, **cfg}  # fmt: skip
    args = {"cfg": cfg, "cache": str(root / "cache"), "pretrained": str(root / "pretrained"),
            "train_dir": str(train_dir)}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "worker.py"), json.dumps(args)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((train_dir / f"summary-{r}.json").read_text()) for r in (0, 1)]


def test_ddp_trains_writes_once_and_resumes_exactly(setup, tmp_path):
    rank0, rank1 = _torchrun(setup, tmp_path / "a", mode="lora")
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert rank0["steps"] == rank1["steps"] == 6
    assert rank0["final_loss"] == rank1["final_loss"]  # the loss of the global batch, on every rank
    assert rank0["samples_per_s"] > 0
    metrics = read_metrics(tmp_path / "a")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]  # written by rank 0 only
    checkpoints = list_checkpoints(tmp_path / "a" / "checkpoints")
    assert [s for s, _ in checkpoints] == [3, 6]
    assert sorted(p.name for p in checkpoints[0][1].glob("rng-rank*")) == [
        "rng-rank0.safetensors",
        "rng-rank1.safetensors",
    ]
    # 12 samples, batch 2, 2 ranks: 3 steps per epoch. Resuming from step 3 (each rank restores its own
    # noise generator) replays steps 4-6 bit for bit.
    resumed, _ = _torchrun(setup, tmp_path / "b", mode="lora", resume=str(checkpoints[0][1]))
    assert resumed["resumed_from"] == str(checkpoints[0][1])
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == [r["loss"] for r in metrics[3:]]
