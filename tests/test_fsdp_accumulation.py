"""Gradient accumulation under FSDP2 keeps gradients sharded (issue 16, item 1), on 2 gloo ranks.

With ``set_requires_gradient_sync(False)`` on the micro-batches before the last, FSDP2 held every gradient
unsharded in float32 until the last one: on 2 ranks, the whole model's bytes per rank instead of half. The
bytes a rank holds after a non-final micro-batch are counted from FSDP2's own parameters: the sharded
``.grad``, and the gradients of its unsharded parameters it keeps when it does not reduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# Run in each worker: the gradient bytes a rank holds, sharded (``.grad``) and not yet reduced (FSDP2's
# unsharded accumulated gradients and its unsharded parameters' ``.grad``).
HELD_BYTES = """
def held_gradient_bytes(model):
    held = 0
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            held += local.numel() * local.element_size()
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            unsharded_param = getattr(fsdp_param, "_unsharded_param", None)
            for unsharded in (fsdp_param.unsharded_accumulated_grad,
                              unsharded_param.grad if unsharded_param is not None else None):
                held += 0 if unsharded is None else unsharded.numel() * unsharded.element_size()
    return held
"""

WORKER = HELD_BYTES + """
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from latentmill.trainer.train import _grad_sync

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
with _grad_sync(model, sync=False, hsdp=False):  # a micro-batch before the last
    model(torch.randn(8, 256)).square().mean().backward()
held = held_gradient_bytes(model)
with _grad_sync(model, sync=True):  # the last micro-batch
    model(torch.randn(8, 256)).square().mean().backward()
grads = [p.grad.to_local() for p in model.parameters()]
out = {"model_bytes": model_bytes, "held_bytes": held, "finite": all(bool(torch.isfinite(g).all()) for g in grads)}
open(sys.argv[1] + f"-{os.environ['RANK']}.json", "w").write(json.dumps(out))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""


@pytest.mark.heavy  # a plain MLP; make test runs the same check on a Flux-class model (next test)
def test_a_non_final_micro_batch_leaves_sharded_gradients(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(tmp_path / "worker.py"), str(tmp_path / "out")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out-{rank}.json").read_text())
        assert result["model_bytes"] == 4 * (256 * 256 + 256) * 4 == 1_052_672
        # half the model per rank (FSDP2 shards each weight's first dim), not the whole of it
        assert result["held_bytes"] == result["model_bytes"] // 2, result
        assert result["finite"]


# A Flux-class transformer of ~37 MB (float32), built from config, sharded by the trainer's own `parallelize`;
# out_channels 67 makes proj_out's first dim split unevenly (34 + 33 rows on 2 ranks, 17+17+17+16 on 4).
FLUX_CLASS = dict(patch_size=1, in_channels=64, out_channels=67, num_layers=2, num_single_layers=4,
                  attention_head_dim=64, num_attention_heads=4, joint_attention_dim=256,
                  pooled_projection_dim=128, axes_dims_rope=(16, 24, 24), guidance_embeds=True)  # fmt: skip

FLUX_WORKER = HELD_BYTES + """
import json, math, os, sys
import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from latentmill.trainer.config import ParallelConfig
from latentmill.trainer.flux import FluxAdapter, latent_image_ids, text_ids
from latentmill.trainer.parallel import DistContext, parallelize
from latentmill.trainer.train import _grad_sync

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ctx = DistContext(rank, world, rank, torch.device("cpu"), initialized=True, strategy="fsdp2")
out = {}
for mixed_precision in (False, True):
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**json.loads(sys.argv[2]))
    shapes = [tuple(p.shape) for p in model.parameters()]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # FSDP2 splits dim 0 like torch.chunk (rows ceil(d0 / N) per rank, the last ranks fewer or none)
    rows = lambda d0: max(0, min(math.ceil(d0 / world), d0 - rank * math.ceil(d0 / world)))
    expected = sum(rows(s[0]) * math.prod(s[1:]) * 4 for s in shapes)
    padded = sum(math.ceil(s[0] / world) * math.prod(s[1:]) * 4 for s in shapes)
    model = parallelize(model, ParallelConfig(strategy="fsdp2"), ctx, blocks=FluxAdapter().blocks(model),
                        mixed_precision=mixed_precision)
    gen = torch.Generator().manual_seed(rank)
    # a 16x16 latent packed to 64 tokens, 8 text tokens: called as flux_forward calls it
    batch = lambda: dict(hidden_states=torch.randn(1, 64, 64, generator=gen),
                         timestep=torch.rand(1, generator=gen), guidance=torch.full((1,), 3.5),
                         encoder_hidden_states=torch.randn(1, 8, 256, generator=gen),
                         pooled_projections=torch.randn(1, 128, generator=gen),
                         img_ids=latent_image_ids(16, 16), txt_ids=text_ids(8), return_dict=False)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision)
    with _grad_sync(model, sync=False, hsdp=False), autocast:  # a micro-batch before the last
        model(**batch())[0].float().square().mean().backward()
    held = held_gradient_bytes(model)
    with _grad_sync(model, sync=True), autocast:  # the last micro-batch
        model(**batch())[0].float().square().mean().backward()
    finite = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())
    out[f"mp_{mixed_precision}"] = {"model_bytes": model_bytes, "held_bytes": held, "finite": finite,
                                    "expected_bytes": expected, "padded_bytes": padded}
open(sys.argv[1] + f"-{rank}.json", "w").write(json.dumps(out))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_a_flux_class_model_holds_one_nth_of_its_gradient_bytes(tmp_path, world):
    """After a non-final micro-batch, each of N ranks holds the gradients of its own shard of a Flux-class
    ``FluxTransformer2DModel`` sharded by ``parallelize`` (float32, and with bf16 mixed precision): exactly
    its ``torch.chunk`` share of every parameter's first dim, within 1% of model bytes / N. Both worlds take
    the same path with an uneven split: make test runs 2 ranks, make test-all 4 too (four interpreters)."""
    (tmp_path / "worker.py").write_text(FLUX_WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stderr.txt", "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={world}", str(tmp_path / "worker.py"),
                               str(tmp_path / "out"), json.dumps(FLUX_CLASS)],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=300)
    assert done.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    results = [json.loads((tmp_path / f"out-{rank}.json").read_text()) for rank in range(world)]
    for mixed_precision in (False, True):
        per_rank = [r[f"mp_{mixed_precision}"] for r in results]
        model_bytes = per_rank[0]["model_bytes"]
        assert 30e6 < model_bytes < 60e6, model_bytes
        assert sum(r["held_bytes"] for r in per_rank) == model_bytes  # every gradient byte, once
        assert world * per_rank[0]["padded_bytes"] > model_bytes  # the uneven split is padded (proj_out)
        for r in per_rank:
            assert r["held_bytes"] == r["expected_bytes"], r  # its own shard, nothing unsharded left over
            assert abs(r["held_bytes"] - model_bytes / world) <= 0.01 * model_bytes / world, r
            assert r["expected_bytes"] <= r["padded_bytes"] <= 1.01 * model_bytes / world, r  # padding < 1%
            assert r["finite"], r
