"""Figure 10: host peak RSS per rank while loading the transformer under FSDP2, at 2 and 4 ranks vs 1.

``latentmill.trainer.model_load.load_for_training`` builds the transformer on the meta device, shards it and
fills each rank's shards from only its own rows of the safetensors checkpoint; a rank should hold about
1/N of the float32 model, where today's path (``adapter.load`` on CPU, then ``parallelize``) held a
whole copy on every rank. For each world size (1, 2, 4) one ``torchrun --nproc-per-node N`` child (gloo,
CPU, ``strategy: fsdp2``) loads a Flux-class transformer built from config (random, seed 0, saved once with
``save_pretrained``, one safetensors file) by the new path and then by today's. Each rank resets its peak
resident set (``/proc/self/clear_refs``) after the imports and the process group's start, loads, and
reports the increment of ``VmHWM``; a world size's value is the largest increment over its ranks. glibc's
mmap threshold is pinned at 64 KiB in the children, so that memory freed by the first load returns to the
system instead of being reused by the second. On CPU the shards themselves are host memory (on GPUs they
are not: the host then holds one slice in flight), so 1/N plus a fixed overhead is the best this can read.

The figures are the new path's ratios (N ranks / 1 rank); ``details`` gives today's path's: its own ratio
(its 1-rank load holds two copies: the loaded model and FSDP2's padded one) and its per-rank peak over the
model's size (about one whole copy or more on every rank).

Run alone: ``python -m bench.ranks --quick``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench.common import REPO_ROOT, WORK, figure, log, reps_of, run_benchmark, setup_env

setup_env()

WORLD_SIZES = (1, 2, 4)
# Flux-class transformers (FluxTransformer2DModel), float32: ~306 MiB, and ~70 MiB under --quick.
FLUX_CLASS = {"patch_size": 1, "in_channels": 64, "num_layers": 4, "num_single_layers": 9, "attention_head_dim": 64,
              "num_attention_heads": 8, "joint_attention_dim": 512, "pooled_projection_dim": 256,
              "axes_dims_rope": [16, 24, 24], "guidance_embeds": True}
FLUX_CLASS_QUICK = {**FLUX_CLASS, "num_layers": 1, "num_single_layers": 2}


def model_folder(config: dict) -> str:
    """The pipeline-like folder holding ``transformer/`` of ``config`` (built once, seed 0)."""
    import hashlib

    import torch
    from diffusers import FluxTransformer2DModel

    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    folder = WORK / "models" / f"ranks-flux-{key}"
    if not (folder / "transformer" / "config.json").is_file():
        torch.manual_seed(0)
        FluxTransformer2DModel(**config).save_pretrained(folder / "transformer")
    return str(folder)


def _vm(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(folder: str, out: str) -> None:
    """One rank under torchrun: load by the new path, then by today's; write each VmHWM increment."""
    import gc

    import accelerate  # noqa: F401  (imports either path makes, before the floor)
    import safetensors  # noqa: F401
    import torch
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel  # noqa: F401
    from latentmill.trainer.adapters import get_adapter
    from latentmill.trainer.config import ParallelConfig, TrainerConfig
    from latentmill.trainer.model_load import load_for_training
    from latentmill.trainer.parallel import end_process_group, init_distributed, parallelize

    torch.set_num_threads(1)
    parallel = ParallelConfig(strategy="fsdp2")
    ctx = init_distributed(parallel)
    adapter = get_adapter("flux")
    result = {}
    for path in ("new", "old"):
        gc.collect()
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current resident set
        before = _vm("VmHWM")
        if path == "new":
            transformer, model = load_for_training(adapter, folder, cfg=TrainerConfig(mode="full"),
                                                   parallel=parallel, ctx=ctx, init_seed=0)
        else:
            torch.manual_seed(0)
            transformer = adapter.load(folder, mode="full", device="cpu", base_dtype=torch.float32)
            model = parallelize(transformer, parallel, ctx, blocks=adapter.blocks(transformer))
        result[path] = _vm("VmHWM") - before
        result["model_bytes"] = sum(p.numel() * p.element_size() for p in transformer.parameters())
        del transformer, model
    with open(f"{out}-{ctx.rank}.json", "w") as f:
        json.dump(result, f)
    end_process_group()  # a barrier, then every group (the meshes' too) released


def load_on(nproc: int, folder: str, out_dir) -> list[dict]:
    """Run ``child`` on ``nproc`` gloo ranks; each rank's increments."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    with open(out_dir / "stderr.txt", "w") as err:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", "-m", "bench.ranks", "--child", folder,
                               str(out_dir / "out")], cwd=REPO_ROOT, env=env, stdout=err, stderr=err)
    if done.returncode != 0:
        raise RuntimeError(f"{nproc} ranks failed:\n{(out_dir / 'stderr.txt').read_text()[-3000:]}")
    return [json.loads((out_dir / f"out-{rank}.json").read_text()) for rank in range(nproc)]


def run(args) -> list:
    reps = reps_of(args, full=2, quick=1)
    config = FLUX_CLASS_QUICK if args.quick else FLUX_CLASS
    folder = model_folder(config)
    MiB = 2**20
    peaks = {path: {n: [] for n in WORLD_SIZES} for path in ("new", "old")}
    model_mib = 0.0
    for rep in range(reps):
        for n in (WORLD_SIZES if rep % 2 == 0 else WORLD_SIZES[::-1]):
            ranks = load_on(n, folder, WORK / "ranks" / f"{n}-{rep}")
            model_mib = ranks[0]["model_bytes"] / MiB
            for path in ("new", "old"):
                peaks[path][n].append(max(r[path] for r in ranks) / MiB)
            log(f"ranks rep {rep + 1}/{reps}, {n} ranks: new {peaks['new'][n][-1]:.0f} MiB, "
                f"today's {peaks['old'][n][-1]:.0f} MiB per rank (model {model_mib:.0f} MiB)")
    old_ratio = {n: round(sorted(o / b for o, b in zip(peaks["old"][n], peaks["old"][1]))[reps // 2], 3)
                 for n in WORLD_SIZES[1:]}
    inputs = {"model": "FluxTransformer2DModel " + json.dumps(config) + ", random, seed 0, float32, one safetensors file",
              "model_mib": round(model_mib, 1), "launch": "torchrun --standalone, gloo, CPU, strategy fsdp2, mode full",
              "measure": "per rank: VmHWM increment over the resident set after imports and process-group start "
                         "(clear_refs 5); the max over ranks"}
    figures = []
    for n, goal in ((2, "<= 0.6"), (4, "<= 0.35")):
        figures.append(figure(
            f"10. host RSS per rank at load, {n} ranks vs 1", peaks["new"][n], peaks["new"][1], "MiB", goal,
            inputs, "load_for_training (meta-device build, FSDP2, each rank reads its own rows); baseline: the "
            "same at 1 rank",
            details={"todays_path_ratio": old_ratio[n],
                     "todays_path_per_rank_vs_model": round(statistics.median(peaks["old"][n]) / model_mib, 3),
                     "todays_path_mib": {str(k): [round(v, 1) for v in vals] for k, vals in peaks["old"].items()},
                     "ideal_ratio": round(1 / n, 3)}))
    return figures


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:4])
        return
    run_benchmark("ranks", __doc__, run, argv)


if __name__ == "__main__":
    main()
