"""Gradient accumulation under FSDP2 keeps gradients sharded (issue 16, item 1), on 2 gloo ranks.

With ``set_requires_gradient_sync(False)`` on the micro-batches before the last, FSDP2 held every gradient
unsharded in float32 until the last one: on 2 ranks, the whole model's bytes per rank instead of half. The
bytes a rank holds after a non-final micro-batch are counted from FSDP2's own parameters: the sharded
``.grad``, and the gradients of its unsharded parameters it keeps when it does not reduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from latentmill.trainer.train import _grad_sync

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
with _grad_sync(model, sync=False, hsdp=False):  # a micro-batch before the last
    model(torch.randn(8, 256)).square().mean().backward()
held = 0
for p in model.parameters():
    if p.grad is not None:
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        held += local.numel() * local.element_size()
for module in model.modules():
    group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
    for fsdp_param in group.fsdp_params if group is not None else []:
        unsharded_param = getattr(fsdp_param, "_unsharded_param", None)  # its gradient, not reduced yet
        for unsharded in (fsdp_param.unsharded_accumulated_grad,
                          unsharded_param.grad if unsharded_param is not None else None):
            held += 0 if unsharded is None else unsharded.numel() * unsharded.element_size()
with _grad_sync(model, sync=True):  # the last micro-batch
    model(torch.randn(8, 256)).square().mean().backward()
grads = [p.grad.to_local() for p in model.parameters()]
out = {"model_bytes": model_bytes, "held_bytes": held, "finite": all(bool(torch.isfinite(g).all()) for g in grads)}
open(sys.argv[1] + f"-{os.environ['RANK']}.json", "w").write(json.dumps(out))
dist.destroy_process_group()
"""


def test_a_non_final_micro_batch_leaves_sharded_gradients(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(tmp_path / "worker.py"), str(tmp_path / "out")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out-{rank}.json").read_text())
        assert result["model_bytes"] == 4 * (256 * 256 + 256) * 4 == 1_052_672
        # half the model per rank (FSDP2 shards each weight's first dim), not the whole of it
        assert result["held_bytes"] == result["model_bytes"] // 2, result
        assert result["finite"]
