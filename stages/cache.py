"""Cache: decode, resize and crop each image once, encode it with the VAE, encode its caption.

Output per sample, as safetensors inside the tar (never pickle):

    <key>.vae.safetensors    latents_CHW, normalised as (z - shift_factor) * scaling_factor
    <key>.text.safetensors   prompt_embeds_LD (T5 sequence), pooled_prompt_embeds_D (CLIP pooled)
    <key>.json               metadata: source, bucket, crop, caption, ...

The manifest records which VAE / text encoders (fingerprints), dtype and sequence length produced the
latents; the trainer refuses latents that do not match its recipe.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch
from PIL import Image
from safetensors.torch import save as safetensors_save

from latentmill.models import (
    ModelConfig,
    cached_model_fingerprints,
    component_source,
    read_component_config,
    tokenizer_source,
)
from stages.shardio import (
    StageDir,
    UnitOutput,
    WorkUnit,
    json_bytes,
    read_shard,
    sample_json,
    stable_hash,
    units_per_shard,
)

STAGE = "cache"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IMAGE_MEMBERS = ("jpg", "png", "webp", "bmp")


@dataclass
class CacheConfig:
    """How latents and text embeddings are computed and stored."""

    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # storage dtype of every tensor
    batch_size: int = 8  # images per VAE call (shapes are uniform inside a bucket shard)
    max_sequence_length: int = 512  # T5 tokens, as FluxPipeline's max_sequence_length
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def validate(self) -> None:
        from latentmill.config import ConfigError

        if self.batch_size < 1:
            raise ConfigError(f"cache.batch_size: must be >= 1, got {self.batch_size}")
        if self.max_sequence_length < 1:
            raise ConfigError(f"cache.max_sequence_length: must be >= 1, got {self.max_sequence_length}")


def _device(cfg: CacheConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


class FluxEncoders:
    """The VAE and both text encoders of a Flux-class pipeline, loaded once per worker."""

    def __init__(self, model: ModelConfig, device: torch.device):
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        self.device = device
        # Encoders run in bf16 on GPU, float32 on CPU (CPU bf16 matmuls are slow and less exact).
        self.compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

        def load(cls, name):
            src = component_source(model, name)
            return cls.from_pretrained(src.path, **src.kwargs(), torch_dtype=self.compute_dtype).to(device).eval()

        def load_tokenizer(encoder):
            src = tokenizer_source(model, encoder)
            return AutoTokenizer.from_pretrained(src.path, **src.kwargs())

        self.vae = load(AutoencoderKL, "vae")
        self.text_encoder = load(CLIPTextModel, "text_encoder")
        self.text_encoder_2 = load(T5EncoderModel, "text_encoder_2")
        self.tokenizer = load_tokenizer("text_encoder")
        self.tokenizer_2 = load_tokenizer("text_encoder_2")
        self.scaling_factor = float(self.vae.config.scaling_factor)
        self.shift_factor = float(self.vae.config.shift_factor or 0.0)
        self.lock = threading.Lock()  # one forward at a time per loaded model set

    @torch.no_grad()
    def encode_images(self, pixels_BCHW: torch.Tensor) -> torch.Tensor:
        """Normalised VAE latents (the distribution's mean) of images in [-1, 1]."""
        with self.lock:
            x = pixels_BCHW.to(self.device, self.compute_dtype)
            mean = self.vae.encode(x).latent_dist.mean
        return ((mean.float() - self.shift_factor) * self.scaling_factor).cpu()

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 sequence embeddings [B, L, D], CLIP pooled embeddings [B, D]) as FluxPipeline computes them."""
        clip_ids = self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        t5_ids = self.tokenizer_2(captions, padding="max_length", max_length=max_sequence_length,
                                  truncation=True, return_tensors="pt").input_ids
        with self.lock:
            pooled_BD = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
            embeds_BLD = self.text_encoder_2(t5_ids.to(self.device), output_hidden_states=False)[0]
        return embeds_BLD.float().cpu(), pooled_BD.float().cpu()


_encoders: dict[tuple, FluxEncoders] = {}
_encoders_lock = threading.Lock()


def get_encoders(model: ModelConfig, cfg: CacheConfig) -> FluxEncoders:
    """Load the encoders once per process (threads of one worker share them)."""
    key = (model.pretrained, model.vae, model.text_encoder, model.text_encoder_2, str(_device(cfg)))
    with _encoders_lock:
        if key not in _encoders:
            _encoders[key] = FluxEncoders(model, _device(cfg))
        return _encoders[key]


def fingerprint(cfg: CacheConfig, model_prints: dict[str, str]) -> dict[str, Any]:
    """What decides a latent besides the pixels: models, storage dtype, sequence length, format."""
    return {"stage": STAGE, "version": 1, "models": model_prints, "dtype": cfg.dtype,
            "max_sequence_length": cfg.max_sequence_length, "resample": "lanczos"}


def plan(cfg: CacheConfig, model: ModelConfig, upstream: StageDir) -> list[WorkUnit]:
    """One unit per bucket shard, keyed by the shard's hash and the models' fingerprints."""
    return units_per_shard(upstream, fingerprint(cfg, cached_model_fingerprints(model)))


def load_pixels(data: bytes, crop: dict[str, int], bucket: list[int]) -> torch.Tensor:
    """Decode, resize to cover, crop to the bucket: a [3, H, W] tensor in [-1, 1]."""
    width, height = bucket[0], bucket[1]
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB")
        img = img.resize((crop["resize_width"], crop["resize_height"]), Image.Resampling.LANCZOS)
        img = img.crop((crop["left"], crop["top"], crop["left"] + width, crop["top"] + height))
        raw = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return raw.view(height, width, 3).permute(2, 0, 1).float().div(127.5).sub(1.0)


def _tensor_bytes(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> bytes:
    return safetensors_save({k: v.to(dtype).contiguous() for k, v in tensors.items()})


def process(cfg: CacheConfig, model: ModelConfig, unit: WorkUnit, out: UnitOutput) -> None:
    """Encode every sample of one bucket shard; undecodable images are quarantined."""
    encoders = get_encoders(model, cfg)
    dtype = DTYPES[cfg.dtype]
    batch: list[tuple[dict, dict, torch.Tensor]] = []

    def flush() -> None:
        if not batch:
            return
        latents_BCHW = encoders.encode_images(torch.stack([p for _, _, p in batch]))
        embeds_BLD, pooled_BD = encoders.encode_text([m["caption"] for _, m, _ in batch],
                                                     cfg.max_sequence_length)
        for i, (sample, meta, _) in enumerate(batch):
            out.add({
                "__key__": sample["__key__"],
                "vae.safetensors": _tensor_bytes({"latents": latents_BCHW[i]}, dtype),
                "text.safetensors": _tensor_bytes(
                    {"prompt_embeds": embeds_BLD[i], "pooled_prompt_embeds": pooled_BD[i]}, dtype),
                "json": json_bytes(meta),
            }, bucket=meta["bucket"])
        batch.clear()

    for sample in read_shard(unit.payload["shard"]):
        meta = sample_json(sample)
        member = next((m for m in IMAGE_MEMBERS if m in sample), None)
        try:
            if member is None:
                raise ValueError("sample has no image member")
            pixels = load_pixels(sample[member], meta["crop"], meta["bucket"])
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            out.quarantine(sample["__key__"], meta.get("source", "?"), f"cannot decode pixels: {err}")
            continue
        batch.append((sample, meta, pixels))
        if len(batch) >= cfg.batch_size:
            flush()
    flush()


def manifest_header(cfg: CacheConfig, model: ModelConfig) -> dict[str, Any]:
    """The models, dtype and sequence length every latent of this cache was made with (loads no model)."""
    prints = cached_model_fingerprints(model)
    vae_config = read_component_config(component_source(model, "vae"))
    models = {}
    for name in prints:
        config = read_component_config(component_source(model, name))
        cls = config.get("_class_name") or (config.get("architectures") or ["?"])[0]
        models[name] = {"class": cls, "fingerprint": prints[name]}
    models["vae"]["scaling_factor"] = float(vae_config.get("scaling_factor", 1.0))
    models["vae"]["shift_factor"] = float(vae_config.get("shift_factor") or 0.0)
    return {"fingerprint": stable_hash(fingerprint(cfg, prints)), "models": models,
            "dtype": cfg.dtype, "max_sequence_length": cfg.max_sequence_length}
