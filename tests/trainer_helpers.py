"""Test helpers for the trainer room: a tiny Flux transformer saved like a pipeline, and fake latent caches.

The fake cache follows the cache stage's contract exactly (manifest.json + one-bucket webdataset tars with
``k.vae.safetensors``, ``k.text.safetensors``, ``k.json``), so the trainer is tested through its real
reading path.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import webdataset as wds
from safetensors.torch import save as save_safetensors

TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
    guidance_embeds=True,
)
TEXT_DIM, POOLED_DIM, SEQ_LEN = 32, 32, 8


def build_tiny_transformer(root: str | Path, seed: int = 0) -> Path:
    """Save a random tiny ``FluxTransformer2DModel`` to ``<root>/transformer``; return ``root``."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    FluxTransformer2DModel(**TINY_TRANSFORMER).save_pretrained(Path(root) / "transformer")
    return Path(root)


def write_fake_cache(
    cache_dir: str | Path,
    buckets: dict[tuple[int, int, int], int],
    *,
    seed: int = 0,
    shards_per_bucket: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seq_len: int = SEQ_LEN,
    text_dim: int = TEXT_DIM,
    pooled_dim: int = POOLED_DIM,
    channels: int = 16,
    smooth: bool = False,
) -> dict:
    """Write a cache-stage output: ``buckets`` maps [width, height, frames] -> sample count. Returns the manifest.

    Latents are [channels, H/8, W/8] random normal (``smooth``: one random value per channel, constant over
    space, which a tiny model can memorise in a few dozen steps); text embeddings random normal; keys
    ``s00000``... are unique over the whole cache.
    """
    cache_dir = Path(cache_dir)
    (cache_dir / "shards").mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards, n = [], 0
    for bucket, count in buckets.items():
        width, height, frames = bucket
        per_shard = -(-count // shards_per_bucket)
        for start in range(0, count, per_shard):
            buf = io.BytesIO()
            writer = wds.TarWriter(buf, mtime=0, encoder=False)
            in_shard = min(per_shard, count - start)
            for _ in range(in_shard):
                key = f"s{n:05d}"
                if smooth:
                    latents = torch.randn(channels, 1, 1, generator=gen).expand(-1, height // 8, width // 8)
                else:
                    latents = torch.randn(channels, height // 8, width // 8, generator=gen)
                latents = latents.to(dtype)
                prompt = torch.randn(seq_len, text_dim, generator=gen).to(dtype)
                pooled = torch.randn(pooled_dim, generator=gen).to(dtype)
                meta = {"key": key, "bucket": list(bucket), "caption": f"caption {n}"}
                writer.write(
                    {
                        "__key__": key,
                        "vae.safetensors": save_safetensors({"latents": latents.contiguous()}),
                        "text.safetensors": save_safetensors(
                            {
                                "prompt_embeds": prompt.contiguous(),
                                "pooled_prompt_embeds": pooled.contiguous(),
                            }
                        ),
                        "json": json.dumps(meta).encode(),
                    }
                )
                n += 1
            writer.close()
            data = buf.getvalue()
            sha = hashlib.sha256(data).hexdigest()
            name = f"cache-{sha[:8]}.tar"
            (cache_dir / "shards" / name).write_bytes(data)
            shards.append(
                {
                    "name": name,
                    "path": f"shards/{name}",
                    "sha256": sha,
                    "samples": in_shard,
                    "bucket": list(bucket),
                }
            )
    manifest = {
        "stage": "cache",
        "format_version": 1,
        "fingerprint": hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest(),
        "models": {
            "vae": {
                "class": "AutoencoderKL",
                "fingerprint": "0" * 64,
                "scaling_factor": 0.3611,
                "shift_factor": 0.1159,
            },
            "text_encoder": {"class": "CLIPTextModel", "fingerprint": "1" * 64},
            "text_encoder_2": {"class": "T5EncoderModel", "fingerprint": "2" * 64},
        },
        "dtype": str(dtype).removeprefix("torch."),
        "max_sequence_length": seq_len,
        "shards": shards,
    }
    (cache_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def read_metrics(train_dir: str | Path) -> list[dict]:
    """The per-step records of ``<train_dir>/metrics.jsonl``."""
    text = (Path(train_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run torch on ``n`` intra-op threads (tiny models are faster and steadier so on a shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
