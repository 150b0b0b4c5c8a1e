"""``latentmill sample``: generate from an export or a training checkpoint, and time it the honest way.

What it loads (:func:`load_pipeline`):

* a full export (a Diffusers pipeline folder with ``model_index.json``): ``DiffusionPipeline.from_pretrained``;
* a LoRA export (``pytorch_lora_weights.safetensors``): its base pipeline (``--base``, else ``pretrained`` in
  the ``latentmill.json`` beside it, else the run's ``run.json``), then ``load_lora_weights``;
* a training checkpoint ``step-N/`` (``trainer_state.json``): the base pipeline (``--base``, else the
  ``pretrained`` the run recorded), then the checkpoint's trainable weights: into the transformer (``full``),
  or into a LoRA adapter made as the trainer made it (``lora``). ``model.safetensors`` (strategies none and
  ddp) is read directly; a DCP checkpoint (FSDP2) is read with ``torch.distributed.checkpoint.load`` in this
  one process (no process group), model weights only: the optimizer state is never read.

How it times (:func:`sample`): one *call* is one pipeline call of ``--batch`` images (the prompts taken in
turn, cycling). The first call (warm-up: lazy initialisation, algorithm search, ``--compile``'s compilation)
is timed on its own; then ``--repeat`` K calls give the median and spread (``latentmill.timing``), the
images/s (batch / median call) and s/step (median call / steps: a whole call, text encoding and VAE decode
included, per denoising step). Loading is timed apart from both. Every image of every call is written
(call ``c`` uses seed ``seed + c``) with a grid (one row per call) and ``timing.json``.

On CUDA the pipeline's components load in the dtypes the trainer validates with (bf16; the Wan VAE float32)
and the call runs under bf16 autocast; on the CPU everything is float32.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from latentmill.core.config import ConfigError
from latentmill.timing import steady_state

LORA_FILE = "pytorch_lora_weights.safetensors"
PROVENANCE_FILE = "latentmill.json"


@dataclass
class Loaded:
    """A pipeline ready to sample, and where it came from."""

    pipe: Any
    kind: str  # full-export | lora-export | checkpoint
    source: str
    base: str | None = None
    family: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def parse_size(text: str) -> list[int]:
    """``WxH`` or ``WxHxF`` -> ``[W, H]`` / ``[W, H, F]``."""
    if not re.fullmatch(r"\d+x\d+(x\d+)?", text or ""):
        raise ConfigError(f"--size: expected WxH (image) or WxHxF (video), e.g. 512x512, got {text!r}")
    return [int(v) for v in text.split("x")]


def read_prompts(prompts: list[str] | None, prompts_file: str | Path | None) -> list[str]:
    """``--prompt`` values, then the lines of ``--prompts FILE`` (blank lines skipped)."""
    out = list(prompts or [])
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts: {path} does not exist (one prompt per line)")
        out += [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not out:
        raise ConfigError("give at least one prompt: --prompt TEXT (repeatable) or --prompts FILE")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _recorded_base(*records: dict[str, Any]) -> str | None:
    """The first ``pretrained`` a provenance record or a ``run.json`` (its ``summary``) names."""
    for record in records:
        for where in (record, record.get("provenance") or {}, record.get("summary") or {}):
            if where.get("pretrained"):
                return str(where["pretrained"])
    return None


def _check_base(base: str | None, what: str) -> str:
    from latentmill.preflight import HUB_ID

    if not base:
        raise FileNotFoundError(f"{what} does not name its base pipeline: pass --base PIPELINE_FOLDER_OR_HUB_ID")
    if not Path(base).expanduser().is_dir() and (base.startswith((".", "/", "~")) or not HUB_ID.match(base)):
        raise FileNotFoundError(f"base pipeline {base} (from {what}) does not exist: pass --base "
                                "PIPELINE_FOLDER_OR_HUB_ID")
    return base


def _family(pipeline_class: str) -> str | None:
    from latentmill.trainer.adapters import ADAPTERS

    for family, adapter in ADAPTERS.items():
        if adapter.pipeline_class == pipeline_class:
            return family
    return None


def _from_pretrained(ref: str, device: torch.device) -> tuple[Any, str | None]:
    """The pipeline ``ref`` in this device's dtypes (see the module docstring), and its family."""
    from diffusers import DiffusionPipeline

    from latentmill.stages.families import compute_dtypes

    family = _family(DiffusionPipeline.load_config(ref).get("_class_name", ""))
    extra = {}
    if device.type == "cuda":
        dtypes = compute_dtypes(family or "flux", device)
        extra = {"torch_dtype": {"vae": dtypes["vae"], "default": dtypes["text"]}}
    pipe = DiffusionPipeline.from_pretrained(ref, **extra)
    return pipe, family


def _checkpoint_weights(folder: Path, transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's trainable weights, by the names the transformer's parameters have."""
    from latentmill.trainer.checkpoint import DCP_DIR, MODEL_FILE

    if (folder / MODEL_FILE).is_file():
        from safetensors.torch import load_file

        return load_file(folder / MODEL_FILE)
    if not (folder / DCP_DIR).is_dir():
        raise FileNotFoundError(f"{folder} has neither {MODEL_FILE} nor {DCP_DIR}/: not a complete checkpoint")
    import warnings

    import torch.distributed.checkpoint as dcp

    trainable = {n: torch.empty_like(p, device="cpu", dtype=torch.float32)
                 for n, p in transformer.named_parameters() if p.requires_grad}
    state = {"model": trainable}  # only these keys are read: the optimizer state stays on disk
    with warnings.catch_warnings():  # one process, no process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder / DCP_DIR, no_dist=True)
    return state["model"]


def _load_checkpoint(folder: Path, base: str | None, device: torch.device) -> Loaded:
    from latentmill.trainer.adapter import make_trainable
    from latentmill.trainer.checkpoint import STATE_FILE

    state = _read_json(folder / STATE_FILE)
    run = _read_json(folder.parent.parent / "run.json")  # <run>/checkpoints/step-N
    base = _check_base(base or _recorded_base(state, run), f"checkpoint {folder}")
    mode, cfg = state.get("mode", "full"), state.get("config") or {}
    pipe, family = _from_pretrained(base, device)
    transformer = pipe.transformer
    if mode == "lora":
        from latentmill.trainer.adapters import get_adapter

        make_trainable(transformer, mode="lora", lora_rank=int(cfg.get("lora_rank", 16)),
                       lora_alpha=float(cfg.get("lora_alpha", 16.0)),
                       lora_target_modules=get_adapter(family).targets(cfg.get("lora_target_modules")))
    else:
        transformer.requires_grad_(True)  # full: every parameter is in the checkpoint
    weights = _checkpoint_weights(folder, transformer)
    params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    if set(weights) != set(params):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(f"{folder}: its weights do not fit {base}'s transformer in mode {mode} (missing "
                         f"{missing[:3]}, unexpected {extra[:3]}): pass the --base it was trained from")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])
    transformer.requires_grad_(False).eval()
    return Loaded(pipe, "checkpoint", str(folder), base, family,
                  {"mode": mode, "step": state.get("step"), "format": state.get("format")})


def load_pipeline(source: str | Path, *, base: str | None = None, device: str | torch.device = "cpu") -> Loaded:
    """The pipeline of an export or checkpoint folder (see the module docstring), on ``device``."""
    from latentmill.trainer.checkpoint import STATE_FILE

    device = torch.device(device)
    folder = Path(source).expanduser()
    if (folder / "model_index.json").is_file():
        pipe, family = _from_pretrained(str(folder), device)
        loaded = Loaded(pipe, "full-export", str(folder), None, family)
    elif (folder / LORA_FILE).is_file():
        resolved = folder.resolve()  # <output_dir>/export-lora is a link into train/runs/<run>/export
        records = (_read_json(resolved / PROVENANCE_FILE), _read_json(resolved.parent / "run.json"))
        base = _check_base(base or _recorded_base(*records), f"LoRA export {folder}")
        pipe, family = _from_pretrained(base, device)
        pipe.load_lora_weights(str(folder))
        loaded = Loaded(pipe, "lora-export", str(folder), base, family)
    elif (folder / STATE_FILE).is_file():
        loaded = _load_checkpoint(folder, base, device)
    else:
        raise FileNotFoundError(
            f"{source} is not an export or a checkpoint: pass a pipeline folder (model_index.json), a LoRA "
            f"export ({LORA_FILE}, with --base if it has no {PROVENANCE_FILE}) or a training checkpoint "
            f"<run>/checkpoints/step-N (trainer_state.json)")
    loaded.pipe.to(device)
    loaded.pipe.set_progress_bar_config(disable=True)
    if device.type == "cuda" and getattr(loaded.pipe, "vae", None) is not None:
        from latentmill.trainer.validation import decode_in_own_dtype

        decode_in_own_dtype(loaded.pipe.vae)  # the Wan VAE decodes in float32, outside the bf16 autocast
    return loaded


def _generate(pipe: Any, prompts: list[str], size: list[int], steps: int, seed: int,
              max_sequence_length: int | None, guidance_scale: float | None) -> list[list[Any]]:
    """One pipeline call: per prompt, its frames as PIL images (one frame for an image)."""
    from PIL import Image

    kwargs: dict[str, Any] = {"width": size[0], "height": size[1], "num_inference_steps": steps,
                              "generator": torch.Generator("cpu").manual_seed(seed)}
    if max_sequence_length is not None:
        kwargs["max_sequence_length"] = max_sequence_length
    if guidance_scale is not None:
        kwargs["guidance_scale"] = guidance_scale
    if len(size) == 3:
        frames = pipe(prompt=prompts, num_frames=size[2], output_type="np", **kwargs).frames  # [B, F, H, W, 3]
        return [[Image.fromarray((f * 255).round().astype("uint8")) for f in video] for video in frames]
    # prompt by keyword: Flux2KleinPipeline's first argument is a reference image
    return [[image] for image in pipe(prompt=prompts, output_type="pil", **kwargs).images]


def _compile(pipe: Any, backend: str) -> list[str]:
    """Compile the transformer in place (``nn.Module.compile``: the pipeline keeps the same module)."""
    pipe.transformer.compile(backend=backend)
    return [f"transformer ({type(pipe.transformer).__name__}.forward, torch.compile backend={backend}); the "
            "denoising loop and scheduler step stay eager Python (a few elementwise ops per step)"]


def _dynamo_stats() -> dict[str, int]:
    try:
        from torch._dynamo.utils import counters

        return {"graphs": int(counters["stats"]["unique_graphs"]),
                "graph_breaks": int(sum(counters["graph_break"].values()))}
    except Exception:
        return {}


def _save(rows: list[list[list[Any]]], out: Path) -> tuple[list[str], Path]:
    """Write each image (PNG) or video (animated GIF), and a grid (one row per call; a video's middle frame)."""
    from latentmill.trainer.validation import image_grid

    (out / "images").mkdir(parents=True, exist_ok=True)
    written, grid_rows = [], []
    for call, items in enumerate(rows):
        for j, frames in enumerate(items):
            if len(frames) == 1:
                path = out / "images" / f"c{call:02d}-{j:02d}.png"
                frames[0].save(path, format="PNG")
            else:
                path = out / "images" / f"c{call:02d}-{j:02d}.gif"
                frames[0].save(path, save_all=True, append_images=frames[1:], duration=125, loop=0)
            written.append(str(path))
        grid_rows.append([frames[len(frames) // 2] for frames in items])
    grid = out / "grid.png"
    image_grid(grid_rows).save(grid, format="PNG")
    return written, grid


def sample(source: str | Path, prompts: list[str], *, out: str | Path, base: str | None = None,
           batch: int | None = None, steps: int = 8, size: list[int] | None = None, seed: int = 0,
           repeat: int = 3, compile: bool = False, compile_backend: str = "inductor", device: str = "auto",
           max_sequence_length: int | None = None, guidance_scale: float | None = None) -> dict[str, Any]:
    """Load ``source``, make ``1 + repeat`` calls of ``batch`` images, write them and ``timing.json``.

    Returns the timing report (what ``timing.json`` holds).
    """
    if not prompts:
        raise ConfigError("give at least one prompt: --prompt TEXT (repeatable) or --prompts FILE")
    batch = batch or len(prompts)
    if batch < 1 or steps < 1 or repeat < 0:
        raise ConfigError(f"--batch and --steps must be >= 1 and --repeat >= 0 (got {batch}, {steps}, {repeat})")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    out = Path(out)
    start = time.perf_counter()
    loaded = load_pipeline(source, base=base, device=dev)
    load_s = time.perf_counter() - start
    if size is None:
        from latentmill.trainer.adapters import get_adapter

        video = get_adapter(loaded.family).latent_ndim == 4
        size = [512, 512, 33] if video else [512, 512]
    compiled = _compile(loaded.pipe, compile_backend) if compile else []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None

    def call(index: int) -> list[list[Any]]:
        chosen = [prompts[(index * batch + j) % len(prompts)] for j in range(batch)]
        with torch.inference_mode():
            if autocast is None:
                return _generate(loaded.pipe, chosen, size, steps, seed + index, max_sequence_length,
                                 guidance_scale)
            with autocast:
                return _generate(loaded.pipe, chosen, size, steps, seed + index, max_sequence_length,
                                 guidance_scale)

    stats = steady_state(call, repeat, sync=torch.cuda.synchronize if dev.type == "cuda" else None)
    written, grid = _save(stats.results, out)
    overhead = stats.first_s - stats.median_s if stats.median_s is not None else None
    report = {
        "source": loaded.source, "kind": loaded.kind, "base": loaded.base, "family": loaded.family,
        **loaded.info, "device": str(dev), "batch": batch, "steps": steps, "size": size, "seed": seed,
        "load_s": load_s, **stats.to_json(),
        # the first call's extra time over a steady call: warm-up, plus compiling with --compile
        "first_call_overhead_s": overhead,
        "compile": compile, "compiled": compiled, "compile_s": overhead if compile else None,
        **({"dynamo": _dynamo_stats()} if compile else {}),
        "images_per_s": stats.per_second(batch), "s_per_step": stats.median_s / steps if stats.median_s else None,
        "images": written, "grid": str(grid),
    }
    (out / "timing.json").write_text(json.dumps(report, indent=2))
    return report


def format_report(report: dict[str, Any]) -> str:
    """The lines ``latentmill sample`` prints."""
    base = f" on {report['base']}" if report.get("base") else ""
    lines = [f"loaded {report['kind']} {report['source']}{base} on {report['device']} in {report['load_s']:.2f} s",
             f"first call (warm-up{', compile' if report['compile'] else ''}): {report['first_call_s']:.3f} s"]
    if report["compile"]:
        lines.append(f"compiled: {'; '.join(report['compiled'])}")
        if report["compile_s"] is not None:
            lines.append(f"compiling took ~{report['compile_s']:.2f} s (first call minus a steady call)")
    if report["median_s"] is not None:
        lines.append(f"steady state over {report['repeats']} calls of {report['batch']} images, {report['steps']} "
                     f"steps: median {report['median_s']:.3f} s (min {report['min_s']:.3f}, max "
                     f"{report['max_s']:.3f}), {report['images_per_s']:.3f} images/s, "
                     f"{report['s_per_step']:.4f} s/step")
    else:
        lines.append("--repeat 0: no steady-state figures (the first call is never one)")
    lines.append(f"{len(report['images'])} images and the grid in {Path(report['grid']).parent}")
    return "\n".join(lines)
