"""``latentmill sample``: steady-state images/s with ``--compile`` vs without, on the tiny Flux model (CPU).

Ours: ``latentmill.sample.sample(..., compile=True)`` (``torch.compile`` of the transformer, inductor) on the
tiny Flux pipeline built from ``data/tiny-flux.yaml``; baseline: the same call without ``--compile``. Both in
their own child process (a compiled graph must not leak into the other), each reporting the median of
``--repeat`` timed calls after its warm-up call (``latentmill.timing.steady_state``: the first call, with the
compile, is reported apart). Issue 19 asks for the figure, not a goal: on a 2-core CPU compiling may not pay;
GPU figures come from ``make gpu-check``.

Run alone: ``python -m bench.sample [--quick]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import figure, log, model_dir, run_benchmark, setup_env, temp_dir

setup_env()

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys
from latentmill.sample import sample
report = sample(sys.argv[1], ["a red circle", "a blue square"], out=sys.argv[2], batch=2, steps=4,
                size=(64, 64), repeat=int(sys.argv[3]), compile=sys.argv[4] == "1", device="cpu")
print(json.dumps({k: report.get(k) for k in ("images_per_s", "median_s", "min_s", "max_s", "first_call_s",
                                              "compile_s", "compiled", "repeats")}))
"""


def run(args) -> list:
    pretrained = model_dir()
    work = temp_dir("sample-")
    repeat = 3 if args.quick else 8
    reports = {}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name, flag in (("eager", "0"), ("compiled", "1")):
        done = subprocess.run([sys.executable, "-c", CHILD, str(pretrained), str(work / name), str(repeat), flag],
                              capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            raise RuntimeError(f"sample ({name}) failed: {done.stderr[-2000:]}")
        reports[name] = json.loads(done.stdout.strip().splitlines()[-1])
        log(f"sample {name}: {reports[name]}")
    inputs = {"model": "tiny-flux (data/tiny-flux.yaml)", "batch": 2, "steps": 4, "size": "64x64",
              "repeat": repeat, "device": "cpu", "backend": "inductor"}
    return [figure("17. sample: steady-state images/s with --compile vs without (tiny Flux, CPU)",
                   [reports["compiled"]["images_per_s"]], [reports["eager"]["images_per_s"]], "images/s", None,
                   inputs, "informational (issue 19): the median of the timed calls after the warm-up call; the "
                   "first call and the compile time are in details", details=reports)]


def main(argv=None) -> None:
    run_benchmark("sample", __doc__, run, argv)


if __name__ == "__main__":
    main()
