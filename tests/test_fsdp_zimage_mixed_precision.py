"""Z-Image under FSDP2 bf16 mixed precision (configs/z-image-full.yaml), on 2 gloo ranks, for a forward and one
training step's gradients.

``ZImageTransformer2DModel`` keeps nothing in float32 (no ``_keep_in_fp32_modules``): ZImagePipeline in bf16
runs every weight in bf16, its RMSNorm weights and pad tokens too. FSDP2 gathers every parameter in bf16, so
it computes exactly what the bf16-cast model computes under the same autocast (measured: difference 0.0 in
outputs and gradients). The float32 model under autocast (what DDP computes) keeps those non-matmul weights in
float32 and differs by one bf16 rounding step: measured 0.0156 on outputs up to 2.53 (2**-7 at that magnitude
is 0.0156), 0.039 on gradients up to 5.3; the loss agrees to 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# heavy: the mixed-precision path make test runs for FLUX.1 and Wan (make test-all)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

WORKER = r"""
import copy, json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from latentmill.trainer.config import ParallelConfig
from latentmill.trainer.parallel import DistContext, parallelize
from latentmill.trainer.zimage import ZImageAdapter, zimage_forward
from tests.test_trainer_zimage import tiny_transformer

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ctx = DistContext(rank, world, rank, torch.device("cpu"), initialized=True, strategy="fsdp2")
autocast = torch.autocast("cpu", dtype=torch.bfloat16)
gen = torch.Generator().manual_seed(1)
# a 64x64 latent (512 px): 1024 image tokens; captions of 9 and 17 real tokens padded to 24
noisy, target = torch.randn(2, 16, 64, 64, generator=gen), torch.randn(2, 16, 64, 64, generator=gen)
embeds, mask = torch.zeros(2, 24, 32), torch.zeros(2, 24, dtype=torch.bool)
for i, n in enumerate((9, 17)):
    embeds[i, :n], mask[i, :n] = torch.randn(n, 32, generator=gen), True
sigmas = torch.tensor([0.9497, 0.3])

reference = tiny_transformer().train()
model = copy.deepcopy(reference)
model = parallelize(model, ParallelConfig(strategy="fsdp2"), ctx, blocks=ZImageAdapter().blocks(model),
                    mixed_precision=True)
bf16_model = copy.deepcopy(reference).to(torch.bfloat16)  # every weight rounded: what FSDP2 gathers in bf16
out = {}
for name, m in (("reference", reference), ("fsdp2", model), ("bf16", bf16_model)):
    with autocast:
        pred = zimage_forward(m, noisy, sigmas, embeds, mask)
    loss = (pred.float() - target).square().mean()
    loss.backward()
    grads = {}
    for n, p in m.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[n] = g.float()
    out[name] = (pred.float().detach(), loss.item(), grads)
ref_pred, ref_loss, ref_grads = out["reference"]
pred, loss, grads = out["fsdp2"]
scale = max(g.abs().max().item() for g in ref_grads.values())
b_pred, b_loss, b_grads = out["bf16"]
result = {"max_abs_diff": (pred - ref_pred).abs().max().item(), "abs_max": ref_pred.abs().max().item(),
          "bf16_max_abs_diff": (pred - b_pred).abs().max().item(),
          "bf16_vs_reference": (b_pred - ref_pred).abs().max().item(),
          "bf16_grad_max_abs_diff": max((grads[n] - b_grads[n]).abs().max().item() for n in b_grads),
          "loss": [ref_loss, loss], "grad_names_equal": sorted(grads) == sorted(ref_grads),
          "grad_max_abs_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
          "grad_abs_max": scale}
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(result))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""


def test_fsdp2_mixed_precision_computes_what_the_bf16_model_computes(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(tmp_path / "worker.py"), str(tmp_path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["grad_names_equal"] and got["abs_max"] > 0.5, got
        # FSDP2 bf16 == the bf16 model (float32 reassociation at most), outputs and every gradient
        assert got["bf16_max_abs_diff"] <= 1e-4 and got["bf16_grad_max_abs_diff"] <= 1e-4, got
        # the float32 reference under autocast: within one bf16 step of the output's magnitude
        step = 2.0 ** -7 * got["abs_max"]
        assert got["max_abs_diff"] <= step and got["bf16_vs_reference"] <= step, got
        assert got["grad_max_abs_diff"] <= 2.0 ** -6 * got["grad_abs_max"], got  # (two steps: 0.039 of 0.083)
        assert got["loss"][0] == pytest.approx(got["loss"][1], rel=1e-3)
