"""`make gpu-check` (bench/gpu_check.py): its CPU dry run runs every phase here, so the check does not rot.

The dry run is the real check at its smallest sizes, on the CPU: the demo (prep then train), a quick
benchmark through ``bench.run``, a one-rank FSDP2 run with gradient accumulation and activation
checkpointing, and a LoRA and a full run whose exports Diffusers loads and generates with. The assertions
read what each phase's child process recorded from the runs themselves (summaries, the FSDP2 run's
checkpoint state), not the script's own settings.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PHASES = ["doctor", "demo", "bench", "fsdp2", "lora", "full", "sample", "cache_repro", "cp", "step_copies"]
DRY_IMAGE = 64  # bench.gpu_check.SIZES["dry"]["image"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``python -m bench.gpu_check --device cpu --dry-run`` once: (exit status, report, stderr path)."""
    root = tmp_path_factory.mktemp("gpu-check")
    out, stderr = root / "gpu-check.json", root / "stderr.txt"
    with open(stderr, "w") as err:
        done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--dry-run",
                               "--out", str(out), "--work", str(root / "work")],
                              cwd=REPO_ROOT, env=_env(), stdout=err, stderr=err, timeout=1500)
    report = json.loads(out.read_text()) if out.is_file() else None
    return done.returncode, report, stderr


@pytest.mark.slow
@pytest.mark.heavy
def test_dry_run_passes_every_phase(dry_run):
    code, report, stderr = dry_run
    assert report is not None, stderr.read_text()[-3000:]
    failed = {k: v.get("error") for k, v in report["phases"].items() if v["status"] != "ok"}
    assert code == 0 and not failed, failed or stderr.read_text()[-3000:]
    assert list(report["phases"]) == PHASES
    assert report["ok"] is True
    assert (report["device"], report["dry_run"], report["cuda"]) == ("cpu", True, None)
    for name, phase in report["phases"].items():
        assert phase["seconds"] > 0, name
        assert phase["peak_mem_mb"] > 50, name  # the child's peak RSS (the bench phase: its largest child's)


@pytest.mark.slow
@pytest.mark.heavy
def test_training_phases_report_finite_losses(dry_run):
    _, report, _ = dry_run
    phases = report["phases"]
    demo = phases["demo"]
    assert demo["steps"] == demo["steps_this_run"] == 4
    assert (demo["stages"]["ingest"]["out"], demo["stages"]["cache"]["out"]) == (27, 24)
    assert demo["snapshot"].startswith("0001-")
    for name in ("demo", "fsdp2", "lora", "full"):
        assert math.isfinite(phases[name]["final_loss"]) and phases[name]["final_loss"] > 0, name
        assert phases[name]["loss_finite"] is True, name
        assert phases[name]["steps_this_run"] == phases[name]["steps"] > 0, name  # trained here, not reused
    # each training phase trained a run of its own on the demo's snapshot
    assert len({phases[n]["run_dir"] for n in ("demo", "fsdp2", "lora", "full")}) == 4


@pytest.mark.slow
@pytest.mark.heavy
def test_fsdp2_phase_ran_fsdp2_with_accumulation_and_checkpointing(dry_run):
    _, report, _ = dry_run
    fsdp2 = report["phases"]["fsdp2"]
    # from the run's own checkpoint: "dcp" is written only when FSDP2 sharded the model
    assert (fsdp2["strategy"], fsdp2["checkpoint_format"], fsdp2["dcp_metadata"]) == ("fsdp2", "dcp", True)
    assert fsdp2["checkpoint_world_size"] == fsdp2["world_size"] == 1
    assert fsdp2["checkpoint_step"] == fsdp2["steps"] == 2
    assert (fsdp2["grad_accum_steps"], fsdp2["activation_checkpointing"]) == (2, True)
    # every optimizer step took 2 full micro-batches (drop_last): batch 2 x 2 = 4 samples
    assert fsdp2["samples_per_step"] == [2 * fsdp2["batch_size"]] == [4]
    assert fsdp2["losses_finite"] is True
    assert fsdp2["mixed_precision"] is False  # bf16 mixed precision applies on CUDA only


@pytest.mark.slow
@pytest.mark.heavy
def test_exports_load_in_diffusers_and_generate(dry_run):
    _, report, _ = dry_run
    lora, full = report["phases"]["lora"], report["phases"]["full"]
    assert lora["mode"] == "lora" and lora["export_dir"].endswith("export-lora")
    assert len(lora["lora_adapters"]) == 1  # load_lora_weights put one adapter on the transformer
    assert full["mode"] == "full" and full["export_dir"].endswith("export")
    for phase in (lora, full):
        assert phase["pipeline"] == "FluxPipeline"
        assert phase["image_shape"] == [1, DRY_IMAGE, DRY_IMAGE, 3]
        assert phase["pixels_finite"] is True and 0.0 <= phase["pixel_mean"] <= 1.0
        assert (phase["pipeline_device"], phase["pipeline_dtype"]) == ("cpu", "torch.float32")


@pytest.mark.slow
@pytest.mark.heavy
def test_doctor_sample_and_cache_repro_phases(dry_run):
    # issue 19: the check runs doctor and sample --compile, and the cache stage twice with equal bytes
    _, report, _ = dry_run
    doctor, sample, repro = (report["phases"][k] for k in ("doctor", "sample", "cache_repro"))
    assert doctor["exit_code"] in (0, 2) and doctor["statuses"]["cuda"] == "ok"
    assert doctor["command"].startswith("latentmill doctor --device cpu --json")
    assert sample["compiled"]["compile"] is True and sample["compiled"]["compiled"]
    assert sample["eager"]["compile"] is False and "--compile" not in sample["eager"]["command"]
    for run in (sample["eager"], sample["compiled"]):
        assert run["repeats"] == 2 and run["median_s"] > 0 and run["first_call_s"] > 0
        assert run["images"] == (1 + 2) * 2  # the warm-up call and 2 timed calls of batch 2
    assert repro["bytes_equal"] is True and repro["runs"]["deterministic"]["distinct_outputs"] == 1
    assert repro["runs"]["deterministic"]["repeats"] == 1 and repro["samples_in"] == 24  # the bucket stage's 24
    assert repro["runs"]["deterministic"]["shards"] and repro["deterministic_cost"] > 0


@pytest.mark.slow
@pytest.mark.heavy
def test_cp_phase_matches_one_process(dry_run):
    # issue 34: context parallelism on two gloo ranks, launched as a user launches it (torchrun, --nproc 2)
    _, report, _ = dry_run
    cp = report["phases"]["cp"]
    assert cp["steps"] == 3 and len(cp["one_process"]) == len(cp["ulysses"]["losses"]) == 3
    assert (cp["ulysses"]["world_size"], cp["ulysses"]["cp_size"]) == (2, 2)  # what the run itself reported
    assert cp["ulysses"]["max_relative_difference"] <= cp["tolerance"] == 1e-5
    assert "ring" not in cp  # ring needs CUDA's flash or cuDNN attention


@pytest.mark.slow
@pytest.mark.heavy
def test_step_copies_phase_profiled_one_step(dry_run):
    # issue 34: on CUDA the phase counts a step's host-to-device copies; the CPU dry run profiles the same step
    _, report, _ = dry_run
    phase = report["phases"]["step_copies"]
    assert phase["steps"] == 4 and {"latents", "prompt_embeds"} <= set(phase["batch_tensors"])
    assert (phase["htod_copies"], phase["htod_bytes"]) == (0, 0)  # no device to copy to
    trace = json.loads(Path(phase["trace"]).read_text())
    assert any(e.get("name") == "aten::randn" for e in trace["traceEvents"])  # the recorded step drew its noise


@pytest.mark.slow
@pytest.mark.heavy
def test_bench_phase_ran_the_quick_benchmark(dry_run):
    _, report, _ = dry_run
    bench = report["phases"]["bench"]
    assert bench["benchmarks"] == ["loader"] and "--quick" in bench["command"]
    assert bench["figures"] and all(f["ratio"] > 0 for f in bench["figures"].values())


def test_cuda_without_a_gpu_is_refused(tmp_path):
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cuda", "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=REPO_ROOT,
                          env={**_env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--device cuda, but torch.cuda.is_available() is False" in done.stderr
    assert "--dry-run" in done.stderr  # says what to run instead
    assert not out.exists() and not (tmp_path / "work").exists()  # refused before any work


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_runs_the_cuda_check_with_the_dev_tools(tmp_path):
    plan = subprocess.run(["make", "-n", "gpu-check", f"VENV={tmp_path / 'venv'}"], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=True).stdout
    assert 'pip install --quiet -e ".[dev]"' in plan
    assert "-m bench.gpu_check --device cuda --out gpu-check.json" in plan


def _processes_naming(text: str) -> list[str]:
    """Command lines of the live processes whose arguments contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.slow
@pytest.mark.heavy
def test_a_failed_or_timed_out_phase_is_reported_and_the_check_goes_on(tmp_path):
    # bench is given 5 s (its child runs bench.run, which runs bench.loader: a process tree); fsdp2 runs
    # without the demo phase, in an empty work folder: no snapshot to train on
    out, work = tmp_path / "gpu-check.json", tmp_path / "work"
    with open(tmp_path / "stderr.txt", "w") as err:
        done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--phases", "bench", "fsdp2",
                               "--timeout-s", "5", "--out", str(out), "--work", str(work)],
                              cwd=REPO_ROOT, env=_env(), stdout=err, stderr=err, timeout=600)
    assert done.returncode == 1
    report = json.loads(out.read_text())
    assert report["ok"] is False and list(report["phases"]) == ["bench", "fsdp2"]
    bench, fsdp2 = report["phases"]["bench"], report["phases"]["fsdp2"]
    assert bench["status"] == "failed" and bench["error"].startswith("timed out after 5 s")
    assert bench["returncode"] is None and bench["seconds"] >= 5
    assert fsdp2["status"] == "failed" and fsdp2["error"]  # ran after the bench phase failed
    assert not _processes_naming(str(work)), "the timed-out phase's process tree was not ended"


def test_a_work_folder_it_did_not_make_is_not_emptied(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--work", str(tmp_path),
                           "--out", str(tmp_path / "gpu-check.json")], cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "did not make" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_cp_phase_on_fewer_than_two_gpus_is_skipped_saying_why(tmp_path):
    import torch

    from bench import gpu_check

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the phase runs")
    result = gpu_check.phase_cp(tmp_path, "cuda", gpu_check.SIZES["dry"], gpu_check.PeakMemory("cpu"))
    assert result == {"skipped": f"context parallelism needs 2 GPUs, {torch.cuda.device_count()} visible: not "
                                 "checked"}
    assert not any(tmp_path.iterdir())  # before any work
