"""Sharded loading (issue 16, item 2): each FSDP2 rank fills only its own rows, equal to today's path.

``load_for_training`` builds the transformer with its parameters on the meta device, shards it, and fills
every rank's shards from the checkpoint's safetensors ranges (or, for weights that are not safetensors, from
rank 0's broadcast). On 2 gloo ranks, for tiny Flux and Wan transformers, full and LoRA, every rank's local
shards and buffers must equal, bit for bit, those of today's path (``adapter.load`` on CPU, then
``parallelize``) with the same init seed, and the global RNG must continue identically after the load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer_helpers import TINY_TRANSFORMER, TINY_WAN_TRANSFORMER

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

WORKER = """
import json, os, sys
import torch
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.config import ParallelConfig, TrainerConfig
from latentmill.trainer.model_load import load_for_training
from latentmill.trainer.parallel import init_distributed, parallelize

torch.set_num_threads(1)
out, cases = sys.argv[1], json.loads(sys.argv[2])
parallel = ParallelConfig(strategy="fsdp2")
ctx = init_distributed(parallel)
results = []
for family, mode, folder in cases:
    adapter = get_adapter(family)
    cfg = TrainerConfig(mode=mode, lora_rank=4)
    # today's path (train.py before this change), then the global RNG's next draws
    torch.manual_seed(1234)
    old = adapter.load(folder, mode=mode, device="cpu", lora_rank=4, lora_alpha=cfg.lora_alpha,
                       lora_target_modules=cfg.lora_target_modules, base_dtype=torch.float32)
    parallelize(old, parallel, ctx, blocks=adapter.blocks(old))
    rng_old = torch.rand(4)
    new, model = load_for_training(adapter, folder, cfg=cfg, parallel=parallel, ctx=ctx, init_seed=1234)
    rng_new = torch.rand(4)
    old_params = dict(old.named_parameters())
    old_buffers = dict(old.named_buffers())
    differ, rows = [], 0
    for name, p in new.named_parameters():
        a, b = p.to_local(), old_params[name].to_local()
        rows += a.shape[0] if a.ndim else 0
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b) or p.requires_grad != old_params[name].requires_grad:
            differ.append(name)
    differ_buffers = [n for n, b in new.named_buffers() if b.dtype != old_buffers[n].dtype or not torch.equal(b, old_buffers[n])]
    lora_sum = sum(float(p.to_local().abs().sum()) for n, p in new.named_parameters() if "lora_A" in n)
    results.append({"case": [family, mode, folder], "params": len(old_params), "differ": differ,
                    "buffers": sorted(old_buffers), "differ_buffers": differ_buffers, "rows": rows,
                    "same_as_model": model is new, "config_same": dict(new.config) == dict(old.config), "rng_same": bool(torch.equal(rng_old, rng_new)),
                    "lora_abs_sum": lora_sum, "all_dtensor": all(hasattr(p, "to_local") for p in new.parameters())})
    del old, new, model
json.dump(results, open(f"{out}-{ctx.rank}.json", "w"))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""


def run_ranks(tmp_path: Path, cases: list[list[str]], nproc: int = 2) -> list[list[dict]]:
    """Run the worker on ``nproc`` gloo ranks; each rank's results."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stderr.txt", "w") as err:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", str(tmp_path / "worker.py"), str(tmp_path / "out"),
                               json.dumps(cases)], cwd=REPO_ROOT, env=env, stdout=err, stderr=err, timeout=300)
    assert done.returncode == 0, (tmp_path / "stderr.txt").read_text()[-4000:]
    return [json.loads((tmp_path / f"out-{rank}.json").read_text()) for rank in range(nproc)]


def save(model_cls, config: dict, folder: Path, **kwargs) -> str:
    torch.manual_seed(0)
    model_cls(**config).save_pretrained(folder / "transformer", **kwargs)
    return str(folder)


def test_each_rank_fills_its_shards_like_todays_path(tmp_path):
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    # Flux as an indexed, many-file checkpoint; Wan as one file; Flux again as .bin (rank 0 reads, broadcasts)
    flux = save(FluxTransformer2DModel, TINY_TRANSFORMER, tmp_path / "flux", max_shard_size="40KB")
    wan = save(WanTransformer3DModel, TINY_WAN_TRANSFORMER, tmp_path / "wan")
    flux_bin = save(FluxTransformer2DModel, TINY_TRANSFORMER, tmp_path / "flux-bin", safe_serialization=False)
    assert len(list((tmp_path / "flux" / "transformer").glob("*.safetensors"))) > 2
    assert (tmp_path / "flux" / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert not list((tmp_path / "flux-bin" / "transformer").glob("*.safetensors"))
    cases = [[family, mode, folder] for family, folder in (("flux", flux), ("wan", wan), ("flux", flux_bin))
             for mode in ("full", "lora")]
    ranks = run_ranks(tmp_path / "run", cases)
    for rank, results in enumerate(ranks):
        for result in results:
            family, mode, folder = result["case"]
            assert result["differ"] == [], (rank, result)
            assert result["differ_buffers"] == [], (rank, result)
            assert result["params"] > 40 and result["all_dtensor"] and result["same_as_model"]
            assert result["config_same"], (rank, result)  # the export writes it
            assert result["rng_same"], (rank, result)  # the LoRA draws consumed the same RNG as today's path
            if mode == "lora":
                assert result["lora_abs_sum"] > 0  # drawn, not left at zero
            if family == "wan":  # the rotary tables: non-persistent, recomputed, equal to from_pretrained's
                assert result["buffers"] == ["rope.freqs_cos", "rope.freqs_sin"]
    # the two ranks hold different rows, together every row once (Wan's [1, 6, D] table: all on rank 0)
    for case in range(len(cases)):
        assert ranks[0][case]["rows"] >= ranks[1][case]["rows"] > 0


def test_bf16_base_keeps_wans_fp32_modules_and_matches_from_pretrained(tmp_path):
    """LoRA on a bfloat16 base (CUDA's default), one process: dtypes and values equal ``load_transformer``'s,
    Wan's ``scale_shift_table`` parameters included (kept float32 by their own name)."""
    from diffusers import WanTransformer3DModel
    from latentmill.trainer.adapters import get_adapter
    from latentmill.trainer.model_load import trainable_skeleton

    wan = save(WanTransformer3DModel, TINY_WAN_TRANSFORMER, tmp_path / "wan")
    adapter = get_adapter("wan")
    torch.manual_seed(5)
    ref = adapter.load(wan, mode="lora", lora_rank=4, base_dtype=torch.bfloat16)
    torch.manual_seed(5)
    skeleton, initial = trainable_skeleton(adapter, wan, mode="lora", lora_rank=4, base_dtype=torch.bfloat16)
    ref_params = dict(ref.named_parameters())
    assert {n: p.dtype for n, p in skeleton.named_parameters()} == {n: p.dtype for n, p in ref_params.items()}
    assert ref_params["scale_shift_table"].dtype == torch.float32
    assert ref_params["blocks.0.attn1.to_q.base_layer.weight"].dtype == torch.bfloat16
    assert all(p.is_meta for p in skeleton.parameters()) and all(b.is_meta for b in skeleton.buffers())
    lora = {n for n, p in ref_params.items() if p.requires_grad}
    assert lora and lora | {"rope.freqs_cos", "rope.freqs_sin"} == set(initial)
    for name in lora:
        assert torch.equal(initial[name], ref_params[name]), name
    for name, buffer in ref.named_buffers():
        assert initial[name].dtype == buffer.dtype and torch.equal(initial[name], buffer), name
