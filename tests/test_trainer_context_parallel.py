"""Context parallelism (``parallel.cp_size``) on CPU: two gloo ranks split each sample's sequence with Diffusers'
Ulysses attention, under FSDP2, and train exactly as one process does: the same loss and gradient norm at every
step, for a tiny Flux and a tiny Wan, the same validation grid and exported weights (Flux), and a checkpoint
resumed with another cp_size continues with the uninterrupted run's losses. And the one-line refusals before
any work."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from latentmill.trainer import ParallelConfig, TrainerConfig
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.context import check_context_parallel, check_cp_batch, check_cp_validation, cp_plan
from PIL import Image

from latentmill.core.config import ConfigError
from tests.trainer_helpers import (
    add_validation_prompts,
    build_tiny_wan_transformer,
    launch_jobs,
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
# Flux: the whole tiny pipeline, validated at the last step and exported in float32 (the trained weights as they are)
FLUX_EXTRA = {"validate_every": STEPS, "validation_prompts": ["a red square", "a blue circle"], "validation_steps": 2,
              "validation_size": [32, 48], "export": True, "export_dtype": "float32"}
# family -> cache buckets: flux 48x64 -> 12 packed tokens and 16 text tokens; wan 32x32x5 -> 2 latent frames x 2 x 2
# = 8 tokens: both split in two (so does Flux's validation size, 32x48: 6 packed tokens)
BUCKETS = {"flux": {(48, 64, 1): 6}, "wan": {(32, 32, 5): 6}}


def _launch(root: Path, jobs: list[dict]) -> None:
    """Run ``jobs`` in turn on 2 gloo ranks (one torchrun launch)."""
    (root / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(root / "worker.py"), json.dumps(jobs)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def _setup(root: Path, family: str, pretrained: Path | None) -> tuple[str, Path]:
    """(the pretrained folder, a cache of ``family``): the given pipeline (Flux), else a tiny Wan transformer."""
    pretrained = pretrained or build_tiny_wan_transformer(root / "model")
    cache = root / "cache"
    write_fake_cache(cache, BUCKETS[family], family=family, smooth=True, seq_len=16)
    if family == "flux":  # its validation prompts encoded, as a prep does
        add_validation_prompts(cache, str(pretrained), FLUX_EXTRA["validation_prompts"], max_sequence_length=16)
    return str(pretrained), cache


def _cp_runs(root: Path, family: str, pretrained: Path | None) -> dict:
    """The cp=1 run (one process) of ``family`` and the two ranks' summaries and metrics of its cp=2 run."""
    setup = _setup(root, family, pretrained)
    cfg = {**CFG, **(FLUX_EXTRA if family == "flux" else {})}
    with torch_threads(1):
        one = run_train(setup, root / "cp1", **cfg)
    job = {"cfg": cfg, "cache": str(setup[1]), "pretrained": setup[0], "train_dir": str(root / "cp2"),
           "parallel": {"strategy": "fsdp2", "cp_size": 2}}
    _launch(root, [job])
    return {"cp1": read_metrics(root / "cp1"), "cp2": read_metrics(job["train_dir"]), "cp1_summary": one,
            "summaries": [json.loads(Path(job["train_dir"], f"summary-{r}.json").read_text()) for r in (0, 1)]}


def _weights(export: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(export, "transformer").glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", pytest.param("wan", marks=pytest.mark.heavy)])
def test_cp2_trains_validates_and_exports_as_one_process(tmp_path, tiny_flux, family):
    runs = _cp_runs(tmp_path, family, tiny_flux if family == "flux" else None)
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
    if family != "flux":
        return
    # validation: every cp rank runs the sampling forward (its plan splits the sequence), rank 0 writes the grid
    grid_one, grid_two = (np.asarray(Image.open(tmp_path / run / "validation" / f"step-{STEPS:06d}.png"))
                          for run in ("cp1", "cp2"))
    assert grid_one.shape == grid_two.shape == (2 * 48, 32, 3)
    assert summaries[0]["validation"] and not summaries[1]["validation"]
    # float32 weights trained 4 steps in another summation order: 8-bit pixels agree to one level at most
    assert int(np.abs(grid_one.astype(int) - grid_two.astype(int)).max()) <= 1
    # the export (rank 0's): the same weights to float32 rounding, not bit for bit. The cp shares of a gradient are
    # summed in another order than one process sums the whole, and AdamW divides each element by its own scale,
    # so an element whose gradient is near adam_eps moves its rounding difference up to lr-sized steps: measured,
    # the difference's norm is 5e-6 of the training update's, its largest element 1.8e-5 (the update's: 1.2e-2)
    one, two = _weights(runs["cp1_summary"]["export_dir"]), _weights(summaries[0]["export_dir"])
    init = _weights(str(tiny_flux))
    assert summaries[1]["export_dir"] is None and one.keys() == two.keys() and len(one) > 20

    def norm(pairs) -> float:
        return math.sqrt(sum(float((a - b).double().square().sum()) for a, b in pairs))

    update = norm((one[k], init[k]) for k in one)
    assert update > 1.0  # it trained
    assert norm((one[k], two[k]) for k in one) <= 2e-5 * update
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-4


# Wan 2.2 A14B at cp 2, as its recipes ship: both experts in one run (each expert its own cp hooks and mesh), and
# one expert of the I2V pair as a LoRA (the 36-channel conditioned input, the LoRA layers inside the split blocks)
@pytest.mark.slow
@pytest.mark.heavy  # second variants of the cp path above, on the two-expert pipelines
@pytest.mark.parametrize(("pipeline", "cfg"), [
    ("tiny_wan22", {"mode": "full", "expert": "both"}),
    ("tiny_wan22_i2v", {"mode": "lora", "expert": "high", "lora_rank": 4, "learning_rate": 1e-2})])
def test_cp2_trains_wan22_experts_as_one_process(tmp_path, request, pipeline, cfg):
    from latentmill.stages.families import WanI2VA14BEncoders

    pretrained, i2v = str(request.getfixturevalue(pipeline)), pipeline.endswith("i2v")
    cache = tmp_path / "cache"
    write_fake_cache(cache, BUCKETS["wan"], family="wan2.2-i2v" if i2v else "wan", smooth=True, seq_len=16,
                     streams=[s.to_json() for s in WanI2VA14BEncoders.STREAMS] if i2v else None)
    cfg = {**CFG, "batch_size": 1, "grad_accum_steps": 2, "shift": 3.0, **cfg}  # shift 3: both experts routed
    with torch_threads(1):
        run_train((pretrained, cache), tmp_path / "cp1", **cfg)
    (summaries,) = launch_jobs(tmp_path, [{"cfg": cfg, "cache": str(cache), "pretrained": pretrained,
                                           "train_dir": str(tmp_path / "cp2"), "parallel": {"strategy": "fsdp2", "cp_size": 2}}])
    assert [(s["world_size"], s["cp_size"]) for s in summaries] == [(2, 2)] * 2
    cp1, cp2 = read_metrics(tmp_path / "cp1"), read_metrics(tmp_path / "cp2")
    assert [r["step"] for r in cp2] == list(range(1, STEPS + 1))
    for one, two in zip(cp1, cp2):
        assert math.isclose(two["loss"], one["loss"], rel_tol=1e-5), (one["step"], one["loss"], two["loss"])
        assert math.isclose(two["grad_norm"], one["grad_norm"], rel_tol=1e-5), (one["grad_norm"], two["grad_norm"])
        assert two.get("expert_micro_batches") == one.get("expert_micro_batches")
    assert len({r["loss"] for r in cp1}) == STEPS  # the weights changed at every step
    if cfg["expert"] == "both":
        assert {name for r in cp1 for name in r["expert_micro_batches"]} == {"high", "low"}


@pytest.mark.slow
@pytest.mark.heavy
def test_resume_with_another_cp_size_continues_the_run(tmp_path, tiny_flux):
    """cp_size changes neither the data order nor the global batch: a checkpoint of a cp=2 run resumes at cp=1 on
    the same 2 ranks (2 data-parallel ranks, half the batch each), and a cp=1 one at cp=2, with the losses of the
    uninterrupted run."""
    pretrained, cache = _setup(tmp_path, "flux", tiny_flux)
    with torch_threads(1):
        run_train((pretrained, cache), tmp_path / "one", **CFG)
    reference = [r["loss"] for r in read_metrics(tmp_path / "one")]
    half = {**CFG, "save_every": STEPS // 2}

    def job(name: str, cfg: dict, cp: int) -> dict:
        return {"cfg": cfg, "cache": str(cache), "pretrained": pretrained, "train_dir": str(tmp_path / name),
                "parallel": {"strategy": "fsdp2", "cp_size": cp}}

    resume = f"checkpoints/step-{STEPS // 2:06d}"
    _launch(tmp_path, [
        job("cp2", half, 2), job("cp2-then-1", {**CFG, "resume": str(tmp_path / "cp2" / resume)}, 1),
        job("cp1", {**half, "batch_size": BATCH // 2}, 1),
        job("cp1-then-2", {**CFG, "batch_size": BATCH // 2, "resume": str(tmp_path / "cp1" / resume)}, 2)])
    for name in ("cp2", "cp1"):
        assert [r["loss"] for r in read_metrics(tmp_path / name)] == pytest.approx(reference, rel=1e-5), name
    for name, cp in (("cp2-then-1", 1), ("cp1-then-2", 2)):
        resumed = read_metrics(tmp_path / name)
        assert [r["step"] for r in resumed] == list(range(STEPS // 2 + 1, STEPS + 1)), name
        assert [r["loss"] for r in resumed] == pytest.approx(reference[STEPS // 2:], rel=1e-5), name
        summary = json.loads((tmp_path / name / "summary-0.json").read_text())
        assert (summary["cp_size"], summary["steps_this_run"]) == (cp, STEPS // 2)
        # the same global batch: every step trained BATCH samples (the epoch position says so)
        assert math.isclose(summary["epochs"], STEPS * BATCH / 6)


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


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_preflight_refuses_buckets_cp_does_not_divide_before_any_work(family):
    """Every bucket the recipe's bucket keys make is checked as the trainer checks a batch, at its token counts by
    the published model's shape rule (a hub id): images at the image tiers, clips at the video tiers."""
    from latentmill.preflight import check_recipe
    from latentmill.recipe import load_recipe

    name = {"flux": "flux-dev-full", "wan": "wan2.1-1.3b"}[family]

    def check(*overrides: str) -> None:
        check_recipe(load_recipe(name, ["trainer.validate_every=0", *overrides]), "prep")

    # one square bucket of 48 px (and for Wan its image, and 9-frame clips): Flux 3 x 3 packed tokens, Wan the
    # image 3 x 3, the clip 3 latent frames x 3 x 3
    small = ["bucket.aspect_ratios=[1.0]", "bucket.frame_counts=[9]"]
    bad = {"flux": r"1 of the 1 buckets \[W, H, F\] the bucket keys make: \[48, 48, 1\]: 9 latent tokens; use",
           "wan": r"2 of the 2 buckets \[W, H, F\] the bucket keys make: \[48, 48, 1\]: 9 latent tokens; "
                  r"\[48, 48, 9\]: 27 latent tokens; use"}[family]
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: 2 does not divide the sequences of " + bad):
        check("parallel.cp_size=2", "bucket.resolution=48", *small)
    check("parallel.cp_size=1", "bucket.resolution=48", *small)  # one rank: any bucket
    check("parallel.cp_size=4", "bucket.resolution=64", *small)  # 4 x 4 (x 3) tokens; Flux's 512 text tokens
    # Flux splits its text too (77 tokens); Wan's cross-attention keeps the whole text
    text = ("parallel.cp_size=2", "bucket.resolution=64", "cache.max_sequence_length=77", *small)
    if family == "flux":
        with pytest.raises(ConfigError, match=r"\[64, 64, 1\]: 77 text tokens; use"):
            check(*text)
    else:
        check(*text)
    # the shipped buckets: FLUX.1-dev's 1024² tier (9 ratios; 1456 x 720 is 91 x 45 = 4095 packed tokens) and Wan's
    # 480p tier (5 ratios x 20 clip lengths, and the images' tiers), of which 44 have token counts 4 does not divide
    cp, count, first = {"flux": (2, "2 of the 9", r"\[720, 1456, 1\]: 4095 latent tokens; \[1456, 720, 1\]: 4095 latent tokens"),
                        "wan": (4, "44 of the 105", r"\[480, 848, 1\]: 1590 latent tokens; .* \(41 more\)")}[family]
    with pytest.raises(ConfigError, match=rf"^parallel.cp_size: {cp} does not divide the sequences of {count} buckets "
                                          rf".*make: {first}; use a cp_size that divides them"):
        check(f"parallel.cp_size={cp}")
    if family == "wan":
        check("parallel.cp_size=2")


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


def test_a_validation_size_cp_does_not_divide_is_refused_before_work(tmp_path):
    # every cp rank samples the validation prompts, and the plan splits their sequences as a batch's
    cp2, flux, wan = ParallelConfig("fsdp2", cp_size=2), get_adapter("flux"), get_adapter("wan")
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"latent_channels": 16, "block_out_channels": [8] * 4}))
    with pytest.raises(ConfigError, match=r"^parallel.cp_size: 2 does not divide the sequence of "
                                          r"trainer.validation_size \[48, 48\]: 9 latent tokens; use a validation"):
        check_cp_validation(cp2, flux, [48, 48], str(tmp_path), 16)  # 6 x 6 latents: 3 x 3 packed tokens
    with pytest.raises(ConfigError, match=r"\[32, 48\]: 7 text tokens"):  # Flux-class: the text is split too
        check_cp_validation(cp2, flux, [32, 48], str(tmp_path), 7)
    check_cp_validation(cp2, flux, [32, 48], str(tmp_path), 16)  # 2 x 3 packed tokens
    check_cp_validation(ParallelConfig("fsdp2"), flux, [48, 48], str(tmp_path), 16)  # cp 1: any size
    # Wan (no folder, as for a hub id: the published VAE's 8x spatial and 4x temporal factors; 1x2x2 patches),
    # 17 frames when the size names none: 5 latent frames x 3 x 3 tokens
    with pytest.raises(ConfigError, match=r"\[48, 48\]: 45 latent tokens"):
        check_cp_validation(cp2, wan, [48, 48], str(tmp_path / "hub-id"), 7)  # Wan does not split its text
    check_cp_validation(cp2, wan, [32, 32], str(tmp_path / "hub-id"), 7)  # 5 x 2 x 2
    check_cp_validation(cp2, wan, [48, 48, 5], str(tmp_path / "hub-id"), 7)  # 2 x 3 x 3


def test_plan_takes_cp_size():
    from latentmill.plan import format_plan, plan_config

    flat = plan_config("configs/wan2.1-1.3b.yaml", nproc=8)
    cp = plan_config("configs/wan2.1-1.3b.yaml", ["parallel.cp_size=2"], nproc=8)
    # FSDP2 shards over the cp ranks too: the static memory per rank does not change; the activations are split
    assert cp["mesh"] == flat["mesh"] == [8]
    activations = {"activation_bytes", "activation_bytes_checkpointing", "activation_bytes_no_checkpointing",
                   "total_bytes"}
    assert {k: v for k, v in cp["per_rank"].items() if k not in activations} == \
        {k: v for k, v in flat["per_rank"].items() if k not in activations}
    assert 0.45 < cp["per_rank"]["activation_bytes"] / flat["per_rank"]["activation_bytes"] < 0.55
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
