"""Model families: which VAE and text encoders a family caches, and how they are called.

Each family is a small class over unmodified Diffusers / Transformers components, loaded once per worker:

- ``flux`` (Flux-class image models): ``AutoencoderKL`` latents normalised ``(z - shift) * scale``; CLIP
  pooled embedding + T5 sequence embeddings, computed exactly as ``FluxPipeline.encode_prompt``.
- ``wan`` (Wan-class video models): ``AutoencoderKLWan`` latents normalised ``(z - mean) / std`` per channel;
  UMT5 sequence embeddings with the attention mask, as ``WanPipeline`` computes them.

Adding a family = one class with ``COMPONENTS``, ``load``, ``encode_pixels`` and ``encode_text``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig, component_source, read_component_config, tokenizer_source

# model_index.json `_class_name` -> family
PIPELINE_FAMILIES = {"FluxPipeline": "flux", "WanPipeline": "wan"}


def detect_family(model: ModelConfig) -> str:
    """The family named by the recipe, or read from the pipeline's ``model_index.json``."""
    if model.family != "auto":
        return model.family
    root = Path(model.pretrained)
    if root.is_dir():
        index = json.loads((root / "model_index.json").read_text())
    else:
        from huggingface_hub import hf_hub_download

        index = json.loads(Path(hf_hub_download(model.pretrained, "model_index.json")).read_text())
    name = index.get("_class_name", "")
    if name not in PIPELINE_FAMILIES:
        raise ConfigError(f"model.family: cannot tell the family of a {name or 'unknown'} pipeline; set "
                          f"model.family to one of {', '.join(repr(f) for f in FAMILIES)}")
    return PIPELINE_FAMILIES[name]


def compute_dtypes(family: str, device: torch.device) -> dict[str, torch.dtype]:
    """The dtype the ``vae`` and the ``text`` encoders of ``family`` run in on ``device``: bf16 on GPU,
    float32 on CPU (CPU bf16 matmuls are slow and less exact); the Wan VAE in float32 everywhere (its
    causal 3-D convs are sensitive to bf16). Part of the cache's component keys (``latentmill.stages.cache``)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"vae": torch.float32 if family == "wan" else dtype, "text": dtype}


class _Encoders:
    """Shared plumbing: device, dtype, one lock per loaded model set."""

    COMPONENTS: ClassVar[tuple[str, ...]]
    name: ClassVar[str]

    def __init__(self, model: ModelConfig, device: torch.device):
        self.model = model
        self.device = device
        self.compute_dtype = compute_dtypes(self.name, device)["text"]  # (and the Flux VAE's)
        self.lock = threading.Lock()  # one forward at a time per loaded model set

    def _load(self, cls, name: str):
        src = component_source(self.model, name)
        module = cls.from_pretrained(src.path, **src.kwargs(), torch_dtype=self.compute_dtype)
        return module.to(self.device).eval()

    def _tokenizer(self, encoder: str):
        from transformers import AutoTokenizer

        src = tokenizer_source(self.model, encoder)
        return AutoTokenizer.from_pretrained(src.path, **src.kwargs())


class FluxEncoders(_Encoders):
    """AutoencoderKL + CLIP (pooled) + T5 (sequence), as FluxPipeline uses them."""

    name = "flux"
    COMPONENTS = ("vae", "text_encoder", "text_encoder_2")
    pooled = True

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel, T5EncoderModel

        self.vae = self._load(AutoencoderKL, "vae")
        self.text_encoder = self._load(CLIPTextModel, "text_encoder")
        self.text_encoder_2 = self._load(T5EncoderModel, "text_encoder_2")
        self.tokenizer = self._tokenizer("text_encoder")
        self.tokenizer_2 = self._tokenizer("text_encoder_2")
        if device.type == "cuda":
            # encode() then runs one image at a time: peak memory of one 1024² image, not of a batch of 16
            self.vae.enable_slicing()
        self.scaling_factor = float(self.vae.config.scaling_factor)
        self.shift_factor = float(self.vae.config.shift_factor or 0.0)

    @torch.no_grad()
    def encode_pixels(self, pixels_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the normalised latent distribution of images in [-1, 1]."""
        with self.lock:
            dist = self.vae.encode(pixels_BCHW.to(self.device, self.compute_dtype)).latent_dist
        mean = (dist.mean.float() - self.shift_factor) * self.scaling_factor
        return mean.cpu(), (dist.std.float() * self.scaling_factor).cpu()

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """T5 ``prompt_embeds`` [B, L, D] with real lengths, CLIP ``pooled_prompt_embeds`` [B, D]."""
        clip_ids = self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        t5 = self.tokenizer_2(captions, padding="max_length", max_length=max_sequence_length,
                              truncation=True, return_tensors="pt")
        with self.lock:
            pooled_BD = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
            # FluxPipeline runs T5 without an attention mask: every position sees the padding.
            embeds_BLD = self.text_encoder_2(t5.input_ids.to(self.device), output_hidden_states=False)[0]
        return {"prompt_embeds": embeds_BLD.float().cpu(), "lengths": t5.attention_mask.sum(1).tolist(),
                "pooled_prompt_embeds": pooled_BD.float().cpu()}


class WanEncoders(_Encoders):
    """AutoencoderKLWan + UMT5, as WanPipeline uses them (masked text encoder, zero padding)."""

    name = "wan"
    COMPONENTS = ("vae", "text_encoder")
    pooled = False

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers import AutoencoderKLWan
        from transformers import UMT5EncoderModel

        # The Wan VAE runs in float32 even on GPU: its causal 3-D convs are sensitive to bf16. It encodes
        # 4 frames at a time with a feature cache, so a clip's activations do not grow with its length, but
        # they do grow with the batch: ``encode_pixels`` slices by sample.
        # Not tiled: tiles blended at their seams would give other latents than the whole-frame encode.
        self.vae = AutoencoderKLWan.from_pretrained(
            component_source(model, "vae").path, **component_source(model, "vae").kwargs(),
            torch_dtype=compute_dtypes("wan", device)["vae"]).to(device).eval()
        self.text_encoder = self._load(UMT5EncoderModel, "text_encoder")
        self.tokenizer = self._tokenizer("text_encoder")
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def encode_pixels(self, pixels_BCFHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the normalised latent distribution of clips in [-1, 1], encoded one clip at a time.

        Sliced by sample: only one clip is on the device (in float32) and in the encoder at once, so the
        peak memory is one clip's (its pixels and 4 frames of activations at a time), whatever
        ``cache.batch_size``. A batch of 4 81-frame 720p clips in float32 alone is 3.6 GB, and the
        activations and (on GPU) convolution workspaces of a batched encode grow with it. Diffusers'
        ``enable_slicing()`` also loops over samples, but only after the whole batch was moved to the device.
        Each clip's latents are those of encoding it alone, bit for bit (no tiles, no seams).
        """
        means, stds = [], []
        for clip_1CFHW in pixels_BCFHW.split(1):
            with self.lock:  # per clip: another thread's batch may take turns
                dist = self.vae.encode(clip_1CFHW.to(self.device, torch.float32)).latent_dist
            means.append(dist.mean.float().cpu())
            stds.append(dist.std.float().cpu())
            del dist  # this clip's device tensors go before the next clip is moved over
        mean = (torch.cat(means) - self.latents_mean) / self.latents_std
        return mean, torch.cat(stds) / self.latents_std

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """UMT5 ``prompt_embeds`` [B, L, D] (zero beyond each real length), as WanPipeline computes them."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(c) for c in captions], padding="max_length",
                                max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        with self.lock:
            hidden = self.text_encoder(inputs.input_ids.to(self.device),
                                       inputs.attention_mask.to(self.device)).last_hidden_state
        lengths = inputs.attention_mask.gt(0).sum(1).tolist()
        embeds = hidden.float().cpu()
        for i, n in enumerate(lengths):
            embeds[i, n:] = 0  # WanPipeline keeps the real tokens and pads with zeros
        return {"prompt_embeds": embeds, "lengths": lengths}


FAMILIES: dict[str, type[_Encoders]] = {"flux": FluxEncoders, "wan": WanEncoders}


def family_components(family: str) -> tuple[str, ...]:
    """The components whose outputs a family's cache stores."""
    return FAMILIES[family].COMPONENTS


def describe_components(model: ModelConfig, family: str) -> dict[str, dict[str, Any]]:
    """Class name of each cached component and the VAE normalisation, without loading any weights."""
    out = {}
    for name in family_components(family):
        config = read_component_config(component_source(model, name))
        out[name] = {"class": config.get("_class_name") or (config.get("architectures") or ["?"])[0]}
    vae = read_component_config(component_source(model, "vae"))
    if family == "flux":
        out["vae"].update(scaling_factor=float(vae.get("scaling_factor", 1.0)),
                          shift_factor=float(vae.get("shift_factor") or 0.0))
    else:
        out["vae"].update(latents_mean=list(vae["latents_mean"]), latents_std=list(vae["latents_std"]))
    return out


# The classes each family's encoders are built from (see FluxEncoders / WanEncoders).
_CLASS_IMPORTS = {"flux": (("diffusers", "AutoencoderKL"), ("transformers", "CLIPTextModel"),
                           ("transformers", "T5EncoderModel"), ("transformers", "AutoTokenizer")),
                  "wan": (("diffusers", "AutoencoderKLWan"), ("transformers", "UMT5EncoderModel"),
                          ("transformers", "AutoTokenizer"))}


def import_encoder_classes(family: str) -> None:
    """Import the classes a family's encoders are built from, without loading any weights.

    Diffusers' and transformers' lazy modules take seconds to import (most of a small refresh's cache stage
    on a CPU). The CLI imports them while Prefect's API server boots, a wait it has anyway, so the cache
    stage does not import them afterwards.
    """
    import importlib

    for module, name in _CLASS_IMPORTS.get(family, ()):
        getattr(importlib.import_module(module), name)


_encoders: dict[tuple, _Encoders] = {}
_encoders_lock = threading.Lock()


def get_encoders(model: ModelConfig, family: str, device: torch.device) -> _Encoders:
    """Load a family's encoders once per process (the threads of one worker share them)."""
    key = (family, model.pretrained, model.vae, model.text_encoder, model.text_encoder_2, str(device))
    with _encoders_lock:
        if key not in _encoders:
            _encoders[key] = FAMILIES[family](model, device)
        return _encoders[key]


def release_encoders() -> int:
    """Forget every encoder set this process loaded (the memory goes once nothing else holds them);
    returns how many sets there were."""
    with _encoders_lock:
        count = len(_encoders)
        _encoders.clear()
    return count


# ---------------------------------------------------------------------------------------------------------
# Where the encoders run: the device class a cache records, and deterministic mode on CUDA
# ---------------------------------------------------------------------------------------------------------

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
