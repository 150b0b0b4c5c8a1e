"""An unchanged ``latentmill prep`` of the demo, from the shell, against the 5 s budget (issue 31, item 7).

What a user types twice: ``latentmill prep demo output_dir=OUT``. The first run preps the demo (the embedded
default: its 24 images and the tiny Flux set); each measured run is the console script again in a fresh
process, which finds nothing changed (``pipelines/unchanged.py``: the source's stat signature and the last
run's units) and prints the last run's outcome without starting Prefect or importing torch. Measured: the
wall time of the whole command (interpreter start, imports, the check, the summary) and its CPU time (rusage of
the child), which other jobs on a shared machine hardly move; the figure is wall time / 5 s.

Run alone: ``python -m bench.unchanged``.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO_ROOT, figure, fresh_dir, log, median, reps_of, run_benchmark, setup_env

setup_env()

BUDGET_S = 5.0


def _latentmill(*args: str) -> tuple[float, float, str]:
    """The console script with ``args`` in a fresh process: wall seconds, CPU seconds, its output."""
    script = Path(sys.executable).with_name("latentmill")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([str(script), *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"latentmill {' '.join(args)} failed ({done.returncode}): {done.stdout[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def run(args) -> list:
    work = fresh_dir("unchanged")
    out = work / "out"
    first_wall, _, _ = _latentmill("prep", "demo", f"output_dir={out}")
    log(f"first prep of the demo: {first_wall:.1f} s")
    walls, cpus = [], []
    for rep in range(reps_of(args, full=5, quick=2)):
        wall, cpu, text = _latentmill("prep", "demo", f"output_dir={out}")
        if "nothing changed since the prep" not in text:
            raise RuntimeError(f"the prep ran again instead of finding nothing changed: {text[-2000:]}")
        walls.append(wall)
        cpus.append(cpu)
        log(f"rep {rep + 1}: unchanged prep {wall:.2f} s wall, {cpu:.2f} s CPU")
    shutil.rmtree(work, ignore_errors=True)
    return [figure("31. unchanged `latentmill prep demo` from the shell vs the 5 s budget", walls,
                   [BUDGET_S] * len(walls), "s", "<= 1.0",
                   inputs={"command": "latentmill prep demo output_dir=OUT (the second and later runs)",
                           "first_prep_s": round(first_wall, 1)},
                   notes="wall time of the console script in a fresh process, nothing changed since the last prep "
                         "(no Prefect, no torch); details: its CPU time",
                   details={"cpu_s": round(median(cpus), 3), "cpu_s_reps": [round(c, 3) for c in cpus]})]


def main(argv=None) -> None:
    run_benchmark("unchanged", __doc__, run, argv)


if __name__ == "__main__":
    main()
