"""``latentmill doctor``: every decision branch with the values a GPU pod would give, and the real run here."""

import json
import subprocess
import sys
from pathlib import Path

from latentmill.cli import main
from latentmill.doctor import (
    BLOCKING,
    OK,
    TORCH_FLOOR,
    WARNING,
    Check,
    DeviceInfo,
    NvidiaInfo,
    check_cuda,
    check_devices,
    check_disk,
    check_jax,
    check_nccl,
    check_persistent,
    check_prefect,
    check_torch,
    check_video_decoders,
    exit_code,
    parse_nvidia_smi,
    probe_prefect,
    run_checks,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
H100 = NvidiaInfo("550.54.15", "12.4", ["NVIDIA H100 80GB HBM3"])

SMI = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""
SMI_L = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-4a8c1f0e-aaaa-bbbb-cccc-000000000000)\n"
         "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-4a8c1f0e-aaaa-bbbb-cccc-000000000001)\n")


def test_parse_nvidia_smi():
    info = parse_nvidia_smi(SMI, SMI_L)
    assert (info.driver_version, info.cuda_version) == ("550.54.15", "12.4")
    assert info.gpus == ["NVIDIA H100 80GB HBM3"] * 2
    assert parse_nvidia_smi("", "") == NvidiaInfo(None, None, [])


def test_cuda_branches():
    # this machine's case: CPU-only build, no driver, nothing requested -> fine
    assert check_cuda("2.13.0+cpu", None, None, False, requested=False).status == OK
    # a GPU pod with a CPU-only wheel: the silent fallback
    cpu_wheel = check_cuda("2.13.0+cpu", None, H100, False, requested=True)
    assert cpu_wheel.status == BLOCKING and "fall back to the CPU" in cpu_wheel.message
    assert "download.pytorch.org" in cpu_wheel.fix
    # --device cuda without any driver
    assert check_cuda("2.13.0+cu124", "12.4", None, False, requested=True).status == BLOCKING
    # a wheel built for a newer CUDA major than the driver supports
    old_driver = NvidiaInfo("470.82.01", "11.4", ["Tesla T4"])
    major = check_cuda("2.13.0+cu124", "12.4", old_driver, False, requested=True)
    assert major.status == BLOCKING and "newer driver" in major.message
    # same major, newer minor: minor-version compatibility works, with a warning
    minor = check_cuda("2.13.0+cu126", "12.6", H100, True, requested=True)
    assert minor.status == WARNING and "minor-version" in minor.message
    # everything matches
    good = check_cuda("2.13.0+cu124", "12.4", H100, True, requested=True)
    assert good.status == OK and good.details["driver_version"] == "550.54.15"
    # a match that still is not usable (the container does not see the GPU)
    hidden = check_cuda("2.13.0+cu124", "12.4", H100, False, requested=True)
    assert hidden.status == BLOCKING and "is_available" in hidden.message


def test_torch_floor_names_both_versions():
    """pyproject.toml declared torch>=2.4, but FSDP2's fully_shard is torch.distributed.fsdp's from 2.6 on."""
    old = check_torch("2.5.1+cu124")
    assert old.status == BLOCKING and old.details == {"torch": "2.5.1+cu124", "required": ">=2.6"}
    assert "torch 2.5.1+cu124 is installed" in old.message and "torch >= 2.6" in old.message
    assert "\n" not in old.message and "2.6" in old.fix
    assert check_torch("2.6.0").status == check_torch("2.13.0+cpu").status == OK
    assert check_torch("2.10.0", floor="2.9").status == OK  # versions compare as numbers, not strings
    assert check_torch("2.13.0", floor="3.0").status == BLOCKING
    # the floor doctor checks is the one the package declares
    assert f'"torch>={TORCH_FLOOR}",' in (REPO_ROOT / "pyproject.toml").read_text()


def test_devices_memory_and_bf16():
    h100 = DeviceInfo(0, "NVIDIA H100", 79 * GiB, 80 * GiB, True, "9.0")
    assert check_devices([], available=False).status == OK
    assert check_devices([], available=True).status == BLOCKING
    good = check_devices([h100], available=True)
    assert good.status == OK and "79.0/80.0 GiB free" in good.message and "bf16 yes" in good.message
    t4 = DeviceInfo(1, "Tesla T4", 15 * GiB, 16 * GiB, False, "7.5")
    assert "no bf16" in check_devices([h100, t4], available=True).message
    taken = DeviceInfo(0, "NVIDIA H100", 20 * GiB, 80 * GiB, True, "9.0")  # e.g. JAX preallocated 75%
    held = check_devices([taken], available=True)
    assert held.status == WARNING and "75% of its memory" in held.message


def test_nccl():
    assert check_nccl(None, False, 0).status == OK
    assert check_nccl((2, 21, 5), True, 8).message == "NCCL 2.21.5"
    assert check_nccl(None, True, 8).status == WARNING
    assert check_nccl(None, True, 1).status == OK


def test_disk_and_volume(tmp_path):
    assert check_disk("hf cache", tmp_path, 5 * GiB, 100 * GiB).status == WARNING
    assert check_disk("hf cache", tmp_path, 50 * GiB, 100 * GiB).status == OK
    assert check_disk("hf cache", tmp_path, None, None).status == WARNING
    workspace = tmp_path / "workspace"
    # no /workspace volume on the machine: nothing to say
    assert check_persistent("hf cache", tmp_path / "hub", "HF_HOME", None, workspace).status == OK
    workspace.mkdir()
    lost = check_persistent("hf cache", Path.home() / ".cache/huggingface/hub", "HF_HOME", None, workspace)
    assert lost.status == WARNING and "HF_HOME is not set" in lost.message
    assert lost.fix == f"export HF_HOME={workspace}/hf"
    kept = check_persistent("hf cache", workspace / "hf" / "hub", "HF_HOME", str(workspace / "hf"), workspace)
    assert kept.status == OK
    # the real probe path: run_checks with a fake workspace root and HF_HOME unset
    checks = {c.name: c for c in run_checks(None, workspace=workspace, env={}, nvidia=lambda: None)}
    assert checks["volume hf cache"].status == WARNING
    # low disk through run_checks: a threshold above any real disk
    checks = {c.name: c for c in run_checks(tmp_path, env={}, nvidia=lambda: None, min_free_gib=1e9)}
    assert checks["disk output_dir"].status == WARNING and checks["disk hf cache"].status == WARNING


def test_video_decoders():
    assert check_video_decoders({"pyav": None, "decord": None}).status == OK
    broken = check_video_decoders({"pyav": None, "decord": "ImportError: No module named 'decord'"})
    assert broken.status == WARNING and "decord" in broken.message


def test_prefect(tmp_path):
    assert check_prefect(None, None).status == OK
    assert check_prefect("http://127.0.0.1:4200/api", 200).status == OK
    assert check_prefect("http://127.0.0.1:4200/api", 503).status == BLOCKING
    # a real unreachable endpoint: a closed port answers at once
    reply = probe_prefect("http://127.0.0.1:9/api", timeout_s=2)
    assert isinstance(reply, str)
    assert check_prefect("http://127.0.0.1:9/api", reply).status == BLOCKING


def test_prefect_health_of_a_live_http_server(tmp_path):
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "health").write_text("true")
    server = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (...)"
        port = int(line.split(" port ")[1].split()[0])
        url = f"http://127.0.0.1:{port}/api"
        assert probe_prefect(url) == 200
        checks = {c.name: c for c in run_checks(None, env={"PREFECT_API_URL": url}, nvidia=lambda: None)}
        assert checks["prefect api"].status == OK
        assert probe_prefect(f"http://127.0.0.1:{port}/missing") == 404
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_jax():
    assert check_jax(False, None, True, None).status == OK
    fallback = check_jax(True, ["cpu"], gpu_seen=True, preallocate=None)
    assert fallback.status == WARNING and "JAX RUNS ON THE CPU" in fallback.message
    assert check_jax(True, ["cpu"], gpu_seen=False, preallocate=None).status == OK
    prealloc = check_jax(True, ["gpu"], gpu_seen=True, preallocate=None)
    assert prealloc.status == WARNING and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in prealloc.fix
    assert check_jax(True, ["gpu"], gpu_seen=True, preallocate="false").status == OK
    assert check_jax(True, "RuntimeError: no backend", True, None).status == WARNING


def test_exit_codes():
    assert exit_code([Check("a", OK, "")]) == 0
    assert exit_code([Check("a", OK, ""), Check("b", WARNING, "")]) == 2
    assert exit_code([Check("a", WARNING, ""), Check("b", BLOCKING, "")]) == 1


def test_real_run_here_exit_code_matches_its_checks(tmp_path, capsys):
    report = tmp_path / "doctor.json"
    code = main(["doctor", str(REPO_ROOT / "configs" / "demo.yaml"), "--json", str(report)])
    data = json.loads(report.read_text())
    statuses = [c["status"] for c in data["checks"]]
    assert code == data["exit_code"] == (1 if BLOCKING in statuses else 2 if WARNING in statuses else 0)
    names = {c["name"] for c in data["checks"]}
    assert {"cuda", "torch", "devices", "nccl", "disk output_dir", "disk hf cache", "volume hf cache", "video decode",
            "prefect api", "jax"} <= names
    by_name = {c["name"]: c for c in data["checks"]}
    assert by_name["torch"]["status"] == OK  # torch 2.13 here
    assert by_name["video decode"]["status"] == OK  # decord and PyAV are installed here and decode the probe
    out = capsys.readouterr().out
    assert all(name in out for name in names)
    # --device cuda on this CPU-only machine: blocking, exit 1
    assert main(["doctor", "--device", "cuda", "--json", str(report)]) == 1
    assert json.loads(report.read_text())["checks"][0]["status"] == BLOCKING
