"""``trainer.parallel.shutdown`` after a run that ended normally waits for every rank before it destroys the
process group, so a rank that finished early never tears gloo/NCCL down under a slower peer's last
collective (the abort "terminate called without an active exception" seen in CI at teardown).

Two gloo ranks: rank 1 reaches the end after rank 0 and leaves a marker file just before it calls
``shutdown``. With ``synchronize=True`` (what ``train`` passes on success) rank 1 arrives two seconds late and
rank 0 leaves ``shutdown`` only after the marker exists; with ``synchronize=False`` (what ``train`` passes
after an error, when a failed peer may never arrive) rank 1 arrives only once rank 0 has left ``shutdown`` and
written its result (a ``shutdown`` that waited would hold rank 0 until rank 1's minute runs out), so the
outcome does not hang on how fast a loaded machine runs rank 0.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # two gloo processes

WORKER = """
import json, sys, time
from pathlib import Path
from latentmill.trainer import ParallelConfig
from latentmill.trainer.parallel import init_distributed, shutdown

root, synchronize = Path(sys.argv[1]), sys.argv[2] == "1"
ctx = init_distributed(ParallelConfig("ddp"))
assert ctx.initialized and ctx.owns_group and ctx.world_size == 2
if ctx.rank == 1:
    if synchronize:  # rank 0 waits in shutdown's barrier meanwhile
        time.sleep(2.0)
    else:  # rank 0 does not wait: it has left shutdown (its file is written) before rank 1 reaches the end
        deadline = time.time() + 60
        while not (root / "rank0.json").exists() and time.time() < deadline:
            time.sleep(0.05)
    (root / "rank1-at-end").write_text("1")
shutdown(ctx, synchronize=synchronize)
import torch.distributed as dist
(root / f"rank{ctx.rank}.json").write_text(json.dumps(
    {"peer_was_at_end": (root / "rank1-at-end").exists(), "group_left": dist.is_initialized()}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("synchronize", [True, False])
def test_shutdown_after_success_waits_for_every_rank(tmp_path, synchronize):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, str(worker), str(tmp_path), "1" if synchronize else "0"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["group_left"] is False and rank1["group_left"] is False
    assert rank1["peer_was_at_end"] is True
    # the barrier: rank 0 left shutdown only once rank 1 had reached it; without it rank 0 is long gone
    assert rank0["peer_was_at_end"] is synchronize
