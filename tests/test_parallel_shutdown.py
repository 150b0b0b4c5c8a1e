"""``trainer.parallel.shutdown`` after a run that ended normally waits for every rank before it destroys the
process group, so a rank that finished early never tears gloo/NCCL down under a slower peer's last
collective (the abort "terminate called without an active exception" seen in CI at teardown).

Two gloo ranks: rank 1 reaches the end after rank 0 and leaves a marker file just before it calls
``shutdown``. With ``synchronize=True`` (what ``train`` passes on success) rank 1 arrives two seconds late and
rank 0 leaves ``shutdown`` only after the marker exists; with ``synchronize=False`` (what ``train`` passes
after an error, when a failed peer may never arrive) rank 1 arrives only once rank 0 has left ``shutdown`` and
written its result (a ``shutdown`` that waited would hold rank 0 until rank 1's minute runs out), so the
outcome does not hang on how fast a loaded machine runs rank 0.

Through ``train`` (FSDP2, tiny Flux): a finished run leaves no gloo thread for interpreter finalization (the
intermittent SIGABRT after a finished run), and a rank that fails mid-run ends both ranks with exit code 1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
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


def _launch(script: Path, *args: str, timeout: float = 400) -> tuple[list[int], list[str]]:
    """Start two gloo ranks of ``script`` as plain processes (no launcher that would end a hung peer); their
    exit codes and outputs. A rank still running after ``timeout`` seconds fails the test (a deadlock), with the
    stacks of its threads."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # each rank prints its threads' stacks (faulthandler, below), then ends
            p.send_signal(signal.SIGUSR1)
        time.sleep(5)
        for p in procs:
            p.kill()
        stacks = [p.communicate()[0] for p in procs]
        pytest.fail(f"the ranks still ran after {timeout} s; their stacks:\n" + "\n".join(s[-6000:] for s in stacks))
    return [p.returncode for p in procs], outputs


@pytest.mark.parametrize("synchronize", [True, False])
def test_shutdown_after_success_waits_for_every_rank(tmp_path, synchronize):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    codes, outputs = _launch(worker, str(tmp_path), "1" if synchronize else "0", timeout=120)
    assert codes == [0, 0], outputs
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["group_left"] is False and rank1["group_left"] is False
    assert rank1["peer_was_at_end"] is True
    # the barrier: rank 0 left shutdown only once rank 1 had reached it; without it rank 0 is long gone
    assert rank0["peer_was_at_end"] is synchronize


# Two ranks train a tiny Flux with FSDP2 through ``train``, which starts and ends the group itself. ``fail_at``:
# rank 0's ``on_step`` raises after that step, while rank 1 goes on into the next step's collectives.
TRAIN_WORKER = """
import faulthandler, json, os, signal, sys
from pathlib import Path
import torch
from latentmill.trainer import ParallelConfig, TrainerConfig, train

faulthandler.register(signal.SIGUSR1)  # _launch asks for the stacks of a rank that hangs
torch.set_num_threads(1)
root, cache, pretrained, fail_at = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
rank = int(os.environ["RANK"])

def on_step(record):
    if record["step"] == fail_at:
        raise RuntimeError(f"rank {rank} fails after step {fail_at}")

cfg = TrainerConfig(max_steps=2 if fail_at < 0 else fail_at + 2, batch_size=2, learning_rate=3e-3, save_every=0,
                    export=False)
summary = train(cfg, cache_dir=cache, pretrained=pretrained, train_dir=root / "train", seed=0, progress=False,
                parallel=ParallelConfig("fsdp2", timeout_minutes=10), on_step=on_step)
threads = sum("gloo" in Path(f"/proc/self/task/{t}/comm").read_text() for t in os.listdir("/proc/self/task"))
(root / f"rank{rank}.json").write_text(json.dumps({"gloo_threads": threads, "loss": summary["final_loss"]}))
"""


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory, tiny_flux) -> tuple[Path, Path, Path]:
    """The worker script, a fake cache of 8 samples (2 batches of 2 per rank and epoch) and the tiny Flux."""
    from tests.trainer_helpers import write_fake_cache

    root = tmp_path_factory.mktemp("shutdown-train")
    write_fake_cache(root / "cache", {(48, 64, 1): 4, (64, 32, 1): 4}, smooth=True, shards_per_bucket=2)
    (root / "worker.py").write_text(TRAIN_WORKER)
    return root / "worker.py", root / "cache", tiny_flux


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_finished_fsdp2_run_leaves_no_gloo_thread(train_setup, tmp_path):
    """Meshes that DTensor's caches held after the model was gone, and torch.distributed.nn's default arguments,
    kept the process group and gloo's 3 threads per rank alive past ``destroy_process_group`` into interpreter
    finalization, where a gloo thread could abort the rank (SIGABRT) after a finished run."""
    worker, cache, pretrained = train_setup
    codes, outputs = _launch(worker, str(tmp_path), str(cache), str(pretrained), "-1")
    assert codes == [0, 0], outputs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["loss"] == ranks[1]["loss"] > 0
    assert [r["gloo_threads"] for r in ranks] == [0, 0]


def test_a_rank_failing_mid_run_ends_both_ranks(train_setup, tmp_path):
    """The error path does not wait: rank 0 fails after step 1 and exits with its error; rank 1, inside step 2's
    all-gather, gets the closed connection and exits too, long before the 10-minute group timeout (a shutdown
    that waited for the failed peer, or joined a backend thread with a collective in flight, would hang)."""
    worker, cache, pretrained = train_setup
    codes, outputs = _launch(worker, str(tmp_path), str(cache), str(pretrained), "1")
    assert codes == [1, 1], outputs  # a Python error on both ranks, no signal (SIGABRT: -6)
    assert "RuntimeError: rank 0 fails after step 1" in outputs[0]
    assert "Connection closed by peer" in outputs[1], outputs[1][-2000:]
    assert not (tmp_path / "rank0.json").exists() and not (tmp_path / "rank1.json").exists()
