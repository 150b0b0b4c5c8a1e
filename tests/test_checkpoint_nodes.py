"""Checkpoints on nodes that each write a folder of their own (an output on an object store: each node trains in
its work folder): 2 gloo ranks under FSDP2, each the local rank 0 of a node of its own, each with its own
checkpoint folder. Each node's local rank 0 makes, renames and prunes its folder; global rank 0 alone writes
``trainer_state.json`` and the LR schedule; DCP's shards and the RNG files land in the folder of the node whose
rank wrote them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

WORKER = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from latentmill.trainer.checkpoint import save_checkpoint

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
optimizer = torch.optim.AdamW(model.parameters())
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
folder = Path(sys.argv[1]) / f"node{rank}" / "checkpoints"
for step in (1, 2, 3):
    save_checkpoint(folder, step, model=model, optimizer=optimizer, scheduler=scheduler,
                    trainer_state={"world_size": 2}, keep_latest_k=2, rank=rank, barrier=dist.barrier,
                    sharded=True, folder_rank=int(os.environ["LOCAL_RANK"]))
dist.destroy_process_group()
"""


def _tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_each_node_keeps_its_own_checkpoint_folder(tmp_path):
    """Node 0's folder holds the whole step but rank 1's shard and RNG state, node 1's exactly those; each
    node pruned step 1 (keep 2) and left no ``.tmp``; the DCP metadata (node 0's) names both ranks' shards."""
    (tmp_path / "worker.py").write_text(WORKER)
    port = free_port()
    procs = []
    for rank in (0, 1):  # two nodes of one process each: each rank is its node's local rank 0
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1"}
        procs.append(subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(tmp_path)], cwd=REPO_ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    node0, node1 = tmp_path / "node0" / "checkpoints", tmp_path / "node1" / "checkpoints"
    assert sorted(p.name for p in node0.iterdir()) == ["step-000002", "step-000003"]
    assert sorted(p.name for p in node1.iterdir()) == ["step-000002", "step-000003"]
    for step in ("step-000002", "step-000003"):
        assert _tree(node0 / step) == ["dcp/.metadata", "dcp/__0_0.distcp", "lr_scheduler.pt",
                                       "rng-rank0.safetensors", "trainer_state.json"]
        assert _tree(node1 / step) == ["dcp/__1_0.distcp", "rng-rank1.safetensors"]
        assert json.loads((node0 / step / "trainer_state.json").read_text())["step"] == int(step[5:])

    from torch.distributed.checkpoint import FileSystemReader

    named = {info.relative_path for info in FileSystemReader(str(node0 / "step-000003" / "dcp"))
             .read_metadata().storage_data.values()}
    assert named == {"__0_0.distcp", "__1_0.distcp"}
