"""How many intra-op threads CPU training uses: ``choose_cpu_threads`` (the trainer applies it, doctor says it).

torch's default is one OpenMP thread per core the machine has. Training on the CPU also runs the loader's
read-ahead thread, and under torchrun several ranks share the node's cores; an OpenMP team whose threads
outnumber the cores it can run on waits at every barrier for a preempted thread while the others spin,
and a small model's many short ops then cost a scheduling round each (an order of magnitude on a busy
machine). So: the cores this process may run on (its CPU affinity and its cgroup's CPU quota), shared among
the node's ranks, less one for the read-ahead thread. ``trainer.cpu_threads`` or an ``OMP_NUM_THREADS`` the
user set wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count for CPU training and, in one line, why."""

    threads: int
    reason: str


def cgroup_cpu_limit(path: Path = CGROUP_CPU_MAX) -> float | None:
    """The CPUs this process's cgroup may use (quota / period), or None without a limit or cgroup v2."""
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def usable_cores() -> tuple[int, str]:
    """(cores this process may run on, how that was found): its CPU affinity, capped by a cgroup CPU quota."""
    if hasattr(os, "sched_getaffinity"):
        cores, how = len(os.sched_getaffinity(0)), "CPU affinity"
    else:
        cores, how = os.cpu_count() or 1, "os.cpu_count"
    limit = cgroup_cpu_limit()
    if limit is not None and math.ceil(limit) < cores:
        cores, how = max(1, math.ceil(limit)), f"cgroup CPU quota {limit:g}"
    return cores, how


def _set_by_torchrun(env: Mapping[str, str]) -> bool:
    """Whether ``OMP_NUM_THREADS=1`` came from torchrun, not the user: torchrun sets it for its workers when
    it starts more than one and the variable is unset, so it is in this process's environment but not in the
    environment torchrun itself was started with (``/proc/<parent>/environ`` shows the initial one)."""
    if env.get("OMP_NUM_THREADS") != "1" or not env.get("TORCHELASTIC_RUN_ID"):
        return False
    if int(env.get("LOCAL_WORLD_SIZE") or 1) < 2:
        return False
    parent = launcher_environ()
    if parent is None:
        return False  # cannot tell: the value stands, as if the user set it
    return not any(item.startswith(b"OMP_NUM_THREADS=") for item in parent)


def launcher_environ() -> list[bytes] | None:
    """The environment this process's parent (torchrun's agent) was started with, or None if unreadable."""
    try:
        return Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def choose_cpu_threads(configured: int = 0, *, env: Mapping[str, str] | None = None,
                       cores: tuple[int, str] | None = None, read_ahead: bool = True) -> ThreadChoice:
    """The intra-op threads of one CPU training process.

    ``configured`` (``trainer.cpu_threads``) > 0 wins; then ``OMP_NUM_THREADS`` when the user set it (not
    torchrun's own default of 1 for several ranks); else the usable cores (``cores``, default
    ``usable_cores()``) divided among the node's ranks (``LOCAL_WORLD_SIZE``), less one core for the loader's
    read-ahead thread (``read_ahead``) where a rank has more than one, and at least 1.
    """
    env = os.environ if env is None else env
    if configured > 0:
        return ThreadChoice(configured, f"trainer.cpu_threads={configured}")
    omp = (env.get("OMP_NUM_THREADS") or "").strip()
    if omp.isdigit() and int(omp) > 0 and not _set_by_torchrun(env):
        return ThreadChoice(int(omp), f"OMP_NUM_THREADS={omp}")
    count, how = cores if cores is not None else usable_cores()
    ranks = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
    per_rank = max(1, count // ranks)
    threads = max(1, per_rank - 1) if read_ahead else per_rank
    shared = f" shared by {ranks} ranks on this node" if ranks > 1 else ""
    spare = ", one left to the loader's read-ahead thread" if threads < per_rank else ""
    return ThreadChoice(threads, f"{count} usable cores ({how}){shared}{spare}")
