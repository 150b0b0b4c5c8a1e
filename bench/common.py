"""Shared plumbing of the benchmarks: figures, interleaved repetitions, cache dropping, data generation.

Every figure is a ratio ``ours / baseline`` measured side by side: each repetition runs ours and the
baseline back to back (alternating which goes first), the figure reports the median of the per-repetition
ratios and their min–max, plus the medians of ours and of the baseline. On a shared, noisy machine a
ratio of two interleaved measurements is far more stable than either absolute number.

Shape legend: C latent channels, H/W latent height/width, L text tokens, D text width.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
WORK = BENCH_DIR / ".work"  # generated data and models; git-ignored


def setup_env() -> None:
    """Environment every benchmark process needs: a throwaway Prefect home (never ~/.prefect), quiet logs."""
    home = WORK / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(home)
    # weight digests remembered across runs, as for a user's second prep, but never in ~/.cache
    os.environ["LATENTMILL_HASH_STORE"] = str(WORK / "weight-hashes.sqlite")
    os.environ.pop("PREFECT_API_URL", None)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


# ---------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    """One benchmark figure: medians of ours and the baseline, the ratio, its goal and range."""

    name: str
    ours: float
    baseline: float
    unit: str
    ratio: float
    goal: str | None  # a comparison such as ">= 1.0"; None when the issue sets no goal
    meets: bool | None
    reps: int
    ratio_min: float
    ratio_max: float
    ours_reps: list[float] = field(default_factory=list)
    baseline_reps: list[float] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)  # sizes, counts, model configs: how to reproduce
    notes: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # secondary measurements (CPU-time ratio, breakdowns)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_goal(ratio: float, goal: str | None) -> bool | None:
    """Whether ``ratio`` satisfies ``goal`` (``">= 1.5"``, ``"<= 1.15"``, ``"< 0.02"``...)."""
    if goal is None:
        return None
    op, value = goal.split()
    value = float(value)
    return {">=": ratio >= value, "<=": ratio <= value, ">": ratio > value, "<": ratio < value}[op]


def figure(name: str, ours: list[float], baseline: list[float], unit: str, goal: str | None,
           inputs: dict[str, Any], notes: str = "", ratios: list[float] | None = None,
           details: dict[str, Any] | None = None) -> Figure:
    """Build a Figure from per-repetition values; ratio = median of the per-repetition ours/baseline."""
    ratios = ratios if ratios is not None else [o / b for o, b in zip(ours, baseline)]
    ratio = statistics.median(ratios)
    return Figure(
        name=name,
        ours=_round(statistics.median(ours)),
        baseline=_round(statistics.median(baseline)),
        unit=unit,
        ratio=_round(ratio),
        goal=goal,
        meets=check_goal(ratio, goal),
        reps=len(ratios),
        ratio_min=_round(min(ratios)),
        ratio_max=_round(max(ratios)),
        ours_reps=[_round(v) for v in ours],
        baseline_reps=[_round(v) for v in baseline],
        inputs=inputs,
        notes=notes,
        details=details or {},
    )


def _round(x: float) -> float:
    return float(f"{x:.5g}")


def interleave(reps: int, ours: Callable[[int], float], baseline: Callable[[int], float],
               label: str = "") -> tuple[list[float], list[float]]:
    """Run ours and the baseline ``reps`` times each, back to back, alternating which goes first."""
    ours_v, base_v = [], []
    for rep in range(reps):
        order = [("ours", ours), ("baseline", baseline)]
        if rep % 2:
            order.reverse()
        for who, fn in order:
            value = fn(rep)
            (ours_v if who == "ours" else base_v).append(value)
            log(f"{label} rep {rep + 1}/{reps} {who}: {value:.4g}")
    return ours_v, base_v


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process, result) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def median(values: list[float]) -> float:
    return _round(statistics.median(values))


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Page cache
# ---------------------------------------------------------------------------------------------------------


def drop_cache(paths: list[Path]) -> None:
    """Evict ``paths`` from the page cache (os.sync, then POSIX_FADV_DONTNEED per file)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[Path]) -> None:
    """Read every byte of ``paths`` once so that they sit in the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.read(1 << 22):
                pass


# ---------------------------------------------------------------------------------------------------------
# Machine and run description
# ---------------------------------------------------------------------------------------------------------


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Who measured: CPU, cores, memory, load average, library versions, date."""
    import psutil
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("diffusers", "transformers", "webdataset", "safetensors", "prefect"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    info = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "device": device,
        "versions": versions,
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------------------------------------------------
# Options every benchmark script takes
# ---------------------------------------------------------------------------------------------------------


def parser(description: str) -> argparse.ArgumentParser:
    """The common command line: --quick, --reps, --device, --json."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke check)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default: 5, or 2 with --quick)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where models run (default cpu)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here (default bench/.work/)")
    p.add_argument("--keep", action="store_true", help="keep the generated data under bench/.work/")
    return p


def parse_args(description: str, argv=None) -> argparse.Namespace:
    """Parse the common command line and apply ``--device``."""
    args = parser(description).parse_args(argv)
    use_device(args.device)
    return args


def use_device(device: str) -> None:
    """``cpu``: hide GPUs, so the product code's automatic choice (cache ``device: auto``, the trainer) picks
    the CPU like the baselines; ``cuda``: require one."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")


def sync(device: str) -> None:
    """Wait for queued GPU work (a no-op on the CPU), so that a timer stops when the work is done."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def reps_of(args: argparse.Namespace, full: int = 5, quick: int = 2) -> int:
    return args.reps if args.reps else (quick if args.quick else full)


def run_benchmark(name: str, doc: str, run, argv=None) -> None:
    """A benchmark script's ``main``: parse the common command line (described by the first line of
    ``doc``), run ``run(args)`` and ``finish`` with its figures."""
    args = parse_args(doc.splitlines()[0], argv)
    start = time.perf_counter()
    figures = run(args)
    finish(name, figures, args, time.perf_counter() - start)


def finish(name: str, figures: list[Figure], args: argparse.Namespace, seconds: float) -> None:
    """Print the figures and write them as JSON (``--json`` or ``bench/.work/<name>.json``)."""
    out = args.json or WORK / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "quick": bool(args.quick), "device": args.device, "seconds": round(seconds, 1),
            "figures": [f.to_json() for f in figures]}
    out.write_text(json.dumps(data, indent=1))
    for f in figures:
        verdict = {True: "meets", False: "MISSES", None: "no goal"}[f.meets]
        print(f"{f.name}: ours {f.ours:g} {f.unit}, baseline {f.baseline:g} {f.unit}, ratio {f.ratio:g} "
              f"[{f.ratio_min:g}–{f.ratio_max:g}] goal {f.goal or '-'} -> {verdict}")
    print(f"wrote {out} ({seconds:.0f} s)")


def fresh_dir(name: str) -> Path:
    """An empty folder ``bench/.work/<name>`` (replacing an earlier one)."""
    path = WORK / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def temp_dir(prefix: str) -> Path:
    WORK.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=WORK))


def rss_mb() -> float:
    """Current resident set of this process in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """Peak resident set of this process in MiB (``latentmill.trainer.train.peak_rss_mb``: VmHWM on Linux, which
    ``execve`` resets, unlike ``ru_maxrss``, which would floor a child at its parent's size)."""
    from latentmill.trainer.train import peak_rss_mb as peak

    return peak()


# ---------------------------------------------------------------------------------------------------------
# Generated data: latent shards in the cache format (version 3), and images with captions
# ---------------------------------------------------------------------------------------------------------

# A Flux-class 512² sample: latent 16×64×64, T5 77×4096, CLIP pooled 768, all bf16 (~764 KB).
FLUX_512 = {"latent": [16, 64, 64], "text_len": 77, "text_dim": 4096, "pooled_dim": 768, "bucket": [512, 512, 1]}
# The largest image family's sample (issue 32): FLUX.2 dev at 1024², its patchified latent and three stacked
# Mistral layers padded to 512 tokens, no pooled vector (~16 MiB in bf16).
FLUX2_DEV_1024 = {"latent": [128, 64, 64], "text_len": 512, "text_dim": 15360, "pooled_dim": None,
                  "bucket": [1024, 1024, 1], "family": "flux2",
                  "models": {"vae": {"class": "AutoencoderKLFlux2", "fingerprint": "bench"},
                             "text_encoder": {"class": "Mistral3ForConditionalGeneration", "fingerprint": "bench"}}}


def sample_tensors(gen, spec: dict[str, Any], dtype, text_len: int | None = None) -> tuple[dict, dict]:
    """Random (vae, text) tensors of one sample shaped as ``spec`` says (a pooled vector when it has a
    ``pooled_dim``); ``text_len`` overrides L."""
    import torch

    latents = torch.randn(spec["latent"], generator=gen).to(dtype)
    text = {"prompt_embeds": torch.randn(text_len or spec["text_len"], spec["text_dim"], generator=gen).to(dtype)}
    if spec.get("pooled_dim"):
        text["pooled_prompt_embeds"] = torch.randn(spec["pooled_dim"], generator=gen).to(dtype)
    return {"latents": latents}, text


def write_latent_cache(root: Path, num_samples: int, spec: dict[str, Any] = FLUX_512, *, shard_samples: int = 64,
                       seed: int = 0, trimmed: bool = False, pad_to: int | None = None,
                       text_lengths: list[int] | None = None, dtype_name: str = "bfloat16") -> dict[str, Any]:
    """Write a latent cache (format 3) under ``root`` with the cache stage's shard writer: tars, an index
    beside each, unit records and the manifest.

    ``num_samples`` random samples shaped as ``spec`` in shards of ``shard_samples``, one bucket; the manifest
    has the header fields the loader reads. With ``trimmed``, sample i's ``prompt_embeds`` hold
    ``text_lengths[i]`` tokens and the manifest says they are zero-padded to ``pad_to`` at batch time.
    Returns the manifest.
    """
    import torch
    from latentmill.stages.shardio import StageDir, UnitOutput, WorkUnit
    from safetensors.torch import save as st_save

    from latentmill.core.hashing import json_bytes, sha256_bytes, stable_hash

    dtype = getattr(torch, dtype_name)
    stage_dir = StageDir(root, "cache").ensure()
    gen = torch.Generator().manual_seed(seed)
    records = []
    for start in range(0, num_samples, shard_samples):
        count = min(shard_samples, num_samples - start)
        unit = WorkUnit(stable_hash(["bench", seed, start, spec, trimmed, pad_to]), [], {}, count)
        out = UnitOutput(stage_dir, unit)
        for i in range(start, start + count):
            n = text_lengths[i % len(text_lengths)] if text_lengths else None
            vae, text = sample_tensors(gen, spec, dtype, n)
            key = f"s{i:07d}"
            meta = {"source": f"generated/{key}.jpg", "sha256": sha256_bytes(key.encode()), "bucket": spec["bucket"],
                    "caption": f"generated sample {i}"}
            out.add({"__key__": key, "vae.safetensors": st_save(vae), "text.safetensors": st_save(text),
                     "json": json_bytes(meta)}, bucket=spec["bucket"])
        records.append(out.commit(0.0))
    text_len = pad_to or spec["text_len"]
    empty_text = {"prompt_embeds": torch.zeros(1 if trimmed else text_len, spec["text_dim"], dtype=dtype)}
    if spec.get("pooled_dim"):
        empty_text["pooled_prompt_embeds"] = torch.zeros(spec["pooled_dim"], dtype=dtype)
    empty = st_save(empty_text)
    (root / "empty_prompt.safetensors").write_bytes(empty)
    family = spec.get("family", "flux")
    header = {
        "format_version": 3,
        "family": family,
        "fingerprint": stable_hash(["bench", spec, seed]),
        "models": spec.get("models") or {
            "vae": {"class": "AutoencoderKL", "fingerprint": "bench", "scaling_factor": 0.3611, "shift_factor": 0.1159},
            "text_encoder": {"class": "CLIPTextModel", "fingerprint": "bench"},
            "text_encoder_2": {"class": "T5EncoderModel", "fingerprint": "bench"}},
        "dtype": dtype_name,
        "latents": "mean",
        "max_sequence_length": text_len,
        "text": {"trimmed": trimmed, "pad_to": text_len},
        "empty_prompt": {"path": "empty_prompt.safetensors", "sha256": sha256_bytes(empty)},
    }
    if family != "flux":  # a FLUX.1 manifest without streams reads as FLUX.1's; any other family names its own
        from latentmill.stages.families import family_class

        header["streams"] = [stream.to_json() for stream in family_class(family).STREAMS]
    return stage_dir.write_manifest(records, header)


def shard_paths(root: Path, manifest: dict[str, Any]) -> list[Path]:
    return [root / s["path"] for s in manifest["shards"]]


COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "grey", "brown"]
SHAPES = ["circle", "square", "triangle", "stripes", "ring", "cross"]
PLACES = ["on a wooden table", "in a green field", "under a clear sky", "next to a window", "on a beach at sunset",
          "in a quiet library", "on a snowy mountain", "in a busy street market"]
STYLES = ["photo", "watercolor painting", "pencil sketch", "3d render", "oil painting", "pixel art"]
# (width, height) of generated photos: portrait, landscape and square, as a camera or a scraper gives them
PHOTO_SIZES = [(640, 480), (480, 640), (512, 512), (768, 432), (432, 768), (600, 600), (720, 540), (540, 720)]


def make_caption(rng: random.Random) -> str:
    """A caption of 10 to ~40 words; some long, as VLM recaptions are."""
    fg = rng.choice(COLORS)
    caption = f"a {rng.choice(STYLES)} of a {fg} {rng.choice(SHAPES)} {rng.choice(PLACES)}"
    for _ in range(rng.randint(0, 3)):
        caption += f", with a {rng.choice(COLORS)} {rng.choice(SHAPES)} {rng.choice(PLACES)}"
    return caption


def make_images(folder: Path, count: int, seed: int = 0, sizes: list[tuple[int, int]] = PHOTO_SIZES,
                start: int = 0) -> list[Path]:
    """Write ``count`` deterministic JPEG images with sidecar ``.txt`` captions into ``folder``.

    Shapes over a noisy gradient (so JPEG sizes are photo-like, not flat colours); captions of varied length.
    Image ``i`` depends only on (seed, i), so a later call with ``start`` adds new images.
    """
    import numpy as np
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + count):
        rng = random.Random(f"{seed}:{i}")
        width, height = rng.choice(sizes)
        nrng = np.random.default_rng([seed, i])
        base = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * np.array(
            [rng.random(), rng.random(), rng.random()], dtype=np.float32)
        noise = nrng.normal(0, 18, size=(height, width, 3)).astype(np.float32)
        img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for _ in range(rng.randint(1, 4)):
            cx, cy, r = rng.randrange(width), rng.randrange(height), rng.randint(20, min(width, height) // 3)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=tuple(rng.randrange(256) for _ in range(3)))
        caption = make_caption(rng)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        path = folder / f"img{i:06d}.jpg"
        path.write_bytes(buf.getvalue())
        path.with_suffix(".txt").write_text(caption + "\n")
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------

TINY_RECIPE = REPO_ROOT / "data" / "tiny-flux.yaml"
SMALL_RECIPE = BENCH_DIR / "small-flux.yaml"


def model_dir(recipe: Path = TINY_RECIPE) -> Path:
    """The pipeline folder built from a tiny-model ``recipe`` (built once, seed 0, under bench/.work/models)."""
    from latentmill.tiny import ensure_tiny_flux

    name = recipe.stem
    return ensure_tiny_flux(WORK / "models" / name, recipe=recipe, seed=0)


def model_summary(pretrained: Path) -> dict[str, Any]:
    """Parameter counts and key config values of each component (for the figure's inputs)."""
    out: dict[str, Any] = {"pretrained": str(pretrained.relative_to(REPO_ROOT))}
    for comp in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        cfg = json.loads((pretrained / comp / "config.json").read_text())
        keys = {"transformer": ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                                "joint_attention_dim"),
                "vae": ("block_out_channels", "layers_per_block", "latent_channels"),
                "text_encoder": ("hidden_size", "num_hidden_layers", "intermediate_size"),
                "text_encoder_2": ("d_model", "num_layers", "d_ff")}[comp]
        weights = sum(p.stat().st_size for p in (pretrained / comp).glob("*.safetensors"))
        out[comp] = {k: cfg.get(k) for k in keys} | {"params_m": round(weights / 4 / 1e6, 3)}
    return out


def reset_process_caches() -> list[str]:
    """Forget what a long-lived prep process keeps between runs (loaded encoders, cache plans, weight
    fingerprints), so that a timed prep pays what a fresh ``latentmill prep`` process pays (less the imports
    and the Prefect start-up). Returns what it cleared."""
    from latentmill.stages.cache import forget_plans
    from latentmill.stages.families import release_encoders

    from latentmill.core.fingerprints import forget_digests

    return [f"{n} {what}" for n, what in ((release_encoders(), "encoder sets"), (forget_plans(), "cache plans"),
                                          (forget_digests(), "weight digests"))]
