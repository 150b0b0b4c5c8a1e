"""Context parallelism (``parallel.cp_size``) on CPU: two gloo ranks split each sample's sequence with Diffusers'
Ulysses attention, under FSDP2, and train exactly as one process does: the same loss and gradient norm at every
step, for a tiny Flux and a tiny Wan. And the one-line refusals before any work."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from latentmill.trainer import ParallelConfig, TrainerConfig
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.context import check_context_parallel, check_cp_batch, cp_plan

from latentmill.core.config import ConfigError
from tests.trainer_helpers import (
    build_tiny_transformer,
    build_tiny_wan_transformer,
    read_metrics,
    run_train,
    torch_threads,
    write_fake_cache,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from latentmill.trainer import ParallelConfig, TrainerConfig, train

torch.set_num_threads(1)
dist.init_process_group("gloo")
for job in json.loads(sys.argv[1]):
    summary = train(TrainerConfig(**job["cfg"]), cache_dir=job["cache"], pretrained=job["pretrained"],
                    train_dir=job["train_dir"], seed=0, progress=False, parallel=ParallelConfig(**job["parallel"]))
    Path(job["train_dir"], f"summary-{os.environ['RANK']}.json").write_text(json.dumps(summary))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""

STEPS, BATCH = 4, 2
CFG = {"max_steps": STEPS, "batch_size": BATCH, "learning_rate": 3e-3, "save_every": 0, "export": False}
# family -> (transformer builder, cache buckets: flux 48x64 -> 12 packed tokens and 8 text tokens; wan 32x32x5 ->
# 2 latent frames x 2 x 2 = 8 tokens: both split in two)
FAMILIES = {"flux": (build_tiny_transformer, {(48, 64, 1): 6}), "wan": (build_tiny_wan_transformer, {(32, 32, 5): 6})}


def _cp_runs(root: Path, family: str) -> dict:
    """The cp=1 run (one process) of ``family`` and the two ranks' summaries and metrics of its cp=2 run."""
    build, buckets = FAMILIES[family]
    pretrained, cache = build(root / "model"), root / "cache"
    write_fake_cache(cache, buckets, family=family, smooth=True)
    with torch_threads(1):
        run_train((str(pretrained), cache), root / "cp1", **CFG)
    job = {"cfg": CFG, "cache": str(cache), "pretrained": str(pretrained), "train_dir": str(root / "cp2"),
           "parallel": {"strategy": "fsdp2", "cp_size": 2}}
    (root / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(root / "worker.py"), json.dumps([job])],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"cp1": read_metrics(root / "cp1"), "cp2": read_metrics(job["train_dir"]),
            "summaries": [json.loads(Path(job["train_dir"], f"summary-{r}.json").read_text()) for r in (0, 1)]}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", pytest.param("wan", marks=pytest.mark.heavy)])
def test_cp2_trains_as_one_process(tmp_path, family):
    runs = _cp_runs(tmp_path, family)
    cp1, cp2, summaries = runs["cp1"], runs["cp2"], runs["summaries"]
    assert [r["step"] for r in cp2] == list(range(1, STEPS + 1))
    for one, two in zip(cp1, cp2):
        # the same samples, noise and timesteps; each rank's gradient holds half the tokens, summed by FSDP2
        assert math.isclose(two["loss"], one["loss"], rel_tol=1e-5), (one["step"], one["loss"], two["loss"])
        assert math.isclose(two["grad_norm"], one["grad_norm"], rel_tol=1e-5), (one["grad_norm"], two["grad_norm"])
    assert len({r["loss"] for r in cp1}) == STEPS  # the weights changed at every step: later losses depend on it
    # both ranks read the same samples: the global batch is one rank's, not two
    assert [s["final_loss"] for s in summaries] == [cp2[-1]["loss"]] * 2
    assert [(s["world_size"], s["cp_size"]) for s in summaries] == [(2, 2)] * 2
    assert summaries[0]["epochs"] == summaries[1]["epochs"] and math.isclose(summaries[0]["epochs"], STEPS * BATCH / 6)


def test_refusals_before_work():
    cpu = torch.device("cpu")
    zimage = get_adapter("z-image")
    assert cp_plan(zimage) is None and cp_plan(get_adapter("flux")) is not None
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: 2, but the z-image family's ZImageTransformer2DModel "
                                          r"has no context-parallel plan"):
        check_context_parallel(ParallelConfig("fsdp2", cp_size=2), zimage, cpu)
    with pytest.raises(ConfigError, match=r"^parallel.cp_kind: ring needs .* on the CPU use parallel.cp_kind: ulysses"):
        check_context_parallel(ParallelConfig("fsdp2", cp_size=2, cp_kind="ring"), get_adapter("wan"), cpu)
    check_context_parallel(ParallelConfig("fsdp2", cp_size=2), get_adapter("wan"), cpu)  # Ulysses on the CPU runs
    check_context_parallel(ParallelConfig("fsdp2"), zimage, cpu)  # cp 1: any family
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: 2 needs parallel.strategy 'fsdp2' \(got 'ddp'\)"):
        ParallelConfig("ddp", cp_size=2).validate()
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: must be >= 1, got 0"):
        ParallelConfig("fsdp2", cp_size=0).validate()
    TrainerConfig().validate()


def test_preflight_refuses_a_family_without_a_plan_before_the_launch():
    from latentmill.preflight import check_recipe
    from latentmill.recipe import load_recipe

    recipe = load_recipe("demo-z-image", ["parallel.strategy=fsdp2", "parallel.cp_size=2"])
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: 2, but the z-image family's"):
        check_recipe(recipe, "train")  # before it looks for a snapshot


def test_cp_batch_must_split_evenly():
    flux, wan = get_adapter("flux"), get_adapter("wan")
    batch = {"latents": torch.zeros(1, 16, 6, 10), "prompt_embeds": torch.zeros(1, 8, 32)}  # 3 x 5 = 15 tokens
    with pytest.raises(ValueError, match=r"^parallel.cp_size: 2 does not divide the sequence of bucket \[6, 10\]: "
                                         r"15 latent tokens; "):
        check_cp_batch(flux, batch, 2)
    check_cp_batch(flux, batch, 1)
    check_cp_batch(flux, {**batch, "latents": torch.zeros(1, 16, 4, 8)}, 2)  # 8 image and 8 text tokens
    with pytest.raises(ValueError, match=r"7 text tokens"):  # Flux splits the text too
        check_cp_batch(flux, {**batch, "latents": torch.zeros(1, 16, 4, 8), "prompt_embeds": torch.zeros(1, 7, 32)}, 2)
    # Wan splits only the video tokens (its cross-attention keeps the whole text)
    check_cp_batch(wan, {"latents": torch.zeros(1, 16, 2, 4, 4), "prompt_embeds": torch.zeros(1, 7, 32)}, 2)


def test_plan_takes_cp_size():
    from latentmill.plan import format_plan, plan_config

    flat = plan_config("configs/wan2.1-1.3b.yaml", nproc=8)
    cp = plan_config("configs/wan2.1-1.3b.yaml", ["parallel.cp_size=2"], nproc=8)
    # FSDP2 shards over the cp ranks too: the static memory per rank does not change
    assert cp["mesh"] == flat["mesh"] == [8] and cp["per_rank"] == flat["per_rank"]
    assert (cp["config"]["cp_size"], cp["config"]["cp_kind"]) == (2, "ulysses")
    c = cp["config"]
    text = format_plan(cp)
    assert "(mesh [8], context parallel 2 (ulysses))" in text
    assert f"x {c['grad_accum_steps']} accum x 4 data-parallel ranks = {c['batch_size'] * c['grad_accum_steps'] * 4}" \
        in text
    assert "each sample's tokens are split over 2 ranks, so a rank's sequence activations are 1/2" in text
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: 3 does not divide the 8 ranks of a shard group"):
        plan_config("configs/wan2.1-1.3b.yaml", ["parallel.cp_size=3"], nproc=8)
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: 8 does not divide the transformer's 12 attention heads"):
        plan_config("configs/wan2.1-1.3b.yaml", ["parallel.cp_size=8"], nproc=8)
