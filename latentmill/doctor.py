"""``latentmill doctor``: what on this machine would make a run slow, wrong or fail, found in a few seconds.

Each check is a small pure decision function that takes what was probed (versions, flags, sizes, the reply
of a URL) and returns a :class:`Check` with a status, what it found and what to do; :func:`run_checks` does
the probing on this machine and calls them. Tests drive the GPU-side branches through the decision functions
with the values a GPU pod would give.

Statuses and the exit code of ``latentmill doctor``:

* ``ok``: nothing to do (including things that do not apply here, e.g. no JAX installed);
* ``warning``: works, but slower, fragile or wasteful (exit 2 when there is no blocking problem);
* ``blocking``: a run would fail or silently use the wrong device (exit 1).

CPU machines: with no NVIDIA driver and no ``--device cuda``, a CPU-only torch build is ``ok`` (the demo and
the tests run on the CPU by design). On a machine whose ``nvidia-smi`` shows a GPU, CUDA is *requested*
(``--device auto``): a torch build that cannot use it is blocking, because every run would fall back to the
CPU without a word.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OK, WARNING, BLOCKING = "ok", "warning", "blocking"
GiB = 1024**3
MIN_FREE_GIB = 20.0  # below this a real model's weights, a latent cache or a checkpoint may not fit
WORKSPACE = Path("/workspace")  # where Runpod-style pods mount their persistent volume
TORCH_FLOOR = "2.6"  # pyproject.toml's torch>= (tests keep them equal): the first with torch.distributed.fsdp.fully_shard


@dataclass
class Check:
    """One check's result: ``status`` (ok | warning | blocking), what was found, and what to do about it."""

    name: str
    status: str
    message: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def exit_code(checks: list[Check]) -> int:
    """0 all good, 1 any blocking problem, 2 warnings only."""
    statuses = {c.status for c in checks}
    return 1 if BLOCKING in statuses else 2 if WARNING in statuses else 0


# ------------------------------------------------------------------------------------------------ parsing


@dataclass
class NvidiaInfo:
    """What ``nvidia-smi`` says: the driver version, the newest CUDA it supports, the GPUs' names."""

    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[str] = field(default_factory=list)


def parse_nvidia_smi(summary: str, listing: str = "") -> NvidiaInfo:
    """``nvidia-smi``'s header (``Driver Version: 550.54.15  CUDA Version: 12.4``) and ``nvidia-smi -L``
    (``GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)``)."""
    driver = re.search(r"Driver Version:\s*([\d.]+)", summary)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", summary)
    gpus = [m.group(1).strip() for m in re.finditer(r"^GPU \d+:\s*(.+?)\s*(?:\(UUID:.*)?$", listing, re.M)]
    return NvidiaInfo(driver.group(1) if driver else None, cuda.group(1) if cuda else None, gpus)


def probe_nvidia_smi(timeout_s: float = 5.0) -> NvidiaInfo | None:
    """Run ``nvidia-smi`` (None when it is not installed or fails: no NVIDIA driver)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        summary = subprocess.run([exe], capture_output=True, text=True, timeout=timeout_s, check=True).stdout
        listing = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(summary, listing)


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = re.findall(r"\d+", text)
    return tuple(int(p) for p in parts[:2]) if parts else None


# ------------------------------------------------------------------------------------------------ decisions


def check_cuda(torch_version: str, torch_cuda: str | None, driver: NvidiaInfo | None, available: bool,
               requested: bool) -> Check:
    """The torch build and its CUDA version against the driver's, and whether CUDA is usable.

    ``torch_cuda`` is ``torch.version.cuda`` (None: a CPU-only build), ``driver`` what ``nvidia-smi`` said
    (None: no driver), ``available`` ``torch.cuda.is_available()``, ``requested`` whether this machine is
    meant to run on CUDA (``--device cuda``, or ``auto`` with a GPU visible to ``nvidia-smi``).
    """
    details = {"torch": torch_version, "torch_cuda": torch_cuda, "available": available, "requested": requested,
               "driver_version": driver.driver_version if driver else None,
               "driver_cuda": driver.cuda_version if driver else None}
    build = f"torch {torch_version} ({'CUDA ' + torch_cuda if torch_cuda else 'CPU-only build'})"
    drv = (f"driver {driver.driver_version} (CUDA <= {driver.cuda_version})" if driver else "no NVIDIA driver")
    install = "install the torch wheel for the driver's CUDA: pip install torch --index-url " \
              "https://download.pytorch.org/whl/cu<XY> (cu<XY> <= the driver's CUDA version)"
    if not requested and not available:
        return Check("cuda", OK, f"{build}, {drv}: runs on the CPU (no CUDA requested)", details=details)
    if requested and torch_cuda is None and driver is not None:
        return Check("cuda", BLOCKING, f"{build} on a machine with a GPU ({drv}): every run would fall back to "
                     "the CPU", install, details)
    if requested and driver is None and not available:
        return Check("cuda", BLOCKING, f"CUDA requested but {drv}: torch cannot use a GPU",
                     "run on a machine (or pod) with an NVIDIA GPU and driver, or pass --device cpu", details)
    have, need = _version(driver.cuda_version if driver else None), _version(torch_cuda)
    if have and need and need[0] > have[0]:
        return Check("cuda", BLOCKING, f"{build} needs a newer driver than {drv}: CUDA is not usable",
                     install + ", or update the NVIDIA driver", details)
    if requested and not available:
        return Check("cuda", BLOCKING, f"CUDA requested, {build} and {drv}, but torch.cuda.is_available() is "
                     "False", "check CUDA_VISIBLE_DEVICES and that the container sees the GPU (--gpus all)", details)
    if have and need and need > have:
        return Check("cuda", WARNING, f"{build} is newer than {drv}: it runs through CUDA minor-version "
                     "compatibility, but kernels that need PTX JIT may fail", install + ", or update the driver",
                     details)
    return Check("cuda", OK, f"{build}, {drv}: CUDA usable", details=details)


def check_torch(torch_version: str, floor: str = TORCH_FLOOR) -> Check:
    """The installed torch against latentmill's floor (``TORCH_FLOOR``, the ``torch>=`` of pyproject.toml)."""
    details = {"torch": torch_version, "required": f">={floor}"}
    have, need = _version(torch_version), _version(floor)
    if have is None or need is None or have < need:
        return Check("torch", BLOCKING, f"torch {torch_version} is installed; latentmill needs torch >= {floor} "
                     "(FSDP2's fully_shard, DTensor)", f"install torch >= {floor} (see docs/training.md)", details)
    return Check("torch", OK, f"torch {torch_version} (latentmill needs >= {floor})", details=details)


@dataclass
class DeviceInfo:
    """One CUDA device as torch sees it."""

    index: int
    name: str
    free_bytes: int
    total_bytes: int
    bf16: bool
    capability: str = ""


def check_devices(devices: list[DeviceInfo], available: bool) -> Check:
    """The devices torch sees, their memory (free and total) and bf16 support."""
    details = {"devices": [asdict(d) for d in devices]}
    if not available:
        return Check("devices", OK, "torch sees no CUDA device: CPU only", details=details)
    if not devices:
        return Check("devices", BLOCKING, "CUDA is available but torch lists no device",
                     "check CUDA_VISIBLE_DEVICES", details)
    lines, problems = [], []
    for d in devices:
        lines.append(f"cuda:{d.index} {d.name} {d.free_bytes / GiB:.1f}/{d.total_bytes / GiB:.1f} GiB free, "
                     f"bf16 {'yes' if d.bf16 else 'no'}")
        if not d.bf16:
            problems.append(f"cuda:{d.index} has no bf16: training and sampling run bf16 autocast on CUDA")
        if d.total_bytes and d.free_bytes < 0.5 * d.total_bytes:
            problems.append(f"cuda:{d.index}: {100 * (1 - d.free_bytes / d.total_bytes):.0f}% of its memory is "
                            "already taken (another process, or a JAX process that preallocated)")
    if problems:
        return Check("devices", WARNING, "; ".join(lines + problems),
                     "use a GPU with bf16 (compute capability >= 8.0); free the GPU (nvidia-smi lists who holds it)",
                     details)
    return Check("devices", OK, "; ".join(lines), details=details)


def check_nccl(version: tuple[int, ...] | str | None, cuda_available: bool, device_count: int) -> Check:
    """NCCL's version (``torch.cuda.nccl.version()``), needed by multi-GPU runs."""
    if not cuda_available:
        return Check("nccl", OK, "no CUDA: multi-process runs use gloo", details={"version": None})
    if version is None:
        severity = WARNING if device_count > 1 else OK
        return Check("nccl", severity, "this torch build has no NCCL: multi-GPU runs cannot use it",
                     "install a torch CUDA wheel built with NCCL (the PyPI/pytorch.org Linux wheels are)" if
                     severity == WARNING else "", {"version": None})
    text = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    return Check("nccl", OK, f"NCCL {text}", details={"version": text})


def check_disk(label: str, path: str | Path, free_bytes: int | None, total_bytes: int | None,
               min_free_gib: float = MIN_FREE_GIB) -> Check:
    """Free disk at ``path`` (``None``: the path and none of its parents exist)."""
    details = {"path": str(path), "free_bytes": free_bytes, "total_bytes": total_bytes,
               "min_free_gib": min_free_gib}
    name = f"disk {label}"
    if free_bytes is None:
        return Check(name, WARNING, f"{path}: cannot read its disk usage", "create it, or fix the path", details)
    text = f"{path}: {free_bytes / GiB:.1f} GiB free of {(total_bytes or 0) / GiB:.1f} GiB"
    if free_bytes < min_free_gib * GiB:
        return Check(name, WARNING, f"{text} (< {min_free_gib:g} GiB)",
                     "free space or point it at a larger volume (FLUX.1-dev alone is ~32 GiB)", details)
    return Check(name, OK, text, details=details)


def _under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def check_persistent(label: str, path: str | Path, env_var: str, env_value: str | None,
                     workspace: Path = WORKSPACE) -> Check:
    """Whether ``path`` (the HF cache, ``output_dir``) lives on the pod's persistent volume.

    A pod with a ``workspace`` volume loses its container disk at every restart: a cache there downloads
    the weights again each time. Warn when ``path`` is not under ``workspace`` (for the HF cache: when
    ``HF_HOME`` is not set, the case that puts it in ``~/.cache``).
    """
    details = {"path": str(path), "workspace": str(workspace), env_var: env_value}
    name = f"volume {label}"
    if not workspace.is_dir():
        return Check(name, OK, f"{path} (no {workspace} volume on this machine)", details=details)
    if _under(Path(path), workspace):
        return Check(name, OK, f"{path} is on the persistent volume {workspace}", details=details)
    unset = f"{env_var} is not set, so " if not env_value else ""
    return Check(name, WARNING, f"{unset}{path} is on the container's disk, not on the persistent volume "
                 f"{workspace}: it is lost (and downloaded again) when the pod restarts",
                 f"export {env_var}={workspace}/{'hf' if env_var == 'HF_HOME' else 'outputs'}", details)


def check_volume_layout(root: str | None, source: str | None, places: dict[str, str],
                        workspace: Path = WORKSPACE, writable: bool | None = None) -> Check:
    """The persistent volume in force (``volume:`` recipe key or ``LATENTMILL_VOLUME``) and where it put the
    Hugging Face cache, the weight-hash store, Prefect's home and ``output_dir`` (``places``: what -> path).

    No volume on a machine with a ``workspace`` mount is a warning (everything would live on the container's
    disk); a volume that is not a writable folder is blocking (every run would fail to write there).
    """
    details = {"volume": root, "source": source, "places": places, "writable": writable}
    where = ", ".join(f"{k} {v}" for k, v in places.items())
    if root is None:
        if workspace.is_dir():
            return Check("volume", WARNING, f"no persistent volume set, though {workspace} is mounted: {where}",
                         f"export LATENTMILL_VOLUME={workspace} (or set `volume: {workspace}` in the recipe)",
                         details)
        return Check("volume", OK, f"no persistent volume set (LATENTMILL_VOLUME or recipe `volume:`): {where}",
                     details=details)
    origin = "recipe key volume" if source == "recipe" else "LATENTMILL_VOLUME"
    if writable is False:
        return Check("volume", BLOCKING, f"{origin}={root} is not a writable folder",
                     f"mount the pod's volume at {root}, or point {origin} at it", details)
    outside = [k for k, v in places.items() if "://" not in v and not _under(Path(v), Path(root))]
    text = f"{origin}={root}: {where}"
    if outside:
        return Check("volume", OK, f"{text} ({', '.join(outside)} set explicitly, outside the volume)",
                     details=details)
    return Check("volume", OK, text, details=details)


def _writable(path: Path) -> bool:
    """Whether ``path`` is (or can be made as) a folder this process can write in."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            return True
    except OSError:
        return False


def check_video_decoders(results: dict[str, str | None]) -> Check:
    """``results``: decoder name -> None when it decoded a frame, else the error. Video recipes need both
    decord (frame counts) and PyAV (headers, rotation, decoding)."""
    failed = {k: v for k, v in results.items() if v is not None}
    details = {"results": {k: v or "ok" for k, v in results.items()}}
    if not failed:
        return Check("video decode", OK, "decord and PyAV each decoded a frame", details=details)
    text = "; ".join(f"{k}: {v}" for k, v in failed.items())
    return Check("video decode", WARNING, f"video recipes will fail: {text}",
                 "pip install decord av (image recipes do not need them)", details)


def check_prefect(url: str | None, reply: int | str | None) -> Check:
    """The Prefect API when ``PREFECT_API_URL`` is set: ``reply`` is the HTTP status of ``<url>/health`` or
    the connection error. Unreachable is blocking: every ``prep``/``train``/``run`` would fail on it."""
    if not url:
        return Check("prefect api", OK, "PREFECT_API_URL not set: flows run on a temporary local API")
    details = {"url": url, "reply": reply}
    if reply == 200:
        return Check("prefect api", OK, f"{url} answers /health", details=details)
    return Check("prefect api", BLOCKING, f"{url} is configured but /health gave {reply}",
                 "start it (latentmill serve start) or unset PREFECT_API_URL", details)


def check_jax(installed: bool, platforms: list[str] | str | None, gpu_seen: bool, preallocate: str | None) -> Check:
    """``jax.devices()`` platforms (or the error that listing raised), against a GPU ``nvidia-smi`` shows, and
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` (JAX takes ~75% of the GPU's memory at start unless it is ``false``)."""
    details = {"installed": installed, "platforms": platforms, "XLA_PYTHON_CLIENT_PREALLOCATE": preallocate}
    if not installed:
        return Check("jax", OK, "not installed (only the [jax] extra needs it)", details=details)
    if isinstance(platforms, str):
        return Check("jax", WARNING, f"jax.devices() failed: {platforms}", "reinstall jax for this machine", details)
    names = sorted(set(platforms or []))
    if gpu_seen and not ({"gpu", "cuda", "rocm"} & set(names)):
        return Check("jax", WARNING, f"!!! JAX RUNS ON THE CPU ({', '.join(names)}) ON A MACHINE WITH A GPU !!!",
                     'pip install -U "jax[cuda12]" (matching the driver), then check jax.devices()', details)
    on_gpu = {"gpu", "cuda"} & set(names)
    if on_gpu and (preallocate or "").lower() != "false":
        return Check("jax", WARNING, f"jax devices: {', '.join(names)}; XLA_PYTHON_CLIENT_PREALLOCATE is "
                     f"{preallocate or 'unset'}: JAX takes ~75% of the GPU's memory when it starts",
                     "export XLA_PYTHON_CLIENT_PREALLOCATE=false when JAX shares the GPU with torch", details)
    return Check("jax", OK, f"jax devices: {', '.join(names)}", details=details)


def check_cpu_threads(threads: int, reason: str, cores: int, ranks: int, cuda: bool) -> Check:
    """The intra-op threads CPU training would use here (``latentmill.trainer.threads.choose_cpu_threads``:
    ``threads`` and its ``reason``), against the ``cores`` this process may use and the node's ``ranks``. More
    threads than the cores a rank has leaves OpenMP teams waiting on preempted threads at every op."""
    details = {"threads": threads, "reason": reason, "usable_cores": cores, "local_ranks": ranks}
    if cuda:
        return Check("cpu threads", OK, f"training runs on the GPU; torch keeps its {threads} CPU threads",
                     details=details)
    message = f"CPU training would use {threads} intra-op thread{'s' if threads != 1 else ''} per rank ({reason})"
    if threads * ranks > cores:
        return Check("cpu threads", WARNING, f"{message}: more than the {cores} usable cores",
                     f"unset OMP_NUM_THREADS and trainer.cpu_threads (the trainer then leaves one core per rank "
                     f"to its loader), or set them to {max(1, cores // ranks - 1)}", details)
    return Check("cpu threads", OK, message, details=details)


# ------------------------------------------------------------------------------------------------ probes


def _disk_usage(path: Path) -> tuple[int | None, int | None]:
    """Free and total bytes of the file system that holds ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            usage = shutil.disk_usage(candidate)
            return usage.free, usage.total
    return None, None


def probe_video_decoders() -> dict[str, str | None]:
    """Write a 4-frame video with PyAV in a temp dir, decode one frame with PyAV and with decord."""
    results: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="latentmill-doctor-") as tmp:
        path = Path(tmp) / "probe.mp4"
        try:
            import av
            import numpy as np

            with av.open(str(path), "w") as container:
                stream = container.add_stream("mpeg4", rate=4)
                stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
                for i in range(4):
                    frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 60 * i, np.uint8), format="rgb24")
                    container.mux(stream.encode(frame))
                container.mux(stream.encode())
            with av.open(str(path)) as container:
                next(container.decode(video=0)).to_ndarray(format="rgb24")
            results["pyav"] = None
        except Exception as err:  # ImportError, a codec missing from this build, a broken install
            results["pyav"] = f"{type(err).__name__}: {err}"
        if results["pyav"] is not None:
            results["decord"] = "not tried (PyAV could not write the probe video)"
            return results
        try:
            import decord

            shape = decord.VideoReader(str(path))[0].shape
            results["decord"] = None if tuple(shape) == (32, 32, 3) else f"decoded shape {tuple(shape)}"
        except Exception as err:
            results["decord"] = f"{type(err).__name__}: {err}"
    return results


def probe_prefect(url: str, timeout_s: float = 3.0) -> int | str:
    """HTTP status of ``GET <url>/health``, or the error text."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as reply:  # noqa: S310
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def probe_jax() -> tuple[bool, list[str] | str | None]:
    """Whether JAX imports, and its devices' platforms (or the error)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        return False, None
    try:
        import jax

        return True, [d.platform for d in jax.devices()]
    except Exception as err:
        return True, f"{type(err).__name__}: {err}"


def run_checks(output_dir: str | Path | None = None, *, device: str = "auto", workspace: Path = WORKSPACE,
               env: dict[str, str] | None = None, min_free_gib: float = MIN_FREE_GIB,
               nvidia: Callable[[], NvidiaInfo | None] = probe_nvidia_smi,
               recipe_volume: str | None = None, cpu_threads: int = 0) -> list[Check]:
    """Probe this machine and run every check. ``device``: ``auto`` (CUDA requested when ``nvidia-smi`` shows
    a GPU), ``cuda`` or ``cpu``. ``output_dir``: a recipe's, for its disk and volume checks. A persistent
    volume in force (``recipe_volume``, else ``LATENTMILL_VOLUME`` in ``env``) replaces ``workspace``.
    ``cpu_threads``: the recipe's ``trainer.cpu_threads`` (the CPU thread check says what training would use)."""
    import torch
    from huggingface_hub import constants

    env = dict(os.environ) if env is None else env
    from latentmill.volume import volume_root

    volume, source = volume_root(recipe_volume, env)
    writable = None
    if volume is not None:
        workspace, writable = Path(volume), _writable(Path(volume))  # (made when missing, as a run would)
    driver = nvidia()
    gpu_seen = bool(driver and driver.gpus)
    requested = device == "cuda" or (device == "auto" and gpu_seen)
    available = torch.cuda.is_available()
    checks = [check_cuda(torch.__version__, torch.version.cuda, driver, available, requested),
              check_torch(torch.__version__)]
    devices = []
    if available:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            props = torch.cuda.get_device_properties(i)
            with torch.cuda.device(i):
                bf16 = torch.cuda.is_bf16_supported()
            devices.append(DeviceInfo(i, props.name, free, total, bf16, f"{props.major}.{props.minor}"))
    checks.append(check_devices(devices, available))
    nccl = None
    if available:
        try:
            nccl = torch.cuda.nccl.version()
        except Exception:
            nccl = None
    checks.append(check_nccl(nccl, available, len(devices)))
    if output_dir is not None:
        out = Path(output_dir).expanduser()
        checks.append(check_disk("output_dir", out, *_disk_usage(out), min_free_gib=min_free_gib))
        checks.append(check_persistent("output_dir", out, "output_dir", str(output_dir), workspace))
    hf_cache = Path(constants.HF_HUB_CACHE).expanduser()
    checks.append(check_disk("hf cache", hf_cache, *_disk_usage(hf_cache), min_free_gib=min_free_gib))
    checks.append(check_persistent("hf cache", hf_cache, "HF_HOME", env.get("HF_HOME"), workspace))
    places = {"HF_HOME": env.get("HF_HOME") or str(Path(constants.HF_HOME).expanduser())}
    from latentmill.core.fingerprints import hash_store_path

    places["weight-hash store"] = env.get("LATENTMILL_HASH_STORE") or str(hash_store_path())
    places["PREFECT_HOME"] = env.get("PREFECT_HOME") or str(Path("~/.prefect").expanduser())
    if output_dir is not None:
        places["output_dir"] = str(output_dir)
    checks.append(check_volume_layout(volume, source, places, workspace, writable))
    checks.append(check_video_decoders(probe_video_decoders()))
    url = env.get("PREFECT_API_URL")
    checks.append(check_prefect(url, probe_prefect(url) if url else None))
    installed, platforms = probe_jax()
    checks.append(check_jax(installed, platforms, gpu_seen, env.get("XLA_PYTHON_CLIENT_PREALLOCATE")))
    from latentmill.trainer.threads import choose_cpu_threads, usable_cores

    cores = usable_cores()
    choice = choose_cpu_threads(cpu_threads, env=env, cores=cores)
    ranks = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
    on_gpu = available and device != "cpu"
    checks.append(check_cpu_threads(torch.get_num_threads() if on_gpu else choice.threads,
                                    choice.reason, cores[0], ranks, on_gpu))
    return checks


def format_checks(checks: list[Check]) -> str:
    """A readable table: status, check, what was found; the fix on the next line."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'status':<9} {'check':<{width}}  found", "-" * (width + 40)]
    for c in checks:
        lines.append(f"{c.status.upper():<9} {c.name:<{width}}  {c.message}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<9} {'':<{width}}  -> {c.fix}")
    code = exit_code(checks)
    lines.append({0: "all good", 1: "blocking problems (exit 1)", 2: "warnings only (exit 2)"}[code])
    return "\n".join(lines)


def to_json(checks: list[Check]) -> dict[str, Any]:
    """The report as written by ``--json``: exit code and every check."""
    return {"exit_code": exit_code(checks), "checks": [asdict(c) for c in checks]}


def doctor(config: str | None = None, overrides: list[str] | None = None, *, device: str = "auto",
           json_path: Path | None = None) -> int:
    """Run the checks (``output_dir`` from the recipe ``config`` when given), print the table, return the exit
    code; write the report to ``json_path`` when given."""
    output_dir = recipe_volume = None
    cpu_threads = 0
    if config is not None:
        from latentmill.recipe import load_recipe

        recipe = load_recipe(config, overrides or [])
        output_dir, recipe_volume = recipe.output_dir, recipe.volume
        cpu_threads = recipe.trainer.cpu_threads
    checks = run_checks(output_dir, device=device, recipe_volume=recipe_volume, cpu_threads=cpu_threads)
    print(format_checks(checks))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(to_json(checks), indent=2, default=str))
    return exit_code(checks)
