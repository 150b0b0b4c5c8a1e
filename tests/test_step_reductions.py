"""One optimizer step = one all-reduce and one host read (issue 16, item 7); accumulation 2 at batch B
trains exactly like accumulation 1 at batch 2B, under DDP and FSDP2 (the issue's memory-test list).

Two gloo ranks under torchrun. The cache holds one sample repeated, so any cut of the rank's stream into
micro-batches has the same content; the trainer draws sigma and noise sample by sample, so the two
settings see the same noise too. The loss curves then agree up to float rounding: an accumulation that
summed instead of averaging, reduced twice, or dropped a micro-batch would not.

Counted per run, from the worker: ``torch.distributed.all_reduce`` calls, and host reads of tensors
(``item``, ``tolist``, ``float``/``int``/``bool``) made by code in ``trainer/train.py``. DDP's gradient
buckets and FSDP2's reduce-scatters run inside torch and are not counted: they are the gradient
reduction itself, not the per-step bookkeeping this item is about.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_helpers import build_tiny_transformer, read_metrics, write_fake_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

WORKER = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from latentmill.trainer import ParallelConfig, TrainerConfig, train

torch.set_num_threads(1)
args = json.loads(sys.argv[1])
counts = {"all_reduce": 0, "reads": 0}
real_all_reduce = dist.all_reduce

def counting_all_reduce(*a, **k):
    counts["all_reduce"] += 1
    return real_all_reduce(*a, **k)

dist.all_reduce = counting_all_reduce
for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
    real = getattr(torch.Tensor, name)
    def counting(self, *a, _real=real, **k):
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("trainer", "train.py")):
            counts["reads"] += 1
        return _real(self, *a, **k)
    setattr(torch.Tensor, name, counting)

dist.init_process_group("gloo")
out = {}
for run in args["runs"]:
    counts.update(all_reduce=0, reads=0)
    train_dir = Path(args["root"], run["name"])
    summary = train(TrainerConfig(**run["cfg"]), cache_dir=args["cache"], pretrained=args["pretrained"],
                    train_dir=train_dir, seed=0, progress=False, parallel=ParallelConfig(run["strategy"]))
    out[run["name"]] = {**counts, "steps": summary["steps_this_run"]}
Path(args["root"], f"counts-{os.environ['RANK']}.json").write_text(json.dumps(out))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""

STEPS = 4


def test_one_reduction_per_step_and_accumulation_equals_a_bigger_batch(tmp_path):
    build_tiny_transformer(tmp_path / "pretrained")
    write_fake_cache(tmp_path / "cache", {(64, 48, 1): 16}, same=True)
    (tmp_path / "worker.py").write_text(WORKER)
    base = {"max_steps": STEPS, "learning_rate": 3e-3, "save_every": 0, "export": False, "tensorboard": False,
            "grad_clip": 1.0}
    runs = [{"name": f"{strategy}-{label}", "strategy": strategy,
             "cfg": {**base, "batch_size": batch, "grad_accum_steps": accum}}
            for strategy in ("ddp", "fsdp2") for label, batch, accum in (("accum2", 2, 2), ("batch4", 4, 1))]
    args = {"root": str(tmp_path), "cache": str(tmp_path / "cache"), "pretrained": str(tmp_path / "pretrained"),
            "runs": runs}
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stderr.txt", "w") as err:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(tmp_path / "worker.py"), json.dumps(args)], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=err, timeout=400)
    assert done.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts-{rank}.json").read_text())
        for name, c in counts.items():
            assert c["steps"] == STEPS
            # one all-reduce per step, and one at the end: every rank's shard checks of the run agree
            assert c["all_reduce"] == STEPS + 1, (rank, name, c)
            assert c["reads"] == STEPS, (rank, name, c)  # one host read per step
    curves = {run["name"]: [r["loss"] for r in read_metrics(tmp_path / run["name"])] for run in runs}
    norms = {run["name"]: [r["grad_norm"] for r in read_metrics(tmp_path / run["name"])] for run in runs}
    for strategy in ("ddp", "fsdp2"):
        accum, batch = curves[f"{strategy}-accum2"], curves[f"{strategy}-batch4"]
        assert len(accum) == len(batch) == STEPS
        assert accum == pytest.approx(batch, rel=1e-4), (strategy, accum, batch)
        assert norms[f"{strategy}-accum2"] == pytest.approx(norms[f"{strategy}-batch4"], rel=1e-3)
        assert accum[-1] < accum[0]  # it trains: the comparison is between moving curves
    # DDP and FSDP2 compute the same thing (same data, same draws, gradients averaged either way)
    assert curves["ddp-accum2"] == pytest.approx(curves["fsdp2-accum2"], rel=1e-4)
