"""Where the encoders run: the device class a cache records, and deterministic mode on CUDA."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

DEVICE_CLASS_ENV = "LATENTMILL_DEVICE_CLASS"  # tests only: this process claims another device class
CUBLAS_WORKSPACE = ":4096:8"  # CUBLAS_WORKSPACE_CONFIG for deterministic cuBLAS (CUDA >= 10.2)
# CPU features that change which kernels oneDNN, MKL and ATen pick (and so the rounding of a reduction)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
             "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def cpu_identity(cpuinfo: str) -> dict[str, Any]:
    """Vendor, model name and kernel-relevant ISA flags from the text of ``/proc/cpuinfo`` (first CPU)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    vendor = fields.get("vendor_id") or fields.get("cpu implementer") or "unknown"
    return {"vendor": vendor, "model": fields.get("model name") or fields.get("cpu part") or "unknown",
            "isa": [f for f in ISA_FLAGS if f in flags]}


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        import platform

        return f"vendor_id: {platform.processor() or platform.machine()}\n"


def device_description(device: torch.device, cpuinfo: str | None = None) -> dict[str, Any]:
    """What decides an encoder's bytes besides its inputs and weights: the device class and the library
    versions, as a cache unit records them (``docs/cache-format.md``, "Reproducible where").

    ``class`` is the GPU's name and compute capability, or the CPU's vendor, its kernel-relevant ISA flags
    and ATen's dispatch level (the CPU model name is kept beside it, not in it). ``$LATENTMILL_DEVICE_CLASS``
    replaces ``class`` (tests use it to play a second machine).
    """
    info: dict[str, Any] = {"torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(kind="cuda", name=props.name, capability=f"{props.major}.{props.minor}",
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        info["class"] = f"cuda {props.name} sm_{props.major}{props.minor}"
    else:
        cpu = cpu_identity(_read_cpuinfo() if cpuinfo is None else cpuinfo)
        capability = torch.backends.cpu.get_cpu_capability()
        info.update(kind="cpu", vendor=cpu["vendor"], model=cpu["model"], isa=cpu["isa"], aten=capability)
        info["class"] = f"cpu {cpu['vendor']} {capability} [{' '.join(cpu['isa'])}]"
    if os.environ.get(DEVICE_CLASS_ENV):
        info["class"] = os.environ[DEVICE_CLASS_ENV]
    return info


def encoded_on_key(description: dict[str, Any]) -> str:
    """The name a cache's ``encoded_on`` counts under: the device class with the torch (and cuDNN) version."""
    key = f"{description['class']} | torch {description['torch']}"
    return key + (f" | cudnn {description['cudnn']}" if description.get("cudnn") else "")


def deterministic_flags() -> dict[str, Any]:
    """The global settings :func:`deterministic_encoding` changes, as they are now."""
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _set_flags(flags: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(flags["deterministic_algorithms"], warn_only=flags["warn_only"])
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])


DETERMINISTIC = {"deterministic_algorithms": True, "warn_only": True, "cudnn_deterministic": True,
                 "cudnn_benchmark": False, "matmul_tf32": False, "cudnn_tf32": False,
                 "float32_matmul_precision": "highest"}

_det_lock = threading.Lock()
_det_depth = 0
_det_saved: dict[str, Any] | None = None


def prepare_cublas_determinism() -> bool:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` when unset. torch reads it when it sizes cuBLAS's workspace, at the
    process's first cuBLAS call: set before CUDA is initialised it is surely in time (returns True); set
    later, it still is unless something ran a CUDA matmul before (returns False: not guaranteed)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        return True
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    return not torch.cuda.is_initialized()


@contextmanager
def deterministic_encoding(enabled: bool = True) -> Iterator[bool]:
    """Run the block with deterministic algorithms, cuDNN deterministic and not benchmarking, TF32 off; put
    every setting back afterwards (a process that trains next keeps its own settings).

    The cache stage enables it on CUDA (``cache.deterministic: auto``): convolution algorithms chosen by
    benchmarking, and TF32, vary between runs, GPU models and library versions. ``warn_only``: an op with no
    deterministic CUDA kernel warns instead of failing a long prep. Nested and concurrent uses (the threads of
    one worker) share one saved state: the first to enter saves and sets, the last to leave restores.
    """
    global _det_depth, _det_saved
    if not enabled:
        yield False
        return
    prepare_cublas_determinism()
    with _det_lock:
        if _det_depth == 0:
            _det_saved = deterministic_flags()
            _set_flags(DETERMINISTIC)
        _det_depth += 1
    try:
        yield True
    finally:
        with _det_lock:
            _det_depth -= 1
            if _det_depth == 0 and _det_saved is not None:
                _set_flags(_det_saved)
                _det_saved = None
