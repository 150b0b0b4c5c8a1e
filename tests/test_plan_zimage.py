"""``latentmill plan`` for Z-Image-Turbo from the published configs shipped in configs/models/Z-Image-Turbo."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from latentmill.plan import plan_config, shipped_models_dir

pytestmark = pytest.mark.slow

# Z-Image-Turbo's transformer: "6B parameters" (the model card; the Z-Image report: 6.15B), counted here from the
# shipped config on the meta device
ZIMAGE_TURBO_PARAMS = 6_154_908_736
LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                "feed_forward.w2", "feed_forward.w3")  # of the 30 main layers (configs/z-image-lora.yaml)


def _meta() -> torch.nn.Module:
    """The unmodified Diffusers transformer on meta, straight from the shipped config (no latentmill code)."""
    from diffusers import ZImageTransformer2DModel as cls

    with torch.device("meta"):
        return cls.from_config(cls.load_config(str(shipped_models_dir() / "Z-Image-Turbo"), subfolder="transformer"))


def test_the_shipped_config_builds_the_published_size():
    model = _meta()
    total = sum(p.numel() for p in model.parameters())
    assert total == ZIMAGE_TURBO_PARAMS
    assert 6.0e9 <= total < 6.2e9  # "6B"
    assert (len(model.layers), len(model.noise_refiner), len(model.context_refiner)) == (30, 2, 2)
    assert model.cap_embedder[1].in_features == 2560  # Qwen3-4B's hidden size


def test_full_fsdp2_on_8_ranks_counts_the_real_shards():
    result = plan_config("configs/z-image-full.yaml", nproc=8, nnodes=1)
    assert not dist.is_initialized()
    assert result["total_params"] == result["trainable_params"] == ZIMAGE_TURBO_PARAMS
    assert (result["world_size"], result["mesh"], result["config"]["strategy"]) == (8, [8], "fsdp2")
    r = result["per_rank"]
    rank0 = sum(math.ceil(p.shape[0] / 8) * (p.numel() // p.shape[0]) for p in _meta().parameters())
    assert r["params_bytes"] == rank0 * 4  # float32 masters, rank 0's dim-0 shards
    assert r["grads_bytes"] == r["params_bytes"] and r["optimizer_bytes"] == 2 * r["params_bytes"]
    assert result["fits"] and result["config"]["shipped_configs"]


def test_lora_ddp_counts_the_community_targets():
    result = plan_config("configs/z-image-lora.yaml", ["parallel.strategy=ddp"], nproc=8)
    assert not dist.is_initialized()
    model = _meta()
    lora = sum(32 * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith("layers.")
               and any(name.endswith("." + t) for t in LORA_TARGETS))
    assert result["trainable_params"] == lora == 70_041_600  # 30 layers x (4 attention + 3 SwiGLU) at rank 32
    assert result["total_params"] == ZIMAGE_TURBO_PARAMS + lora
    r = result["per_rank"]
    assert result["config"]["strategy"] == "ddp"
    assert r["params_bytes"] == ZIMAGE_TURBO_PARAMS * 2 + lora * 4  # bf16 base replica + float32 LoRA
    assert r["optimizer_bytes"] == 2 * lora * 4 and r["gathered_bytes"] == 0
