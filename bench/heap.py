"""Figure 20: the prep's Python heap held per added sample, between N / 10 and N inputs (issue 31).

A prep at N inputs and at N / 10 (100,000 and 10,000; ``--quick`` 20,000 and 2,000), each the real CLI
(``latentmill prep RECIPE``) in a fresh child process traced from its start (``PYTHONTRACEMALLOC=1``), with
the inputs, model and shard layout of ``bench/scale.py`` (64x64 JPEGs with sidecar captions, the tiny Flux
set, shards holding as many samples as at full size). The figure is the growth of the peak traced heap per
added sample, ``(peak(N) - peak(N / 10)) / (N - N / 10)`` bytes, against the 200-byte budget (goal: ratio
<= 1). The peak resident set (VmHWM) of each run is in the details, for information: unlike the traced heap it
moves by tens of MiB between runs of one commit.

Run alone: ``python -m bench.heap --quick``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, TINY_RECIPE, figure, fresh_dir, log, model_dir, run_benchmark, setup_env
from bench.scale import calibrate, make_inputs, sizes, write_recipe

setup_env()

BUDGET = 200  # bytes of heap per added sample (issue 31)

# The child that runs the CLI under tracemalloc (started by PYTHONTRACEMALLOC): its peak traced heap and its
# VmHWM, written to argv[1] at exit.
_TRACED_CHILD = """
import atexit, json, sys, tracemalloc
def _peak():
    rss = next(int(l.split()[1]) / 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))
    open(sys.argv[1], 'w').write(json.dumps({"heap_peak": tracemalloc.get_traced_memory()[1], "peak_rss_mb": rss}))
atexit.register(_peak)
from latentmill.cli import main
sys.exit(main(sys.argv[2:]))
"""


def traced_prep(recipe: Path, work: Path, tag: str) -> dict[str, Any]:
    """``latentmill prep RECIPE`` traced from its start: peak traced heap, VmHWM, wall time, samples out."""
    peak_file, summary_file, log_file = (work / f"{tag}.{ext}" for ext in ("peak", "summary.json", "log"))
    cmd = [sys.executable, "-c", _TRACED_CHILD, str(peak_file), "prep", str(recipe), "--summary-json",
           str(summary_file)]
    start = time.perf_counter()
    with open(log_file, "wb") as fh:
        done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONTRACEMALLOC": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"latentmill prep failed ({done.returncode}); see {log_file}")
    result = {**json.loads(peak_file.read_text()), "wall_s": round(time.perf_counter() - start, 1),
              "samples_out": json.loads(summary_file.read_text())["stages"]["cache"]["out"]}
    log(f"{tag}: {result}")
    return result


def run(args) -> list:
    big, small = sizes(args)
    pretrained = model_dir(TINY_RECIPE)
    work = fresh_dir("heap")
    images, small_images = make_inputs(work, big, small)
    try:
        layout = calibrate(work, images, pretrained)
        runs = {}
        for name, n, source in (("small", small, small_images), ("big", big, images)):
            recipe = write_recipe(work / f"{name}.yaml", source, work / f"out-{name}", pretrained,
                                  layout["shard_bytes"])
            runs[name] = traced_prep(recipe, work, f"prep-{name}")
            if runs[name]["samples_out"] != n:
                raise RuntimeError(f"{name}: {n} inputs, {runs[name]['samples_out']} cached")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    per_sample = (runs["big"]["heap_peak"] - runs["small"]["heap_peak"]) / (big - small)
    inputs = {"inputs_big": big, "inputs_small": small, "image": "64x64 JPEG + sidecar", "model": "tiny-flux",
              "runner": "threads x2", "shard_bytes": "stage defaults scaled to full-size samples per shard",
              "layout": layout}
    return [figure("20. prep traced heap per added sample vs the 200-byte budget", [per_sample], [BUDGET],
                   "B/sample", "<= 1.0", inputs,
                   notes=f"(peak traced heap at {big} - at {small}) / {big - small}, each a CLI prep traced from "
                   "its start; RSS (VmHWM) in the details, for information",
                   details={"big": runs["big"], "small": runs["small"],
                            "rss_ratio": round(runs["big"]["peak_rss_mb"] / runs["small"]["peak_rss_mb"], 3)})]


def main(argv=None) -> None:
    run_benchmark("heap", __doc__, run, argv)


if __name__ == "__main__":
    main()
