"""Prep at scale (issue 17): per-sample wall time and peak RSS at 10x the inputs, and a 1% refresh as a user
runs it.

Figures (ours: the large run; baseline: the small one, or the full prep):

1. prep wall time per sample at ``N`` inputs vs ``N / 10`` (100,000 vs 10,000; ``--quick`` 20,000 vs 2,000):
   the summed ``seconds`` of the four stages in the run summary, per input sample (process start-up, a
   constant, is left out here; figure 3 has it). Goal <= 1.1 (cost grows linearly).
2. peak RSS (VmHWM, which ``execve`` resets) of the ``latentmill prep`` process and of a loader process
   (``LatentLoader(cache, 64, seed=0, dtype=bfloat16)``, one whole epoch read) at ``N`` vs ``N / 10``.
   Goal <= 1.2 each. The prep's peak is the high-water mark of one moment of the cache stage, and the
   ``N / 10`` prep's moved by 30-60 MiB between runs of one commit (768-830 MiB, against a ~150 MiB
   difference between the sizes), so the small prep runs ``SMALL_REPS`` times, each into a fresh output
   folder, and the figure's ratio is the large peak over the median small one (its range over each small
   run is in the figure). The large prep runs once (~4 minutes).
3. a refresh that adds 1% new inputs to the ``N`` prepared inputs vs the full prep of those ``N``: wall time
   of ``latentmill prep RECIPE`` in a fresh process, as a user runs it (imports, Prefect's temporary API,
   listing and planning every input, the new samples' work, the snapshot). Goal <= 0.03.
4. what a reused sample costs a refresh: the same new inputs added to the ``N`` and to the ``N / 10``
   prepared inputs, the difference of the two refreshes' summed stage seconds per sample between them.
   Goal <= 50 µs (a figure against that budget). ``REFRESH_ROUNDS`` rounds, each adding another 1% to both
   (the two refreshes of a round run back to back, their order alternating): the figure is the median
   round, its range over the rounds. Beside it, the same difference in CPU seconds (user + system) of the
   whole ``latentmill prep`` process and its children: on a shared machine, whose other jobs stretch wall
   time but hardly CPU time, that row is the one to read.

How, and what is real: every prep is the real CLI (``latentmill.cli.main``, the console script's entry
point, run in a child Python process that writes its VmHWM on exit), on the real Prefect flow with the
thread runner (2 workers). What is small on purpose is the work per sample, so that overhead is what is
measured: 64x64 noise JPEGs (~3 KB) with sidecar captions, one bucket (64x64, aspect 1.0), the tiny Flux model
set (``data/tiny-flux.yaml``) with 16 T5 tokens, cache batch 64, bf16. ``LATENTMILL_SCALE_SIZES=N,M``
overrides the sizes (a run that fits the time at hand; the figure's inputs say what ran).

Shards hold as many samples as at full size. With the stage defaults (256 MiB raw shards, 1 GiB cache
shards) a 3 KB sample would put all 100,000 samples in one unit per stage, a layout no real dataset has (one
unit's bookkeeping then holds every sample). So every byte target is the default scaled by our bytes per
sample over the real ones (the sizes of ``bench/files.py``: a 100 KB image and a 1 KB json in the raw
stages, a ~762 KB Flux-512 cached sample): each stage's shards hold the samples they hold at full size
(~2,600 raw, ~1,400 cached). Our bytes per sample are measured, not guessed: a calibration prep of
``CALIBRATION`` images with the defaults, its shard bytes per sample in each stage.

Run alone: ``python -m bench.scale --quick``.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, TINY_RECIPE, figure, fresh_dir, log, model_dir, run_benchmark, setup_env

setup_env()

IMAGE_SIDE = 64
TOKENS = 16
CACHE_BATCH = 64
LOADER_BATCH = 64
REFRESH_FRACTION = 100  # 1 new input per 100
REFRESH_ROUNDS = 3  # refreshes of each size for figure 4 (see the docstring)
CALIBRATION = 512  # images in the prep that measures our bytes per sample in each stage
REUSED_BUDGET_US = 50  # stage time per reused sample of a refresh (issue 31)
SMALL_REPS = 3  # preps of the N / 10 inputs whose median peak RSS is the baseline (see the docstring)
RAW_STAGES = ("ingest", "caption", "curate", "bucket")

# The child that runs the CLI: its VmHWM (peak RSS since exec) written to argv[1] at exit.
_CLI_CHILD = """
import atexit, sys
def _peak():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            open(sys.argv[1], 'w').write(str(int(line.split()[1]) / 1024))
atexit.register(_peak)
from latentmill.cli import main
sys.exit(main(sys.argv[2:]))
"""

_LOADER_CHILD = """
import json, sys, time
import torch
from latentmill.trainer.loader import LatentLoader
start = time.perf_counter()
count = 0
with LatentLoader(sys.argv[1], int(sys.argv[2]), seed=0, dtype=torch.bfloat16) as loader:
    it = iter(loader)
    for _ in range(len(loader)):
        count += len(next(it)["keys"])
    it.close()
seconds = time.perf_counter() - start
peak = next(int(l.split()[1]) / 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))
print(json.dumps({"samples": count, "seconds": seconds, "peak_rss_mb": peak}))
"""


def make_images(folder: Path, start: int, count: int) -> None:
    """``count`` 64x64 noise JPEGs ``img<i>.jpg`` (i from ``start``) with a sidecar caption each; image ``i``
    depends only on ``i``."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        rng = np.random.default_rng(i)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)).save(
            buf, format="JPEG", quality=80)
        (folder / f"img{i:07d}.jpg").write_bytes(buf.getvalue())
        (folder / f"img{i:07d}.txt").write_text(f"a photo number {i} of a small noisy thing\n")


def write_recipe(path: Path, source: Path, output_dir: Path, pretrained: Path,
                 shard_bytes: dict[str, int] | None = None, runner: str = "threads") -> Path:
    """The bench recipe; ``shard_bytes`` (stage -> bytes) sets each stage's ``shard_bytes``; ``runner``: the
    ``runner.kind`` (2 workers)."""
    import yaml

    stages: dict[str, dict[str, Any]] = {
        "ingest": {"source": str(source)},
        "caption": {"captioner": "sidecar"},
        "curate": {},
        "bucket": {"resolution": IMAGE_SIDE, "aspect_ratios": [1.0]},
        "cache": {"dtype": "bfloat16", "batch_size": CACHE_BATCH, "max_sequence_length": TOKENS},
    }
    for stage, value in (shard_bytes or {}).items():
        stages[stage]["shard_bytes"] = int(value)
    path.write_text(yaml.safe_dump({
        "output_dir": str(output_dir), "seed": 0, "model": {"pretrained": str(pretrained)},
        "runner": {"kind": runner, "workers": 2}, **stages}))
    return path


def real_samples_per_shard() -> dict[str, int]:
    """Samples per shard at full size with the stage defaults: the default byte target over the real tar
    bytes of a sample (``bench/files.py``'s sizes)."""
    from latentmill.stages.cache import CacheConfig, sample_bytes_estimate
    from latentmill.stages.ingest import DEFAULT_SHARD_BYTES as RAW_DEFAULT
    from latentmill.stages.shardio import DEFAULT_SHARD_BYTES as CACHE_DEFAULT

    from bench.common import FLUX_512
    from bench.files import IMAGE_BYTES, JSON_BYTES, tar_bytes
    from latentmill.models import ModelConfig

    raw = RAW_DEFAULT // tar_bytes([IMAGE_BYTES, JSON_BYTES])
    # the Flux VAE's defaults (no model folder: 16 latent channels, 8x down), as bench/files.py
    cached = sample_bytes_estimate(CacheConfig(dtype="bfloat16", max_sequence_length=FLUX_512["text_len"]),
                                   ModelConfig(pretrained="/nonexistent/flux"), "flux")(FLUX_512["bucket"])
    return {**{stage: raw for stage in RAW_STAGES}, "cache": CACHE_DEFAULT // cached}


def calibrate(work: Path, images: Path, pretrained: Path) -> dict[str, Any]:
    """Our shard bytes per sample in each stage (a prep of the first ``CALIBRATION`` images with the
    defaults), and the byte targets that give each stage's shards their full-size sample counts."""
    source = work / "images-calibration"
    source.mkdir()
    for i in range(CALIBRATION):
        for ext in (".jpg", ".txt"):
            os.link(images / f"img{i:07d}{ext}", source / f"img{i:07d}{ext}")
    out = work / "out-calibration"
    cli_prep(write_recipe(work / "calibration.yaml", source, out, pretrained), work, "prep-calibration")
    per_shard = real_samples_per_shard()
    ours, targets = {}, {}
    for stage, count in per_shard.items():
        shards = list((out / "prep" / stage / "shards").glob("*.tar"))
        ours[stage] = sum(p.stat().st_size for p in shards) / CALIBRATION
        targets[stage] = max(1, int(ours[stage] * count))
    shutil.rmtree(out, ignore_errors=True)
    result = {"bytes_per_sample": {k: round(v, 1) for k, v in ours.items()}, "samples_per_shard": per_shard,
              "shard_bytes": targets}
    log(f"calibration: {result}")
    return result


def cli_prep(recipe: Path, work: Path, tag: str) -> dict[str, Any]:
    """``latentmill prep RECIPE --summary-json`` in a fresh process: wall time, run summary, VmHWM."""
    peak_file, summary_file, log_file = (work / f"{tag}.{ext}" for ext in ("peak", "summary.json", "log"))
    cmd = [sys.executable, "-c", _CLI_CHILD, str(peak_file), "prep", str(recipe), "--summary-json", str(summary_file)]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(log_file, "wb") as fh:
        done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # the process and its children
    if done.returncode != 0:
        raise RuntimeError(f"latentmill prep failed ({done.returncode}); see {log_file}")
    summary = json.loads(summary_file.read_text())
    stages = summary["stages"]
    result = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": round(float(peak_file.read_text()), 1),
              "stage_seconds": {k: v["seconds"] for k, v in stages.items()},
              "stage_processed": {k: v["processed"] for k, v in stages.items()},
              "samples_out": stages["cache"]["out"]}
    result["stages_s"] = round(sum(result["stage_seconds"].values()), 2)
    log(f"{tag}: {result}")
    return result


def loader_epoch(cache_dir: Path) -> dict[str, Any]:
    """One epoch of ``LatentLoader`` over the cache in a fresh process: samples, seconds, VmHWM."""
    done = subprocess.run([sys.executable, "-c", _LOADER_CHILD, str(cache_dir), str(LOADER_BATCH)], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, check=True)
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    log(f"loader {cache_dir}: {result}")
    return result


def sizes(args) -> tuple[int, int]:
    override = os.environ.get("LATENTMILL_SCALE_SIZES")
    if override:
        big, small = (int(x) for x in override.split(","))
        return big, small
    return (20_000, 2_000) if args.quick else (100_000, 10_000)


def make_inputs(work: Path, big: int, small: int) -> tuple[Path, Path]:
    """``big`` images in ``work/images`` and the first ``small`` of them, hard-linked, in ``work/images-small``."""
    t0 = time.perf_counter()
    images, small_images = work / "images", work / "images-small"
    make_images(images, 0, big)
    small_images.mkdir()
    for i in range(small):
        for ext in (".jpg", ".txt"):
            os.link(images / f"img{i:07d}{ext}", small_images / f"img{i:07d}{ext}")
    log(f"generated {big} images in {time.perf_counter() - t0:.0f} s")
    return images, small_images


def run(args) -> list:
    big, small = sizes(args)
    pretrained = model_dir(TINY_RECIPE)
    work = fresh_dir("scale")
    images, small_images = make_inputs(work, big, small)
    try:
        layout = calibrate(work, images, pretrained)
        runs = {}
        for name, n, source in (("small", small, small_images), ("big", big, images)):
            recipe = write_recipe(work / f"{name}.yaml", source, work / f"out-{name}", pretrained,
                                  layout["shard_bytes"])
            runs[name] = cli_prep(recipe, work, f"prep-{name}")
            runs[name]["shards"] = {stage: len(list((work / f"out-{name}" / "prep" / stage / "shards").glob("*.tar")))
                                    for stage in (*RAW_STAGES, "cache")}
            runs[name]["loader"] = loader_epoch(work / f"out-{name}" / "prep" / "cache")
            if runs[name]["samples_out"] != n or runs[name]["loader"]["samples"] != n:
                raise RuntimeError(f"{name}: {n} inputs, {runs[name]['samples_out']} cached, "
                                   f"{runs[name]['loader']['samples']} loaded")
            if name == "small":  # the peak RSS baseline's other runs, each a fresh prep of the same inputs
                peaks = [runs[name]["peak_rss_mb"]]
                for rep in range(1, SMALL_REPS):
                    again = work / f"out-{name}-{rep}"
                    peaks.append(cli_prep(write_recipe(work / f"{name}-{rep}.yaml", source, again, pretrained,
                                                       layout["shard_bytes"]), work, f"prep-{name}-{rep}")["peak_rss_mb"])
                    shutil.rmtree(again, ignore_errors=True)
                runs[name]["peak_rss_mb_runs"] = peaks
        new = big // REFRESH_FRACTION
        rounds = []
        for r in range(REFRESH_ROUNDS):
            first = big + r * new
            make_images(images, first, new)
            for i in range(first, first + new):  # the same new inputs, added to the small prep
                for ext in (".jpg", ".txt"):
                    os.link(images / f"img{i:07d}{ext}", small_images / f"img{i:07d}{ext}")
            order = ("big", "small") if r % 2 == 0 else ("small", "big")
            done = {name: cli_prep(work / f"{name}.yaml", work, f"refresh-{name}-{r}") for name in order}
            for result in done.values():
                if result["stage_processed"]["cache"] != new:
                    raise RuntimeError(f"refresh processed {result['stage_processed']['cache']} samples, not {new}")
            rounds.append(done)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    inputs = {"inputs_big": big, "inputs_small": small, "image": f"{IMAGE_SIDE}x{IMAGE_SIDE} JPEG + sidecar",
              "model": "tiny-flux", "max_sequence_length": TOKENS, "cache_batch": CACHE_BATCH,
              "runner": "threads x2", "refresh_new": big // REFRESH_FRACTION,
              "shard_bytes": "stage defaults scaled to full-size samples per shard", "layout": layout,
              "shards": {name: r["shards"] for name, r in runs.items()}}
    b, s = runs["big"], runs["small"]
    refresh = rounds[0]["big"]
    reused_us = [(d["big"]["stages_s"] - d["small"]["stages_s"]) / (big - small) * 1e6 for d in rounds]
    reused_cpu_us = [(d["big"]["cpu_s"] - d["small"]["cpu_s"]) / (big - small) * 1e6 for d in rounds]
    per_big, per_small = b["stages_s"] / big * 1000, s["stages_s"] / small * 1000
    return [
        figure("15. prep time per sample, 10x the inputs", [per_big], [per_small], "ms/sample", "<= 1.1", inputs,
               notes=f"summed stage seconds per sample at {big} vs {small} inputs (CLI prep, start-up excluded)",
               details={"big": b, "small": s, "wall_per_sample_ms": {
                   "big": round(b["wall_s"] / big * 1000, 3), "small": round(s["wall_s"] / small * 1000, 3)}}),
        figure("15. prep peak RSS, 10x the inputs", [b["peak_rss_mb"]], s["peak_rss_mb_runs"], "MiB", "<= 1.2", inputs,
               notes=f"VmHWM of the latentmill prep process: one prep of {big} inputs against the median of "
               f"{len(s['peak_rss_mb_runs'])} preps of {small} (the range: against each of them)",
               ratios=[b["peak_rss_mb"] / p for p in s["peak_rss_mb_runs"]]),  # median: over the median small
        figure("15. loader peak RSS, 10x the samples", [b["loader"]["peak_rss_mb"]], [s["loader"]["peak_rss_mb"]], "MiB",
               "<= 1.2", inputs, notes="VmHWM of a process that reads one epoch with LatentLoader (batch 64)",
               details={"big": b["loader"], "small": s["loader"]}),
        figure("15. refresh with 1% new inputs vs full prep (CLI wall)", [refresh["wall_s"]], [b["wall_s"]], "s",
               "<= 0.03", inputs, notes=f"latentmill prep wall time, {big // REFRESH_FRACTION} new inputs added to "
               f"{big} prepared, vs the full prep of the {big}", details={"refresh": refresh, "full": b}),
        figure("15. refresh: stage time per reused sample vs the 50 µs budget", reused_us,
               [REUSED_BUDGET_US] * len(reused_us), "µs/sample", "<= 1.0", inputs,
               notes=f"(summed stage seconds of a refresh adding the same {new} new inputs to {big} prepared - to "
               f"{small} prepared) / {big - small}; {len(rounds)} rounds, each adding {new} more",
               details={"rounds": rounds}),
        figure("15. refresh: CPU time per reused sample (whole CLI process) vs the 50 µs budget", reused_cpu_us,
               [REUSED_BUDGET_US] * len(reused_cpu_us), "µs/sample", "<= 1.0", inputs,
               notes=f"(CPU seconds, user + system, of the latentmill prep process and its children: the refresh of "
               f"{big} prepared - of {small} prepared) / {big - small}; the rounds of the row above"),
    ]


def main(argv=None) -> None:
    run_benchmark("scale", __doc__, run, argv)


if __name__ == "__main__":
    main()
