"""``make gpu-check``: the whole product on one GPU in under 10 minutes, written to ``gpu-check.json``.

    python -m bench.gpu_check                              # on CUDA (refuses without a GPU)
    python -m bench.gpu_check --dry-run                    # the same phases on the CPU, smallest sizes
    python -m bench.gpu_check --dry-run --device cuda      # the smallest sizes on the GPU (a quick smoke run)

Phases, each in its own child process (``python -m bench.gpu_check --child PHASE ...``), so that a failure,
a CUDA out-of-memory or a hung collective ends that phase only; each child writes its result as JSON:

``doctor``
    ``nvidia-smi`` (CUDA), the torch build check and ``latentmill doctor --device DEVICE --json``, as
    docs/gpu-pods.md runs them; failed when doctor exits 1 (a blocking problem).
``demo``
    The embedded demo (the shipped ``demo`` recipe, prep then train, ``cache.device`` and the trainer on the
    device) through ``latentmill.api``: the prep publishes the snapshot the later phases train on.
``bench``
    ``python -m bench.run --quick --device cuda`` (the dry run: ``--only loader --reps 1``); the figures'
    ratios and any benchmark errors.
``fsdp2``
    A one-rank FSDP2 run (the in-process group of one that ``latentmill.trainer.parallel`` starts) with bf16
    mixed precision on CUDA, ``grad_accum_steps`` 2 and activation checkpointing, on the demo's snapshot.
    What it records comes from the run's last checkpoint (``trainer_state.json``: strategy, checkpoint
    format, world size, the trainer config it ran with), not from this script's overrides.
``lora`` / ``full``
    A few steps in each mode on the demo's snapshot; the export is loaded as a user loads it
    (``FluxPipeline.from_pretrained(pretrained).load_lora_weights(export)``, ``DiffusionPipeline
    .from_pretrained(export)``) and generates one small image on the device.
``sample``
    ``latentmill sample`` on the demo's export, without and with ``--compile`` (inductor; ``aot_eager`` in the
    dry run): the first call apart, then the median of ``--repeat`` calls (``latentmill.timing.steady_state``,
    the rule ``make bench`` uses too), images/s and the compile speed-up.
``cache_repro``
    The cache stage three times in deterministic mode (``cache.deterministic=true``) and three times without
    (twice each in the dry run), each on a fresh copy of the demo's bucket stage: the deterministic runs must
    write the same bytes (failed otherwise); the median of the runs after the first gives the mode's cost.

``cp``
    Context parallelism on two ranks (``parallel.cp_size=2``, FSDP2, launched by torchrun as ``latentmill train
    --nproc 2``) against one process, on the demo's data re-bucketed to multiples of 32 px (so every
    bucket's tokens split in two): the loss of every step must agree (relative 1e-5 on the CPU's float32, 2e-2
    under CUDA's bf16 autocast). On CUDA it runs Ulysses and ring and needs two GPUs (``skipped``, with the
    reason, on one); the CPU dry run runs Ulysses on two gloo ranks. Only here does Diffusers'
    ``enable_parallelism`` itself run (the CPU takes its steps without its device choice:
    ``latentmill.trainer.context``).

``step_copies``
    One training step of the demo recipe (the third of four) under ``torch.profiler``: on CUDA its host-to-device
    copies (the trace's ``Memcpy HtoD`` events) must be no more than the batch's own tensors, as the noise,
    sigmas, position ids and step statistics are made on the device (``latentmill.trainer.train
    .draw_micro_batch``); failed otherwise, listing the copies. The CPU dry run profiles the same step (no copies
    to count there: the CPU tests check that the step's tensors name the batch's device).

``DOC_COMMANDS`` lists the GPU-only commands of docs/gpu-pods.md and the phase that runs each.

Every phase reports ``status`` (``ok`` / ``failed`` / ``skipped``: it cannot run on this machine, and says why), ``seconds``, ``peak_mem_mb`` and, when failed, the
tail of its error. ``peak_mem_mb`` is ``torch.cuda.max_memory_allocated`` on CUDA (the maximum over the
phase's parts: ``train()`` resets the counter when it starts) and the child's peak resident set (``VmHWM``)
on the CPU; the bench phase, whose benchmarks run in processes of their own, reports the device memory in
use above its start (``torch.cuda.mem_get_info``, sampled 5 times a second) on CUDA and its largest
descendant's peak RSS on the CPU. The exit status is 1 when any phase failed, 2 when the check cannot start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_WORK = BENCH_DIR / ".work" / "gpu-check"  # git-ignored; removed at the start of every check
PHASES = ("doctor", "demo", "bench", "fsdp2", "lora", "full", "sample", "cache_repro", "cp", "step_copies")
NEEDS_DEMO = ("fsdp2", "lora", "full", "sample", "cp", "step_copies")  # they use the snapshot (or export) the demo phase made
MARKER = ".gpu-check-work"  # in a work folder this script made: only such a folder (or an empty one) is emptied
PROMPT = "a red circle on a blue background"
ERROR_TAIL = 3000  # characters of a failed phase's error (or log) kept in the JSON

# Sizes: the GPU check runs the demo as `latentmill demo` does (400 steps) and a few dozen steps elsewhere;
# the dry run only proves the same code paths still run end to end.
SIZES: dict[str, dict[str, int]] = {
    "full": {"demo_steps": 400, "steps": 20, "batch": 4, "image": 128, "denoise": 8, "lora_rank": 16,
             "repeat": 5, "cache_repeat": 2},
    "dry": {"demo_steps": 4, "steps": 2, "batch": 2, "image": 64, "denoise": 2, "lora_rank": 4, "repeat": 2,
            "cache_repeat": 1},
}
# `sample --compile`: inductor on the GPU; the dry run traces with dynamo but skips inductor's code generation
# (minutes of C++ compiling on a small CPU), so it proves the same compile path, not its speed.
COMPILE_BACKEND = {"full": "inductor", "dry": "aot_eager"}
TORCH_CHECK = 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'

# The GPU-only commands of docs/gpu-pods.md (marked `# gpu-check` there) and the phase that runs each here;
# tests/test_gpu_pods_doc.py asserts that every such command of the doc is in this plan.
DOC_COMMANDS: dict[str, str] = {
    "nvidia-smi": "doctor",
    "latentmill doctor --device cuda --json $LATENTMILL_VOLUME/doctor.json": "doctor",
    "make demo": "demo",
    'latentmill sample $LATENTMILL_VOLUME/outputs/demo/export --prompt "a red circle on a blue background" '
    "--batch 4 --steps 8 --size 128x128 --repeat 5 --device cuda --max-sequence-length 32 "
    "--out $LATENTMILL_VOLUME/samples/eager": "sample",
    'latentmill sample $LATENTMILL_VOLUME/outputs/demo/export --prompt "a red circle on a blue background" '
    "--batch 4 --steps 8 --size 128x128 --repeat 5 --device cuda --max-sequence-length 32 --compile "
    "--out $LATENTMILL_VOLUME/samples/compiled": "sample",
    "make gpu-check": "all",
}


# ---------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident set in MiB (``VmHWM``, see ``latentmill.trainer.train.peak_rss_mb``)."""
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakMemory:
    """The peak memory of one phase, over parts that may reset CUDA's peak counter (``train()`` does).

    ``mark(part)`` records the peak since the previous mark (CUDA: ``max_memory_allocated``, then a reset;
    CPU: the process's ``VmHWM``, which only grows); ``peak_mb`` is the largest mark.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.parts: dict[str, float] = {}
        if device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()

    def mark(self, part: str) -> float:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            value = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        else:
            value = peak_rss_mb()
        self.parts[part] = round(value, 1)
        return value

    @property
    def peak_mb(self) -> float:
        return max(self.parts.values(), default=0.0)


# ---------------------------------------------------------------------------------------------------------
# The phases (run in the child process)
# ---------------------------------------------------------------------------------------------------------


def _recipe(work: Path, device: str, overrides: list[str]):
    """The shipped demo recipe (its tiny models, built on first use as ``latentmill demo`` builds them),
    writing under ``work``, with ``overrides``."""
    from latentmill.recipe import load_recipe

    return load_recipe("demo", [f"output_dir={work / 'demo'}", f"cache.device={device}", *overrides])


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _train_fields(train: dict[str, Any]) -> dict[str, Any]:
    """What every training phase records from its run summary."""
    return {"steps": train.get("steps"), "steps_this_run": train.get("steps_this_run"),
            "final_loss": train.get("final_loss"), "loss_finite": _finite(train.get("final_loss")),
            "samples_per_s": train.get("samples_per_s"), "train_peak_mem_mb": train.get("peak_mem_mb"),
            "world_size": train.get("world_size"), "run_dir": train.get("run_dir"),
            "export_dir": train.get("export_dir")}


def phase_demo(work: Path, device: str, sizes: dict[str, int], mem: PeakMemory) -> dict[str, Any]:
    """Prep, then train, on the embedded demo (``latentmill demo``'s recipe) on ``device``."""
    from latentmill.pipelines.prep import release_prep_models

    from latentmill import api

    recipe = _recipe(work, device, [f"trainer.max_steps={sizes['demo_steps']}"])
    prepared = api.prep(recipe)
    mem.mark("prep")
    release_prep_models()  # as prep-then-train does: the encoders are done, training gets the GPU whole
    train = api.train(recipe)["train"]
    mem.mark("train")
    stages = {name: {k: s[k] for k in ("in", "out", "quarantined")} for name, s in prepared["stages"].items()}
    return {**_train_fields(train), "stages": stages, "snapshot": prepared["snapshot"]["name"]}


def _bench_command(work: Path, device: str, dry: bool, timeout_s: float) -> list[str]:
    cmd = [sys.executable, "-m", "bench.run", "--quick", "--device", device, "--out", str(work / "bench"),
           "--timeout", str(max(60, int(timeout_s)))]
    return cmd + ["--only", "loader", "--reps", "1"] if dry else cmd


def phase_bench(work: Path, device: str, dry: bool, timeout_s: float, mem: PeakMemory) -> dict[str, Any]:
    """``python -m bench.run --quick`` on the device; its figures' ratios and errors.

    A benchmark error that only says the product code changed while it ran (someone edited the sources
    meanwhile) is kept in ``notes`` and does not fail the phase: the figures are mixed, the code ran.
    """
    cmd = _bench_command(work, device, dry, timeout_s)
    sampler = _DeviceMemorySampler() if device == "cuda" else None
    log_path = work / "logs" / "bench.run.log"
    with open(log_path, "w") as log, (sampler or _Null()):
        done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                              timeout=max(30.0, timeout_s - 15))  # before the parent's own timeout ends us
    if sampler is not None:
        mem.parts["bench"] = round(sampler.peak_mb, 1)
    else:  # the largest descendant's peak RSS (ru_maxrss of the waited-for children)
        mem.parts["bench"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    results_path = work / "bench" / "results.json"
    if not results_path.is_file():
        raise RuntimeError(f"bench.run exited with status {done.returncode} and wrote no results.json:\n"
                           + log_path.read_text()[-ERROR_TAIL:])
    results = json.loads(results_path.read_text())
    changed = [e for e in results["errors"] if "product code changed" in e["error"]]
    errors = [e for e in results["errors"] if e not in changed]
    figures = {f["name"]: {"ratio": f["ratio"], "goal": f["goal"], "meets": f["meets"]} for f in results["figures"]}
    if errors or not figures:
        raise RuntimeError(f"bench.run: {len(figures)} figures, errors {errors} (log: {log_path})")
    return {"command": " ".join(["python", *cmd[1:]]), "returncode": done.returncode, "figures": figures,
            "benchmarks": sorted(results["seconds_per_benchmark"]), "notes": changed,
            "results": str(results_path)}


def phase_fsdp2(work: Path, device: str, sizes: dict[str, int], mem: PeakMemory) -> dict[str, Any]:
    """One-rank FSDP2 (bf16 mixed precision on CUDA), 2 micro-batches a step, activation checkpointing."""
    from latentmill import api

    steps = sizes["steps"]
    recipe = _recipe(work, device, [
        "parallel.strategy=fsdp2", "parallel.mixed_precision=true", "trainer.grad_accum_steps=2",
        "trainer.activation_checkpointing=true", f"trainer.max_steps={steps}", f"trainer.save_every={steps}",
        f"trainer.batch_size={sizes['batch']}", "trainer.drop_last=true"])  # full micro-batches only
    train = api.train(recipe)["train"]
    mem.mark("train")
    run_dir = Path(train["run_dir"])
    # what the run itself recorded: its last checkpoint's trainer state (written by the trainer from the
    # process group it started and the config it trained with)
    from latentmill.trainer.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise RuntimeError(f"the FSDP2 run wrote no checkpoint under {run_dir / 'checkpoints'}")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**_train_fields(train), "strategy": state["strategy"], "checkpoint_format": state["format"],
            "dcp_metadata": (ckpt / "dcp" / ".metadata").is_file(), "checkpoint_world_size": state["world_size"],
            "checkpoint_step": state["step"], "grad_accum_steps": state["config"]["grad_accum_steps"],
            "activation_checkpointing": state["config"]["activation_checkpointing"],
            "batch_size": state["config"]["batch_size"],
            "mixed_precision": recipe.parallel.mixed_precision and device == "cuda",
            "samples_per_step": sorted({round(m["samples_per_s"] * m["step_time_s"]) for m in metrics}),
            "losses_finite": all(_finite(m["loss"]) for m in metrics)}


CP_TOLERANCE = {"cpu": 1e-5, "cuda": 2e-2}  # relative loss difference of cp=2 against one process


def phase_cp(work: Path, device: str, sizes: dict[str, int], mem: PeakMemory) -> dict[str, Any]:
    """cp=2 on two ranks against one process, step by step (see the module docstring)."""
    import torch

    from latentmill import api

    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"context parallelism needs 2 GPUs, {torch.cuda.device_count()} visible: not checked"}
    steps = max(3, sizes["steps"])
    common = ["bucket.step=32", "parallel.strategy=fsdp2", f"trainer.max_steps={steps}", "trainer.save_every=0",
              "trainer.export=false", "trainer.validate_every=0", f"trainer.batch_size={sizes['batch']}",
              "trainer.drop_last=true"]
    api.prep(_recipe(work, device, common))  # new buckets and cache only: the earlier stages are reused
    mem.mark("prep")

    def losses(train: dict[str, Any]) -> list[float]:
        lines = (Path(train["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    one = losses(api.train(_recipe(work, device, common))["train"])
    mem.mark("one process")
    result: dict[str, Any] = {"steps": steps, "one_process": one, "tolerance": CP_TOLERANCE[device]}
    for kind in ("ulysses", "ring") if device == "cuda" else ("ulysses",):
        train = api.train(_recipe(work, device, [*common, "parallel.cp_size=2", f"parallel.cp_kind={kind}"]),
                          nproc=2)["train"]
        two = losses(train)
        diff = max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True))
        result[kind] = {"losses": two, "max_relative_difference": diff, "world_size": train["world_size"],
                        "cp_size": train["cp_size"]}
        if not diff <= CP_TOLERANCE[device]:
            raise RuntimeError(f"cp=2 ({kind}) differs from one process by {diff:.3g} (relative): {two} vs {one}")
    return result


def phase_step_copies(work: Path, device: str, sizes: dict[str, int], mem: PeakMemory) -> dict[str, Any]:
    """The host-to-device copies of one training step, from a profiler trace (see the module docstring)."""
    import torch
    from latentmill.pipelines.launch import train_recipe
    from latentmill.pipelines.snapshot import resolve_snapshot
    from latentmill.trainer.loader import LatentLoader
    from torch.profiler import ProfilerActivity, profile, schedule

    recipe = _recipe(work, device, ["trainer.max_steps=4", "trainer.save_every=0", "trainer.export=false",
                                    "trainer.validate_every=0", f"trainer.batch_size={sizes['batch']}",
                                    "trainer.drop_last=true"])
    with LatentLoader(resolve_snapshot(recipe.output_dir, recipe.snapshot), sizes["batch"], recipe.seed,
                      drop_last=True) as loader:
        batch = next(iter(loader))
    own = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]  # what forward_backward moves
    trace = work / "step-copies-trace.json"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])]
    # the profiler's steps follow the training steps (on_step): step 1 waits, step 2 warms up, step 3 is recorded
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=1, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof:
        train = train_recipe(recipe, work / "step-copies-run", progress=False, on_step=lambda record: prof.step())
    mem.mark("train")
    events = json.loads(trace.read_text())["traceEvents"]
    copies = [{"name": e["name"], "bytes": (e.get("args") or {}).get("bytes")} for e in events
              if "Memcpy HtoD" in e.get("name", "")]
    result = {**_train_fields(train), "batch_tensors": own, "htod_copies": len(copies),
              "htod_bytes": sum(c["bytes"] or 0 for c in copies), "trace": str(trace)}
    if len(copies) > len(own):
        raise RuntimeError(f"one training step made {len(copies)} host-to-device copies, its batch has {len(own)} "
                           f"tensors ({own}): {copies}")
    return result


def _generate(pipe: Any, device: str, sizes: dict[str, int]) -> dict[str, Any]:
    """One image of ``sizes['image']`` pixels square from ``pipe`` on ``device``; its shape and whether every
    pixel is finite (``output_type="np"``: floats in [0, 1], NaN survives the clamp)."""
    import numpy as np
    import torch

    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    size = sizes["image"]
    out = pipe(PROMPT, height=size, width=size, num_inference_steps=sizes["denoise"], max_sequence_length=32,
               generator=torch.Generator(device=device).manual_seed(0), output_type="np").images
    image = np.asarray(out, dtype=np.float32)
    return {"image_shape": list(image.shape), "pixels_finite": bool(np.isfinite(image).all()),
            "pixel_mean": round(float(image.mean()), 4), "pipeline": type(pipe).__name__,
            "pipeline_device": str(pipe.transformer.device), "pipeline_dtype": str(pipe.transformer.dtype)}


def _pipeline_dtype(device: str):
    import torch

    return torch.bfloat16 if device == "cuda" else torch.float32


def phase_lora(work: Path, device: str, sizes: dict[str, int], mem: PeakMemory) -> dict[str, Any]:
    """A LoRA run; its adapter loaded into the base pipeline (``load_lora_weights``) generates an image."""
    from diffusers import FluxPipeline

    from latentmill import api

    recipe = _recipe(work, device, ["trainer.mode=lora", f"trainer.lora_rank={sizes['lora_rank']}",
                                    f"trainer.max_steps={sizes['steps']}", "trainer.save_every=0",
                                    f"trainer.batch_size={sizes['batch']}"])
    train = api.train(recipe)["train"]
    mem.mark("train")
    pipe = FluxPipeline.from_pretrained(recipe.model.pretrained, torch_dtype=_pipeline_dtype(device))
    pipe.load_lora_weights(train["export_dir"])
    adapters = pipe.get_list_adapters().get("transformer", [])
    result = _generate(pipe, device, sizes)
    mem.mark("generate")
    return {**_train_fields(train), "mode": train.get("mode"), "lora_adapters": adapters, **result}


def phase_full(work: Path, device: str, sizes: dict[str, int], mem: PeakMemory) -> dict[str, Any]:
    """A full fine-tune; its exported pipeline (``DiffusionPipeline.from_pretrained``) generates an image."""
    from diffusers import DiffusionPipeline

    from latentmill import api

    # not the demo phase's recipe (another step count): a run of its own, not "already trained"
    recipe = _recipe(work, device, ["trainer.mode=full", f"trainer.max_steps={sizes['steps'] + 1}",
                                    "trainer.save_every=0", f"trainer.batch_size={sizes['batch']}"])
    train = api.train(recipe)["train"]
    mem.mark("train")
    pipe = DiffusionPipeline.from_pretrained(train["export_dir"], torch_dtype=_pipeline_dtype(device))
    result = _generate(pipe, device, sizes)
    mem.mark("generate")
    return {**_train_fields(train), "mode": train.get("mode"), **result}


def _latentmill() -> list[str]:
    """The ``latentmill`` command of this interpreter (``python -m latentmill.cli``: the console script's code)."""
    return [sys.executable, "-m", "latentmill.cli"]


def _run_logged(cmd: list[str], work: Path, name: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository (before the parent's own timeout ends us); its output also goes to
    ``logs/<name>.log``."""
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=max(30.0, timeout_s - 15))
    (work / "logs" / f"{name}.log").write_text(done.stdout + done.stderr)
    return done


def _subprocess_memory(device: str, mem: PeakMemory, part: str, sampler: _DeviceMemorySampler | None) -> None:
    """A phase whose work runs in commands of its own: the device memory they used (CUDA), or the largest
    one's peak RSS (CPU), as the bench phase reports it."""
    if sampler is not None:
        mem.parts[part] = round(sampler.peak_mb, 1)
    else:
        mem.parts[part] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)


def phase_doctor(work: Path, device: str, timeout_s: float, mem: PeakMemory) -> dict[str, Any]:
    """``nvidia-smi`` (CUDA), the torch build check and ``latentmill doctor --device DEVICE --json``, as
    docs/gpu-pods.md runs them. Fails when doctor finds a blocking problem (exit 1)."""
    out: dict[str, Any] = {}
    sampler = _DeviceMemorySampler() if device == "cuda" else None
    with sampler or _Null():
        if device == "cuda":
            smi = _run_logged(["nvidia-smi"], work, "nvidia-smi", timeout_s)
            out["nvidia_smi"] = {"returncode": smi.returncode, "head": smi.stdout.splitlines()[:12]}
        torch_check = _run_logged([sys.executable, "-c", TORCH_CHECK], work, "torch-check", timeout_s)
        out["torch_check"] = torch_check.stdout.strip()
        json_path = work / "doctor.json"
        cmd = [*_latentmill(), "doctor", "--device", device, "--json", str(json_path)]
        done = _run_logged(cmd, work, "doctor", timeout_s)
    _subprocess_memory(device, mem, "doctor", sampler)
    if not json_path.is_file():
        raise RuntimeError(f"latentmill doctor exited {done.returncode} without {json_path}:\n"
                           + (done.stdout + done.stderr)[-ERROR_TAIL:])
    report = json.loads(json_path.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    if done.returncode == 1:
        raise RuntimeError("latentmill doctor found a blocking problem:\n" + done.stdout[-ERROR_TAIL:])
    return {**out, "command": " ".join(["latentmill", *cmd[3:]]), "exit_code": done.returncode,
            "statuses": statuses, "warnings": [c["message"] for c in report["checks"] if c["status"] == "warning"]}


def phase_sample(work: Path, device: str, sizes: dict[str, int], dry: bool, timeout_s: float,
                 mem: PeakMemory) -> dict[str, Any]:
    """``latentmill sample`` on the demo phase's export, without and with ``--compile``: the first call and
    the steady state (median of ``--repeat`` later calls, ``latentmill.timing.steady_state``) of each."""
    demo = json.loads((work / "results" / "demo.json").read_text())
    export = demo["export_dir"]
    size = f"{sizes['image']}x{sizes['image']}"
    runs: dict[str, Any] = {}
    sampler = _DeviceMemorySampler() if device == "cuda" else None
    with sampler or _Null():
        backend = ["--compile-backend", COMPILE_BACKEND["dry"]] if dry else []  # inductor: the default
        for name, extra in (("eager", []), ("compiled", ["--compile", *backend])):
            out_dir = work / "samples" / name
            # the commands of docs/gpu-pods.md (DOC_COMMANDS), on this check's export, sizes and device
            cmd = [*_latentmill(), "sample", export, "--prompt", PROMPT, "--batch", str(sizes["batch"]),
                   "--steps", str(sizes["denoise"]), "--size", size, "--repeat", str(sizes["repeat"]),
                   "--device", device, "--max-sequence-length", "32", *extra, "--out", str(out_dir)]
            done = _run_logged(cmd, work, f"sample-{name}", timeout_s)
            timing = out_dir / "timing.json"
            if done.returncode != 0 or not timing.is_file():
                raise RuntimeError(f"latentmill sample ({name}) exited {done.returncode}:\n"
                                   + (done.stdout + done.stderr)[-ERROR_TAIL:])
            t = json.loads(timing.read_text())
            runs[name] = {k: t.get(k) for k in ("first_call_s", "median_s", "iqr_s", "repeats", "images_per_s",
                                                "s_per_step", "compile", "compiled", "compile_s", "device",
                                                "batch", "steps", "size")}
            runs[name]["command"] = " ".join(["latentmill", *cmd[3:]])
            runs[name]["images"] = len(t.get("images") or [])
    _subprocess_memory(device, mem, "sample", sampler)
    eager, compiled = runs["eager"]["images_per_s"], runs["compiled"]["images_per_s"]
    return {**runs, "export": export, "compile_speedup": round(compiled / eager, 3) if eager and compiled else None}


def _cache_only(base: Path, target: Path, device: str, deterministic: bool) -> dict[str, str]:
    """The cache stage alone on a copy of ``base``'s bucket stage, in ``target``; shard name -> sha256."""
    from latentmill.pipelines.prep import manifest_header, plan_stage, stage_processor
    from latentmill.stages.shardio import StageDir

    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(base / "prep" / "bucket", target / "prep" / "bucket")
    recipe = _recipe(target.parent, device, [f"cache.deterministic={str(deterministic).lower()}"])
    recipe.output_dir = str(target)
    stage_dir = StageDir(recipe.stage_dir("cache"), "cache").ensure()
    process = stage_processor("cache", recipe)
    records = [stage_dir.run_unit(u, process) for u in plan_stage("cache", recipe)]
    manifest = stage_dir.write_manifest(records, manifest_header("cache", recipe))
    return {shard["name"]: shard["sha256"] for shard in manifest["shards"]}


def phase_cache_repro(work: Path, device: str, sizes: dict[str, int], mem: PeakMemory) -> dict[str, Any]:
    """The cache stage run 1 + ``cache_repeat`` times in deterministic mode and as often without, each on a
    fresh copy of the demo's bucket stage, on one device: the deterministic runs must write the same bytes.
    Timed with ``latentmill.timing.steady_state`` (the first run, which loads the encoders, apart; the median
    of the others), so the figure is the deterministic mode's cost on this device."""
    import torch
    from latentmill.pipelines.prep import STAGES, ensure_models, manifest_header, plan_stage, stage_processor
    from latentmill.stages.families import device_description, encoded_on_key
    from latentmill.stages.shardio import StageDir

    from latentmill.timing import steady_state

    base = work / "cache-repro" / "base"
    recipe = _recipe(work / "cache-repro", device, [])
    recipe.output_dir = str(base)
    ensure_models(recipe)
    for stage in STAGES[:-1]:  # ingest, caption, bucket: once
        stage_dir = StageDir(recipe.stage_dir(stage), stage).ensure()
        records = [stage_dir.run_unit(u, stage_processor(stage, recipe)) for u in plan_stage(stage, recipe)]
        bucketed = stage_dir.write_manifest(records, manifest_header(stage, recipe))["counts"]["out"]
    sync = torch.cuda.synchronize if device == "cuda" else None
    runs: dict[str, Any] = {}
    for mode, deterministic in (("deterministic", True), ("default", False)):
        stats = steady_state(lambda i, d=deterministic, m=mode: _cache_only(base, work / "cache-repro" / f"{m}-{i}",
                                                                           device, d),
                             sizes["cache_repeat"], sync=sync)
        runs[mode] = {**stats.to_json(), "distinct_outputs": len({json.dumps(r, sort_keys=True) for r in stats.results}),
                      "shards": stats.results[0]}
    mem.mark("cache")
    det, default = runs["deterministic"], runs["default"]
    if det["distinct_outputs"] != 1:
        raise RuntimeError(f"the deterministic cache runs wrote different bytes: {det}")
    described = device_description(torch.device(device))
    return {"runs": runs, "bytes_equal": det["distinct_outputs"] == 1,
            "default_bytes_equal": default["distinct_outputs"] == 1,
            "deterministic_vs_default_equal": det["shards"] == default["shards"],
            "deterministic_cost": round(det["median_s"] / default["median_s"], 3) if default["median_s"] else None,
            "encoded_on": encoded_on_key(described), "samples_in": bucketed}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _DeviceMemorySampler:
    """Device memory in use (``torch.cuda.mem_get_info``) above its value at start, sampled 5 times a second
    in a thread: the bench phase's benchmarks are processes of their own, out of reach of the allocator."""

    def __init__(self, interval_s: float = 0.2) -> None:
        import torch

        self._torch, self.interval_s, self.peak_mb = torch, interval_s, 0.0
        self._base = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> float:
        free, total = self._torch.cuda.mem_get_info()
        return (total - free) / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, self._used() - self._base)

    def __enter__(self) -> _DeviceMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_child(phase: str, work: Path, device: str, dry: bool, timeout_s: float, result_path: Path) -> int:
    """Run one phase in this process and write its result to ``result_path``; 0 when it passed."""
    sizes = SIZES["dry" if dry else "full"]
    mem = PeakMemory(device)
    result: dict[str, Any]
    try:
        if phase == "bench":
            result = phase_bench(work, device, dry, timeout_s, mem)
        else:
            from latentmill.prefect_env import start_ephemeral_api

            start_ephemeral_api()  # when the parent gave no PREFECT_API_URL: a server that dies with us
            if phase == "doctor":
                result = phase_doctor(work, device, timeout_s, mem)
            elif phase == "sample":
                result = phase_sample(work, device, sizes, dry, timeout_s, mem)
            else:
                fn: Callable[..., dict[str, Any]] = {"demo": phase_demo, "fsdp2": phase_fsdp2, "lora": phase_lora,
                                                     "full": phase_full, "cache_repro": phase_cache_repro,
                                                     "cp": phase_cp, "step_copies": phase_step_copies}[phase]
                result = fn(work, device, sizes, mem)
        result["status"] = "skipped" if "skipped" in result else "ok"
    except BaseException as err:  # an OOM or any failure: reported, the check goes on with the next phase
        result = {"status": "failed", "error": "".join(traceback.format_exception(err))[-ERROR_TAIL:]}
    if phase not in ("bench", "doctor", "sample"):  # those report what their commands used
        mem.mark("end")
    result.update(peak_mem_mb=round(mem.peak_mb, 1), peak_mem_parts_mb=mem.parts, peak_rss_mb=round(peak_rss_mb(), 1))
    result_path.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["status"] != "failed" else 1


# ---------------------------------------------------------------------------------------------------------
# The parent: one child per phase, then gpu-check.json
# ---------------------------------------------------------------------------------------------------------


def child_env(work: Path, device: str, api_url: str | None) -> dict[str, str]:
    """The children's environment: the CPU run hides GPUs (so every automatic device choice lands on the
    CPU), a Prefect home and weight-digest store inside the work folder, offline Hugging Face."""
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PREFECT_HOME"] = str(work / "prefect-home")
    env["LATENTMILL_HASH_STORE"] = str(work / "weight-hashes.sqlite")
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_phase(phase: str, work: Path, device: str, dry: bool, timeout_s: float, env: dict[str, str]) -> dict:
    """Run ``phase`` in a child process (its own session: a timeout ends its whole process tree)."""
    result_path, log_path = work / "results" / f"{phase}.json", work / "logs" / f"{phase}.log"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--child", phase, "--work", str(work), "--device", device,
           "--timeout-s", str(timeout_s), "--child-result", str(result_path), *(["--dry-run"] if dry else [])]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    seconds = round(time.perf_counter() - start, 1)
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    else:
        why = (f"timed out after {timeout_s:g} s" if returncode is None
               else f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}")
        result = {"status": "failed", "error": f"{why}, no result; log tail:\n"
                  + log_path.read_text(errors="replace")[-ERROR_TAIL:], "peak_mem_mb": None}
    if returncode not in (0, None) and result.get("status") != "failed":  # it said ok, then died on the way out
        result = {**result, "status": "failed", "error": f"exit status {returncode} after reporting ok"}
    return {"status": result.pop("status"), "seconds": seconds, **result, "returncode": returncode,
            "log": str(log_path)}


def environment(device: str) -> dict[str, Any]:
    import torch
    from latentmill.stages.families import device_description

    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "cpu_count": os.cpu_count(), "cuda": None,
                            "device_class": device_description(torch.device(device))["class"]}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["cuda"] = {"version": torch.version.cuda, "gpu": props.name, "gpu_count": torch.cuda.device_count(),
                        "memory_mb": round(props.total_memory / 2**20), "bf16": torch.cuda.is_bf16_supported()}
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="where the phases run (default: cuda; cpu with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="smallest sizes (the same phases and code paths)")
    p.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="the JSON report (default gpu-check.json)")
    p.add_argument("--timeout-s", type=float, default=360.0, help="seconds allowed per phase (default 360)")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"scratch folder, emptied first ({DEFAULT_WORK})")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="run only these phases (fsdp2, lora and full train on the demo phase's snapshot)")
    p.add_argument("--child", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = args.device or ("cpu" if args.dry_run else "cuda")
    work = args.work.resolve()
    if args.child:
        return run_child(args.child, work, device, args.dry_run, args.timeout_s, args.child_result)

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: --device cuda, but torch.cuda.is_available() is False (torch {torch.__version__}, "
              f"CUDA build: {torch.version.cuda or 'none'}); install a CUDA build of torch into .venv on a GPU "
              "machine, or run the CPU dry run: python -m bench.gpu_check --dry-run", file=sys.stderr)
        return 2
    if work.is_dir() and any(work.iterdir()) and not (work / MARKER).is_file():
        print(f"gpu-check: --work {work} is a folder this check did not make (no {MARKER} in it); it empties its "
              "work folder first, so name a new or empty one", file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("logs", "results"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("made by python -m bench.gpu_check; emptied at the start of every check\n")
    env = child_env(work, device, None)
    # one Prefect API server for every phase (each child would otherwise start its own), ended with us
    os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_ANALYTICS_ENABLED",
                                           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")})
    os.environ.pop("PREFECT_API_URL", None)
    from latentmill.prefect_env import start_ephemeral_api

    env = child_env(work, device, start_ephemeral_api())
    report: dict[str, Any] = {"device": device, "dry_run": args.dry_run, **environment(device),
                              "command": " ".join(["python -m bench.gpu_check", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "work": str(work),
                              "phases": {}}
    start = time.perf_counter()
    for phase in args.phases:
        if phase in NEEDS_DEMO and report["phases"].get("demo", {}).get("status") == "failed":
            report["phases"][phase] = {"status": "failed", "seconds": 0.0, "peak_mem_mb": None,
                                       "error": "not run: the demo phase failed (this phase trains on its snapshot)"}
        else:
            print(f"[gpu-check] {phase} ...", file=sys.stderr, flush=True)
            report["phases"][phase] = run_phase(phase, work, device, args.dry_run, args.timeout_s, env)
        r = report["phases"][phase]
        print(f"[gpu-check] {phase}: {r['status']} in {r['seconds']} s, peak {r.get('peak_mem_mb')} MiB",
              file=sys.stderr, flush=True)
        if r["status"] == "failed":
            print(r.get("error", "")[-1500:], file=sys.stderr, flush=True)
        elif r["status"] == "skipped":
            print(f"[gpu-check] {phase} skipped: {r['skipped']}", file=sys.stderr, flush=True)
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["ok"] = all(r["status"] != "failed" for r in report["phases"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"[gpu-check] {'ok' if report['ok'] else 'FAILED'} in {report['seconds']} s; wrote {args.out}",
          file=sys.stderr, flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
