"""The training entry point: ``train(cfg, cache_dir=..., pretrained=..., train_dir=..., seed=...)``.

Reads ONLY the cache stage's latent shards, trains a Flux-class transformer with flow matching, writes
``<train_dir>/metrics.jsonl`` (one JSON object per optimizer step), checkpoints under
``<train_dir>/checkpoints/`` and, at the end, a Diffusers export. CUDA if available (bfloat16 autocast),
else CPU in float32. One process, or DDP under torchrun (``parallel.strategy: ddp``, see ``parallel``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import resource
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from latentmill.config import to_dict
from trainer.checkpoint import list_checkpoints, load_checkpoint, resolve_resume, save_checkpoint
from trainer.config import ParallelConfig, TrainerConfig
from trainer.flux import check_batch_fits, export_flux, flux_forward, load_flux_transformer
from trainer.loader import LatentLoader, read_manifest
from trainer.objective import flow_matching_loss, interpolate, sample_sigmas, velocity_target
from trainer.parallel import DistContext, init_distributed, parallelize, shutdown

log = logging.getLogger(__name__)


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for one purpose (model init, noise sampling) from the run seed."""
    digest = hashlib.sha256(f"latentmill:{purpose}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def warmup_lambda(warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear from 1/warmup_steps to 1 over the first ``warmup_steps`` steps, then 1."""
    if warmup_steps <= 0:
        return lambda step: 1.0
    return lambda step: min(1.0, (step + 1) / warmup_steps)


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _rewind_metrics(path: Path, upto_step: int) -> None:
    """Keep only metric lines with ``step <= upto_step`` (a resumed run re-does the later ones)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the previous run was killed
    path.write_text("".join(line + "\n" for line in kept))


def _set_aside_previous_run(train_dir: Path, ckpt_dir: Path, metrics_path: Path) -> None:
    """A fresh start in a used ``train_dir``: keep the previous run's checkpoints and metrics one level back.

    Its checkpoints must leave ``checkpoints/`` (a later ``resume: latest`` would pick them up), but deleting
    a run because ``resume`` was forgotten would be unkind: they move to ``checkpoints.previous/`` (replacing
    an older one) and the metrics to ``metrics.previous.jsonl``.
    """
    if list_checkpoints(ckpt_dir) or any(ckpt_dir.glob("step-*")):
        previous = train_dir / "checkpoints.previous"
        if previous.exists():
            shutil.rmtree(previous)
        os.replace(ckpt_dir, previous)
        log.warning(
            "trainer.resume is null: starting from scratch; the previous run's checkpoints are in %s "
            "(set trainer.resume=latest to continue a run instead)",
            previous,
        )
    if metrics_path.exists() and metrics_path.stat().st_size:
        os.replace(metrics_path, train_dir / "metrics.previous.jsonl")


def train(
    cfg: TrainerConfig,
    *,
    cache_dir: str | Path,
    pretrained: str,
    train_dir: str | Path,
    seed: int = 0,
    export_dir: str | Path | None = None,
    parallel: ParallelConfig | None = None,
    progress: bool = True,
    check_cache: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Train on the latents in ``cache_dir``, starting from the Flux pipeline ``pretrained``.

    ``check_cache(manifest)`` (optional) raises if the cached latents were made by other encoders than the
    recipe's. ``export_dir`` defaults to ``<train_dir>/export`` (used when ``cfg.export``). Returns a summary:
    ``steps``, ``steps_this_run``, ``final_loss``, ``samples_per_s``, ``data_wait_fraction``, ``peak_rss_mb``,
    ``export_dir``, ``resumed_from``, ``world_size``. Under torchrun with ``parallel.strategy: ddp`` every
    rank calls this; rank 0 writes metrics, weights and the export (its summary has ``export_dir``).
    """
    cfg.validate()
    parallel = parallel or ParallelConfig()
    ctx = init_distributed(parallel)
    try:
        return _train(cfg, ctx, parallel, Path(cache_dir), pretrained, Path(train_dir), seed, export_dir,
                      progress=progress, check_cache=check_cache)  # fmt: skip
    finally:
        shutdown(ctx)


def _train(
    cfg: TrainerConfig,
    ctx: DistContext,
    parallel: ParallelConfig,
    cache_dir: Path,
    pretrained: str,
    train_dir: Path,
    seed: int,
    export_dir: str | Path | None,
    *,
    progress: bool,
    check_cache: Callable[[dict], None] | None,
) -> dict[str, Any]:
    """The body of ``train`` for one process (rank ``ctx.rank`` of ``ctx.world_size``)."""
    # ---------------------------------------------------------------- setup
    ckpt_dir, metrics_path = train_dir / "checkpoints", train_dir / "metrics.jsonl"
    if ctx.is_main:
        train_dir.mkdir(parents=True, exist_ok=True)
    device = ctx.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    # ---------------------------------------------------------------- data: manifest and loader
    manifest = read_manifest(cache_dir)
    if check_cache is not None:
        check_cache(manifest)
    loader = LatentLoader(
        cache_dir,
        cfg.batch_size,
        seed,
        dtype=torch.float32,
        drop_last=cfg.drop_last,
        verify=cfg.verify_shards,
        manifest=manifest,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    log.info(
        "cache %s: %d samples in %d buckets, %d batches per epoch and rank",
        cache_dir,
        loader.num_samples,
        len(loader.buckets),
        len(loader),
    )

    # ---------------------------------------------------------------- model
    torch.manual_seed(derive_seed(seed, "init"))  # LoRA init draws from the global RNG: same on every rank
    transformer = load_flux_transformer(
        pretrained,
        mode=cfg.mode,
        device=device,
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_target_modules=cfg.lora_target_modules,
    )
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    model = parallelize(transformer, parallel, ctx)  # forward through `model`; save/export `transformer`
    log.info("%s mode: %d trainable parameters", cfg.mode, sum(p.numel() for p in trainable))

    # ---------------------------------------------------------------- optimizer, LR schedule, noise RNG
    optimizer = torch.optim.AdamW(
        trainable,
        lr=cfg.learning_rate,
        betas=tuple(cfg.adam_betas),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(cfg.warmup_steps))
    # sigmas and noise come from this CPU generator only; each rank draws its own
    sampling_gen = torch.Generator().manual_seed(derive_seed(seed, f"sampling:{ctx.rank}"))

    # ---------------------------------------------------------------- resume
    resume_path = resolve_resume(cfg.resume, ckpt_dir)
    start_step, last_loss = 0, float("nan")
    if resume_path is not None:
        state = load_checkpoint(
            resume_path,
            model=transformer,
            optimizer=optimizer,
            scheduler=scheduler,
            sampling_generator=sampling_gen,
            rank=ctx.rank,
        )
        loader.load_state_dict(state["loader"])
        start_step, last_loss = int(state["step"]), float(state.get("loss", float("nan")))
        if ctx.is_main:
            _rewind_metrics(metrics_path, start_step)
        log.info("resumed from %s at step %d", resume_path, start_step)
    elif ctx.is_main:
        _set_aside_previous_run(train_dir, ckpt_dir, metrics_path)
        metrics_path.write_text("")
    ctx.barrier()  # every rank has decided where to start before rank 0 writes anything new

    # ---------------------------------------------------------------- training loop
    grad_clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    step, samples_seen, train_time, data_time = start_step, 0, 0.0, 0.0
    batches = iter(loader)
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not (progress and ctx.is_main), unit="step")
    metrics_file = open(metrics_path, "a") if ctx.is_main else nullcontext()
    with bar, loader, metrics_file:
        while step < cfg.max_steps:
            t_start = time.perf_counter()
            batch = next(batches)
            latents = batch["latents"].to(device, non_blocking=True)
            prompt_embeds = batch["prompt_embeds"].to(device, non_blocking=True)
            pooled = batch["pooled_prompt_embeds"].to(device, non_blocking=True)
            t_data = time.perf_counter() - t_start
            if step == start_step:
                check_batch_fits(transformer, latents, prompt_embeds, pooled)

            # --- flow matching: noise level, noisy latents, velocity target (all randomness from one generator)
            batch_size = latents.shape[0]  # this rank's share of the step
            sigmas = sample_sigmas(batch_size, cfg, sampling_gen).to(device)
            noise = torch.randn(latents.shape, generator=sampling_gen, dtype=torch.float32).to(device)
            noisy = interpolate(latents, noise, sigmas)
            target = velocity_target(latents, noise)

            # --- forward, backward, clip, step
            with autocast:
                pred = flux_forward(model, noisy, sigmas, prompt_embeds, pooled, cfg.guidance_scale)
            loss = flow_matching_loss(pred, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip)  # of the rank-averaged grads
            last_loss = ctx.mean(loss.item())  # the loss of the global batch
            if not math.isfinite(last_loss):
                raise FloatingPointError(f"loss is {last_loss} at step {step + 1} (batch {batch['keys']})")
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            step += 1
            global_batch = ctx.sum(batch_size)
            t_step = time.perf_counter() - t_start
            samples_seen, train_time, data_time = (
                samples_seen + global_batch,
                train_time + t_step,
                data_time + t_data,
            )

            # --- metrics: one line per optimizer step
            record = {
                "step": step,
                "loss": last_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "samples_per_s": global_batch / t_step,
                "data_wait_s": t_data,
                "step_time_s": t_step,
                "epoch": batch["epoch"],
                "bucket": batch["bucket"],
            }
            if ctx.is_main:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}")
                log.info("step %d loss %.5f lr %.3g grad_norm %.3g", step, last_loss, lr, float(grad_norm))

            # --- checkpoint
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.max_steps):
                trainer_state = {
                    "loader": loader.state_dict(),
                    "loss": last_loss,
                    "seed": seed,
                    "world_size": ctx.world_size,
                    "mode": cfg.mode,
                    "config": to_dict(cfg),
                    "manifest_fingerprint": manifest.get("fingerprint"),
                }
                save_checkpoint(
                    ckpt_dir,
                    step,
                    model=transformer,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    sampling_generator=sampling_gen,
                    trainer_state=trainer_state,
                    keep_latest_k=cfg.keep_latest_k,
                    rank=ctx.rank,
                    barrier=ctx.barrier,
                )

    # ---------------------------------------------------------------- export
    exported = None
    if cfg.export and ctx.is_main:
        exported = export_flux(
            transformer.to("cpu"),
            mode=cfg.mode,
            pretrained=pretrained,
            export_dir=export_dir if export_dir is not None else train_dir / "export",
        )
        log.info("exported %s weights to %s", cfg.mode, exported)
    ctx.barrier()

    return {
        "steps": step,
        "steps_this_run": step - start_step,
        "final_loss": last_loss,
        "samples_per_s": samples_seen / train_time if train_time else 0.0,
        "data_wait_fraction": data_time / train_time if train_time else 0.0,
        "peak_rss_mb": peak_rss_mb(),
        "export_dir": str(exported) if exported is not None else None,
        "resumed_from": str(resume_path) if resume_path is not None else None,
        "world_size": ctx.world_size,
    }
