"""``trainer.parallel.build_mesh`` on 4 gloo ranks: every group of an HSDP (replicate x shard) mesh waits
``parallel.timeout_minutes``, not only the default group (its subgroups used to keep gloo's 30 minutes, and
every FSDP2 collective runs on them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # four gloo processes

WORKER = """
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from latentmill.trainer import ParallelConfig
from latentmill.trainer.parallel import build_mesh, init_distributed, shutdown

parallel = ParallelConfig("fsdp2", hsdp_replicate=2, timeout_minutes=3)
ctx = init_distributed(parallel)
mesh = build_mesh(parallel, ctx)
cpu = torch.device("cpu")
seconds = {"default": dist.group.WORLD._get_backend(cpu).options._timeout.total_seconds()}
for name in mesh.mesh_dim_names:
    seconds[name] = mesh.get_group(name)._get_backend(cpu).options._timeout.total_seconds()
Path(sys.argv[1], f"rank{ctx.rank}.json").write_text(json.dumps(
    {"seconds": seconds, "names": list(mesh.mesh_dim_names), "shape": list(mesh.shape)}))
shutdown(ctx)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, world: int) -> list[dict]:
    """Run WORKER on ``world`` gloo ranks; each rank's record."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port, procs = _free_port(), []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, str(worker), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outputs
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def test_hsdp_mesh_groups_wait_the_configured_timeout(tmp_path):
    records = _launch(tmp_path, 4)
    for record in records:
        assert record["names"] == ["replicate", "shard"] and record["shape"] == [2, 2]
        assert record["seconds"] == {"default": 180.0, "replicate": 180.0, "shard": 180.0}
