"""FSDP2 mixed precision keeps the Diffusers pipelines' float32 numerics (issue 16, item 4), on 2 gloo ranks.

The reference is what DDP computes: the unsharded float32 model under ``torch.autocast(bfloat16)``. FSDP2's
default ``MixedPrecisionPolicy`` also casts every unit's floating-point inputs to bf16: Flux's and Wan's
rotary embeddings reach the blocks in bf16, Wan's timestep 949.7 reaches ``time_embedder`` as 948.0, and
Wan's float32-kept modules run with bf16 weights. ``latentmill.trainer.parallel.apply_fsdp2`` does not cast
inputs and gives what the model class keeps in float32 (``_keep_in_fp32_modules``) float32 units.

Tolerance: the fixed policy must round exactly where the reference rounds (bf16 weights are the same
round-to-nearest of the same float32 masters, autocast picks the same ops), so outputs of magnitude ~1-3
may differ only by float32 reassociation, far below one bf16 step there (2**-7 = 0.0078 in [1, 2)). ``TOL =
1e-3`` allows that and fails on any bf16 rounding the reference does not do; the old policy exceeds it.

Also here: LoRA on a bfloat16 frozen base under FSDP2 (one unit holds bf16 base and fp32 LoRA parameters),
one AdamW step against an unsharded reference step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from latentmill.trainer.parallel import fsdp_units

from tests.trainer_helpers import TINY_TRANSFORMER, TINY_WAN_TRANSFORMER, build_tiny_transformer

REPO_ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-3

WORKER = r"""
import copy, json, os, sys
import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel, WanTransformer3DModel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from latentmill.trainer.adapter import load_transformer
from latentmill.trainer.config import ParallelConfig
from latentmill.trainer.flux import FluxAdapter, flux_forward
from latentmill.trainer.parallel import DistContext, parallelize
from latentmill.trainer.wan import WanAdapter, wan_forward
from tests.trainer_helpers import TINY_TRANSFORMER, TINY_WAN_TRANSFORMER

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ctx = DistContext(rank, world, rank, torch.device("cpu"), initialized=True, strategy="fsdp2")
fsdp2 = ParallelConfig(strategy="fsdp2")
autocast = torch.autocast("cpu", dtype=torch.bfloat16)
out = {}


def old_policy(model, blocks):
    # what apply_fsdp2 did before: FSDP2's default policy (cast_forward_inputs=True), no float32 units
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def record(seen, key, value):
    seen.setdefault(key, value)  # the first call only; returns None, so the hook changes nothing


def numerics(family, build, adapter, forward):
    torch.manual_seed(0)
    reference = build()
    outputs, inputs = {}, {}
    kinds = ("reference", "new", "old", "bf16_table") if family == "wan" else ("reference", "new", "old")
    for kind in kinds:
        model, seen = copy.deepcopy(reference), {}
        blocks = adapter.blocks(model)
        blocks[0].register_forward_pre_hook(
            lambda m, a, k: record(seen, "rotary", [str(t.dtype) for t in k.get("image_rotary_emb") or a[3]]),
            with_kwargs=True)
        if family == "wan":
            emb = model.condition_embedder
            emb.timesteps_proj.register_forward_pre_hook(
                lambda m, a: record(seen, "timestep", [str(a[0].dtype), a[0].tolist()]))
            emb.time_embedder.register_forward_pre_hook(
                lambda m, a: record(seen, "time_embedder_in", str(a[0].dtype)))
        if kind == "bf16_table":  # the fixed policy, but Wan's scale_shift_table gathered in bf16
            model._keep_in_fp32_modules = [k for k in model._keep_in_fp32_modules if k != "scale_shift_table"]
        if kind in ("new", "bf16_table"):
            model = parallelize(model, fsdp2, ctx, blocks=blocks, mixed_precision=True)
        elif kind == "old":
            model = old_policy(model, blocks)
        with autocast, torch.no_grad():
            outputs[kind] = forward(model).float()
        inputs[kind] = seen
    out[family] = {kind: {"max_abs_diff": (outputs[kind] - outputs["reference"]).abs().max().item(),
                          "mean_abs_diff": (outputs[kind] - outputs["reference"]).abs().mean().item(),
                          "inputs": inputs[kind]} for kind in kinds[1:]}
    out[family]["reference"] = {"abs_max": outputs["reference"].abs().max().item(),
                                "inputs": inputs["reference"]}


gen = torch.Generator().manual_seed(1)
# Wan: a 3-frame 32x32 latent (768 tokens), timestep 949.7 (sigma 0.9497), the pipelines' float32 timesteps
video, text = torch.randn(1, 16, 3, 32, 32, generator=gen), torch.randn(1, 8, 32, generator=gen)
numerics("wan", lambda: WanTransformer3DModel(**TINY_WAN_TRANSFORMER), WanAdapter(),
         lambda m: wan_forward(m, video, torch.tensor([0.9497]), text))
# Flux: a 128x128 latent (1024 px): 64x64 packed tokens, image ids up to 63
image, text, pooled = (torch.randn(1, 16, 128, 128, generator=gen), torch.randn(1, 8, 32, generator=gen),
                       torch.randn(1, 32, generator=gen))
numerics("flux", lambda: FluxTransformer2DModel(**TINY_TRANSFORMER), FluxAdapter(),
         lambda m: flux_forward(m, image, torch.tensor([0.9497]), text, pooled))

# LoRA on a bf16 frozen base: one forward/backward/AdamW step, FSDP2 vs the same step unsharded
gen = torch.Generator().manual_seed(2)
batches = [(torch.randn(1, 16, 16, 16, generator=gen), torch.rand(1, generator=gen),
            torch.randn(1, 8, 32, generator=gen), torch.randn(1, 32, generator=gen),
            torch.randn(1, 16, 16, 16, generator=gen)) for _ in range(world)]


def loss_of(model, batch):
    noisy, sigma, text, pooled, target = batch
    with autocast:
        pred = flux_forward(model, noisy, sigma, text, pooled)
    return (pred.float() - target).square().mean()


for mp in (False, True):
    torch.manual_seed(0)  # the LoRA init draws from the global RNG: the same on every rank
    model = load_transformer(FluxTransformer2DModel, sys.argv[2], mode="lora", lora_rank=4,
                             base_dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    model = parallelize(model, fsdp2, ctx, blocks=FluxAdapter().blocks(model), mixed_precision=mp)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss_of(model, batches[rank]).backward()  # FSDP2 averages the ranks' gradients
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    optimizer.step()
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    (sum(loss_of(reference, b) for b in batches) / world).backward()
    ref_optimizer.step()
    ref_params = dict(reference.named_parameters())
    shard_dtypes = {}
    for n, p in model.named_parameters():
        kind = "lora" if p.requires_grad else "base"
        shard_dtypes.setdefault(kind, set()).add(str(p.to_local().dtype))
    out[f"lora_mp_{mp}"] = {
        "shard_dtypes": {k: sorted(v) for k, v in shard_dtypes.items()},
        "trainable": len(names),
        "finite": all(bool(torch.isfinite(g).all()) for g in grads.values()),
        "grad_max_abs": max(g.abs().max().item() for g in grads.values()),
        "grad_max_diff": max((grads[n] - ref_params[n].grad).abs().max().item() for n in names),
        "param_max_diff": max((p.full_tensor() - ref_params[n]).abs().max().item()
                              for n, p in model.named_parameters() if p.requires_grad),
        "base_max_diff": max((p.full_tensor().float() - ref_params[n].float()).abs().max().item()
                             for n, p in model.named_parameters() if not p.requires_grad),
    }
# Wan, full training under mixed precision (its float32 units, the grouped bf16 units of each block), with
# and without activation checkpointing: one step's gradients equal the unsharded autocast step's
gen = torch.Generator().manual_seed(3)
wan_batches = [(torch.randn(1, 16, 3, 8, 8, generator=gen), torch.rand(1, generator=gen),
                torch.randn(1, 8, 32, generator=gen), torch.randn(1, 16, 3, 8, 8, generator=gen))
               for _ in range(world)]


def wan_loss(model, batch):
    noisy, sigma, text, target = batch
    with autocast:
        pred = wan_forward(model, noisy, sigma, text)
    return (pred.float() - target).square().mean()


for checkpointing in (False, True):
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**TINY_WAN_TRANSFORMER, "num_layers": 2}).train()
    reference = copy.deepcopy(model)
    model = parallelize(model, fsdp2, ctx, blocks=WanAdapter().blocks(model), mixed_precision=True,
                        activation_checkpointing=checkpointing)
    wan_loss(model, wan_batches[rank]).backward()
    (sum(wan_loss(reference, b) for b in wan_batches) / world).backward()
    ref_params = dict(reference.named_parameters())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out[f"wan_train_ac_{checkpointing}"] = {
        "params": len(grads), "with_grad": sum(ref_params[n].grad is not None for n in grads),
        "grad_max_abs": max(g.abs().max().item() for g in grads.values()),
        "grad_max_diff": max((g - ref_params[n].grad).abs().max().item() for n, g in grads.items()),
        "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
    }
open(sys.argv[1] + f"-{rank}.json", "w").write(json.dumps(out))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One 2-rank torchrun launch: the numerics of Wan and Flux, and the LoRA steps; rank 0's results."""
    root = tmp_path_factory.mktemp("fsdp-mp")
    build_tiny_transformer(root)
    (root / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(root / "stderr.txt", "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node=2", str(root / "worker.py"), str(root / "out"), str(root)],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=300)
    assert done.returncode == 0, (root / "stderr.txt").read_text()[-3000:]
    ranks = [json.loads((root / f"out-{r}.json").read_text()) for r in (0, 1)]
    return ranks


def test_units_keep_in_float32_what_wan_keeps_in_float32():
    """Wan: ``time_embedder`` and each block's ``scale_shift_table`` + ``norm2`` compute in float32, the rest
    of a block in one bf16 unit; Flux keeps nothing: one bf16 unit per block and the root; no mixed
    precision: no dtype and the old units."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel
    from latentmill.trainer.flux import FluxAdapter
    from latentmill.trainer.wan import WanAdapter

    wan = WanTransformer3DModel(**{**TINY_WAN_TRANSFORMER, "num_layers": 2})
    units = fsdp_units(wan, WanAdapter().blocks(wan), mixed_precision=True)
    fp32 = torch.float32
    assert [(u.name, u.param_dtype, u.reshard_after_forward) for u in units] == [
        ("blocks.0.attn1,blocks.0.attn2,blocks.0.ffn", torch.bfloat16, True),
        ("blocks.0", fp32, True),  # scale_shift_table, norm2
        ("blocks.1.attn1,blocks.1.attn2,blocks.1.ffn", torch.bfloat16, False),  # the last: kept gathered
        ("blocks.1", fp32, False),
        ("condition_embedder.time_embedder", fp32, None),
        ("patch_embedding,condition_embedder,proj_out", torch.bfloat16, False),
        ("", fp32, None),  # the root: its scale_shift_table
    ]
    owned = {}  # parameter -> dtype of the unit that holds it (the innermost, as fully_shard assigns)
    for unit in units:
        for module in unit.modules:
            for p in module.parameters():
                owned.setdefault(p, unit.param_dtype)
    kept = {n: owned[p] for n, p in wan.named_parameters()
            if {"time_embedder", "scale_shift_table", "norm2"} & set(n.split("."))}
    assert kept and set(kept.values()) == {fp32}, kept
    assert owned[wan.blocks[0].attn1.to_q.weight] == owned[wan.proj_out.weight] == torch.bfloat16
    assert len(owned) == len(list(wan.parameters()))  # every parameter in a unit

    flux = FluxTransformer2DModel(**TINY_TRANSFORMER)
    units = fsdp_units(flux, FluxAdapter().blocks(flux), mixed_precision=True)
    assert [(u.name, u.param_dtype) for u in units] == [
        ("transformer_blocks.0", torch.bfloat16), ("single_transformer_blocks.0", torch.bfloat16),
        ("", torch.bfloat16),
    ]
    units = fsdp_units(wan, WanAdapter().blocks(wan), mixed_precision=False)
    assert [(u.name, u.param_dtype, u.reshard_after_forward) for u in units] == [
        ("blocks.0", None, True), ("blocks.1", None, False), ("", None, None)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan", "flux"])
def test_fsdp2_mixed_precision_matches_the_autocast_reference(results, family):
    """FSDP2 with bf16 mixed precision under bf16 autocast == the unsharded float32 model under the same
    autocast (what DDP computes), within TOL; the old policy (cast inputs, no float32 units) is outside it."""
    for rank in results:
        got = rank[family]
        assert got["new"]["max_abs_diff"] <= TOL, got
        assert got["old"]["max_abs_diff"] > TOL, got
        # the rotary embeddings reach the blocks as the reference computes them (float32), not in bf16
        assert got["new"]["inputs"]["rotary"] == got["reference"]["inputs"]["rotary"] == ["torch.float32"] * 2
        assert got["old"]["inputs"]["rotary"] == ["torch.bfloat16"] * 2
        if family == "wan":
            # the timestep arrives as the pipeline gives it, float32 949.7, and time_embedder computes from it
            assert got["new"]["inputs"]["timestep"] == ["torch.float32", [pytest.approx(949.7)]]
            assert got["new"]["inputs"]["time_embedder_in"] == "torch.float32"
            assert got["old"]["inputs"]["timestep"] == ["torch.bfloat16", [948.0]]
            assert got["old"]["inputs"]["time_embedder_in"] == "torch.bfloat16"
            # a bf16 scale_shift_table (its block a bf16 unit) rounds every block's modulation
            assert got["bf16_table"]["max_abs_diff"] > TOL, got


@pytest.mark.slow
@pytest.mark.parametrize("mixed_precision", [False, True])
def test_lora_on_a_bf16_base_under_fsdp2(results, mixed_precision):
    """FSDP2 takes a unit holding bf16 frozen base and float32 LoRA parameters: the base stays bf16 in every
    local shard, and one forward/backward/AdamW step equals the unsharded step (LoRA grads and weights)."""
    for rank in results:
        got = rank[f"lora_mp_{mixed_precision}"]
        assert got["shard_dtypes"] == {"base": ["torch.bfloat16"], "lora": ["torch.float32"]}, got
        assert got["trainable"] == 14 and got["finite"] and got["grad_max_abs"] > 0, got
        assert got["grad_max_diff"] <= 1e-3 * got["grad_max_abs"], got
        assert got["param_max_diff"] <= 1e-6 and got["base_max_diff"] == 0.0, got


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_wan_trains_under_mixed_precision_with_float32_units(results, checkpointing):
    """Wan's split units (a float32 block owning scale_shift_table + norm2, one grouped bf16 unit) train:
    every parameter gets its float32 sharded gradient, equal to the unsharded autocast step's within two bf16
    steps of the largest gradient (both sum the ranks' bf16-computed gradients, in a different order), with
    and without activation checkpointing (whose recompute re-enters the grouped unit)."""
    for rank in results:
        got = rank[f"wan_train_ac_{checkpointing}"]
        assert got["params"] == got["with_grad"] == 69 and got["grad_dtypes"] == ["torch.float32"], got
        assert got["grad_max_diff"] <= 2**-7 * got["grad_max_abs"], got
