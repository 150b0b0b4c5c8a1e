"""The training entry point: ``train(cfg, cache_dir=..., pretrained=..., train_dir=..., seed=...)``.

Reads ONLY the cache stage's latent shards, trains the transformer of the cache's model family (the
manifest's ``family``: Flux-class images, Wan-class videos; see ``latentmill.trainer.adapters``) with flow matching,
writes ``<train_dir>/metrics.jsonl`` (one JSON object per optimizer step; TensorBoard scalars in
``<train_dir>/tb`` when ``tensorboard`` is installed), checkpoints under ``<train_dir>/checkpoints/``,
validation grids under ``<train_dir>/validation/`` and, at the end, a Diffusers export. CUDA if available
(bfloat16 autocast), else CPU in float32. One process, or DDP / FSDP2 under torchrun (see ``parallel``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import resource
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from latentmill.trainer.adapter import ModelAdapter
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.checkpoint import list_checkpoints, load_checkpoint, resolve_resume, save_checkpoint
from latentmill.trainer.config import ParallelConfig, TrainerConfig
from latentmill.trainer.loader import LatentLoader, manifest_family, read_manifest
from latentmill.trainer.objective import (
    flow_matching_loss,
    interpolate,
    loss_weights,
    sample_sigmas,
    shift_for,
    velocity_target,
)
from latentmill.trainer.parallel import DistContext, init_distributed, parallelize, shutdown
from latentmill.trainer.validation import run_validation
from tqdm.auto import tqdm

from latentmill.config import to_dict

log = logging.getLogger(__name__)


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for one purpose (model init, noise sampling) from the run seed."""
    digest = hashlib.sha256(f"latentmill:{purpose}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def lr_lambda(
    warmup_steps: int, max_steps: int, schedule: str = "constant", min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """LR multiplier of optimizer step ``step`` (0-based): linear warmup, then ``schedule`` down to ``min_lr_ratio``.

    Warmup: (step + 1) / warmup_steps. After it, with p = (step - warmup_steps) / (max_steps - warmup_steps):
    ``constant`` 1; ``linear`` 1 - (1 - min) p; ``cosine`` min + (1 - min) (1 + cos(pi p)) / 2 (the
    convention of ``transformers.get_cosine_schedule_with_warmup``, with a floor).
    """

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - (1.0 - min_lr_ratio) * progress
        if schedule == "cosine":
            return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown lr_schedule {schedule!r}")

    return multiplier


def peak_mem_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA max allocated on a GPU, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / (1024 * 1024)
    return peak_rss_mb()


def tensorboard_writer(log_dir: Path) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``log_dir``, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises ImportError when the tensorboard package is missing
        log.info("tensorboard is not installed: metrics go to metrics.jsonl only")
        return None
    return SummaryWriter(log_dir=str(log_dir))


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB.

    On Linux, ``VmHWM`` of ``/proc/self/status``: the peak of this program's own address space. Not
    ``getrusage``'s ``ru_maxrss``, which survives ``execve``: a process started by a large parent (a Prefect
    flow run, a benchmark driver) would report at least what the parent held when it forked.
    """
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
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

    Its checkpoints must leave ``checkpoints/`` (a later ``resume: latest`` would pick them up), but nothing
    is deleted: they move to ``checkpoints.previous-N/`` and the metrics to ``metrics.previous-N.jsonl``
    (N = 1, 2, ...: every earlier run is kept).
    """
    number = 1 + max((int(p.name.rsplit("-", 1)[1].split(".")[0]) for p in train_dir.glob("*.previous-*")
                      if p.name.rsplit("-", 1)[1].split(".")[0].isdigit()), default=0)
    if list_checkpoints(ckpt_dir) or any(ckpt_dir.glob("step-*")):
        previous = train_dir / f"checkpoints.previous-{number}"
        os.replace(ckpt_dir, previous)
        log.warning(
            "trainer.resume is null: starting from scratch; the previous run's checkpoints are in %s "
            "(set trainer.resume=latest to continue a run instead)",
            previous,
        )
    if metrics_path.exists() and metrics_path.stat().st_size:
        os.replace(metrics_path, train_dir / f"metrics.previous-{number}.jsonl")


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
    on_step: Callable[[dict], None] | None = None,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train on the latents in ``cache_dir``, starting from the Diffusers pipeline ``pretrained``.

    The cache manifest's ``family`` picks the adapter (``flux`` when absent). ``check_cache(manifest)``
    (optional) raises if the cached latents were made by other encoders than the recipe's. ``on_step(record)``
    (optional) is called on rank 0 with each step's metrics record, after it is written (a flow's progress
    report; keep it cheap). ``provenance`` (optional: the dataset snapshot's name and id, the run) goes into
    every checkpoint's trainer state, the summary, and ``latentmill.json`` beside the export, so every model
    traces back to its data. ``export_dir``
    defaults to ``<train_dir>/export`` (used when ``cfg.export``). Returns a summary: ``steps``,
    ``steps_this_run``, ``final_loss``, ``samples_per_s``, ``data_wait_fraction``, ``peak_rss_mb``,
    ``peak_mem_mb``, ``export_dir``, ``resumed_from``, ``world_size``, ``epochs`` (epochs of data this rank
    has read), ``family``, ``validation`` (grid paths). Under
    torchrun with ``parallel.strategy: ddp | fsdp2`` every rank calls this; rank 0 writes metrics, weights
    and the export (its summary has ``export_dir``).
    """
    cfg.validate()
    parallel = parallel or ParallelConfig()
    ctx = init_distributed(parallel)
    try:
        return _train(cfg, ctx, parallel, Path(cache_dir), pretrained, Path(train_dir), seed, export_dir,
                      progress=progress, check_cache=check_cache, on_step=on_step,
                      provenance=provenance or {})  # fmt: skip
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
    on_step: Callable[[dict], None] | None = None,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """The body of ``train`` for one process (rank ``ctx.rank`` of ``ctx.world_size``)."""
    # ---------------------------------------------------------------- setup
    ckpt_dir, metrics_path = train_dir / "checkpoints", train_dir / "metrics.jsonl"
    if ctx.is_main:
        train_dir.mkdir(parents=True, exist_ok=True)
    device = ctx.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # ---------------------------------------------------------------- data: manifest and loader
    manifest = read_manifest(cache_dir)
    if check_cache is not None:
        check_cache(manifest)
    adapter = get_adapter(manifest_family(manifest))
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
        caption_dropout=cfg.caption_dropout,
    )
    log.info(
        "%s cache %s: %d samples in %d buckets, %d batches per epoch and rank",
        adapter.family,
        cache_dir,
        loader.num_samples,
        len(loader.buckets),
        len(loader),
    )

    # ---------------------------------------------------------------- model
    torch.manual_seed(derive_seed(seed, "init"))  # LoRA init draws from the global RNG: same on every rank
    transformer = adapter.load(
        pretrained,
        mode=cfg.mode,
        # FSDP2 shards from CPU onto the device (no full copy per GPU) and keeps float32 masters; its
        # mixed-precision policy does the bf16 compute
        device="cpu" if ctx.sharded else device,
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_target_modules=cfg.lora_target_modules,
        base_dtype=torch.float32 if ctx.sharded else None,
    )
    # forward through `model`; save/export `transformer` (the same module under FSDP2, sharded in place)
    model = parallelize(
        transformer,
        parallel,
        ctx,
        blocks=adapter.blocks(transformer),
        activation_checkpointing=cfg.activation_checkpointing,
        compile=cfg.compile,
    )
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    log.info("%s mode: %d trainable parameters", cfg.mode, sum(p.numel() for p in trainable))

    # ---------------------------------------------------------------- optimizer, LR schedule, noise RNG
    optimizer = torch.optim.AdamW(
        trainable,
        lr=cfg.learning_rate,
        betas=tuple(cfg.adam_betas),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.warmup_steps, cfg.max_steps, cfg.lr_schedule, cfg.min_lr_ratio)
    )
    # sigmas, noise and posterior samples come from this CPU generator only; each rank draws its own
    sampling_gen = torch.Generator().manual_seed(derive_seed(seed, f"sampling:{ctx.rank}"))

    # ---------------------------------------------------------------- resume
    resume_path = resolve_resume(cfg.resume, ckpt_dir, announce=ctx.is_main)
    start_step, last_loss, skipped, skipped_in_row = 0, float("nan"), 0, 0
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
        _follow_current_schedule(scheduler, cfg.learning_rate)
        start_step, last_loss = int(state["step"]), float(state.get("loss", float("nan")))
        skipped, skipped_in_row = int(state.get("skipped_steps", 0)), int(state.get("skipped_in_row", 0))
        if ctx.is_main:
            _rewind_metrics(metrics_path, start_step)
        log.info("resumed from %s at step %d", resume_path, start_step)
    elif ctx.is_main:
        _set_aside_previous_run(train_dir, ckpt_dir, metrics_path)
        metrics_path.write_text("")
    ctx.barrier()  # every rank has decided where to start before rank 0 writes anything new

    # ---------------------------------------------------------------- training loop
    grad_clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    accum = cfg.grad_accum_steps
    text_len = _text_length(manifest)
    step, samples_seen, train_time, data_time = start_step, 0, 0.0, 0.0
    validations: list[str] = []
    batches = iter(loader)
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not (progress and ctx.is_main), unit="step")
    metrics_file = open(metrics_path, "a") if ctx.is_main else nullcontext()
    tb = tensorboard_writer(train_dir / "tb") if (ctx.is_main and cfg.tensorboard) else None
    with bar, loader, metrics_file:
        while step < cfg.max_steps:
            t_start = time.perf_counter()
            t_data, step_samples, micro_losses = 0.0, 0, []
            optimizer.zero_grad(set_to_none=True)
            for micro in range(accum):
                # --- data (this rank's micro-batch)
                t_fetch = time.perf_counter()
                batch = next(batches)
                inputs = {
                    k: v.to(device, non_blocking=True)
                    for k, v in batch.items()
                    if isinstance(v, torch.Tensor)
                }
                t_data += time.perf_counter() - t_fetch
                if step == start_step and micro == 0:
                    adapter.check_batch(transformer, inputs)
                latents = inputs["latents"]
                batch_size = latents.shape[0]
                step_samples += batch_size

                # --- flow matching: all randomness from one generator, in a fixed order
                if "latents_std" in inputs:  # a fresh draw from the cached posterior each time
                    eps = torch.randn(latents.shape, generator=sampling_gen, dtype=torch.float32).to(device)
                    latents = latents + inputs["latents_std"] * eps
                shift = shift_for(cfg, adapter.seq_len(latents))
                sigmas = sample_sigmas(batch_size, cfg, sampling_gen, shift=shift).to(device)
                noise = torch.randn(latents.shape, generator=sampling_gen, dtype=torch.float32).to(device)
                noisy = interpolate(latents, noise, sigmas)
                target = velocity_target(latents, noise)
                weights = loss_weights(sigmas, cfg.loss_weighting) if cfg.loss_weighting != "none" else None

                # --- forward and backward; DDP reduces gradients on the last micro-batch only, FSDP2 keeps them
                # sharded (reduce-scatter) on every one
                last_micro = micro == accum - 1
                with _grad_sync(model, last_micro, hsdp=parallel.hsdp_replicate > 1):
                    with autocast:
                        pred = adapter.forward(model, noisy, sigmas, inputs, cfg)
                    loss = flow_matching_loss(pred, target, weights)
                    (loss / accum).backward()
                micro_losses.append(loss.detach())  # read once per step: no host sync per micro-batch

            # --- clip, step; a step with a non-finite loss or gradient changes no weight (every rank sees the
            # same reduced norm and loss, so all skip together)
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip)  # of the rank-averaged grads
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                grad_norm = grad_norm.full_tensor()
            last_loss = ctx.mean(sum(torch.stack(micro_losses).tolist()) / accum)  # of the global batch
            lr = scheduler.get_last_lr()[0]
            skip = not (math.isfinite(last_loss) and math.isfinite(float(grad_norm)))
            if skip:
                optimizer.zero_grad(set_to_none=True)
                skipped, skipped_in_row = skipped + 1, skipped_in_row + 1
                log.warning("step %d: loss %s, gradient norm %s: step skipped (%d in a row)", step + 1, last_loss,
                            float(grad_norm), skipped_in_row)
                if skipped_in_row > cfg.max_skipped_steps:
                    raise FloatingPointError(
                        f"{skipped_in_row} steps in a row had a non-finite loss or gradient (up to step {step + 1}, "
                        f"trainer.max_skipped_steps={cfg.max_skipped_steps}); the weights are still finite and the "
                        "last checkpoint holds them: lower trainer.learning_rate, check the data, or use bf16 "
                        "autocast and gradient clipping")
            else:
                optimizer.step()
                skipped_in_row = 0
            with warnings.catch_warnings():  # a skipped first step: the schedule follows steps, not updates
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                scheduler.step()
            step += 1
            global_batch = ctx.sum(step_samples)
            if device.type == "cuda":  # the step's time includes the clip and optimizer kernels it queued
                torch.cuda.synchronize(device)
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
                "data_wait_fraction": t_data / t_step if t_step else 0.0,
                "step_time_s": t_step,
                "skipped": skip,
                "skipped_steps": skipped,
                "peak_mem_mb": peak_mem_mb(device),
                "epoch": batch["epoch"],
                "bucket": batch["bucket"],
            }
            if ctx.is_main:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                if tb is not None:
                    for name in (
                        "loss",
                        "lr",
                        "grad_norm",
                        "samples_per_s",
                        "data_wait_fraction",
                        "peak_mem_mb",
                    ):
                        tb.add_scalar(f"train/{name}", record[name], step)
                if on_step is not None:
                    on_step(record)
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}")
                log.info("step %d loss %.5f lr %.3g grad_norm %.3g", step, last_loss, lr, float(grad_norm))

            # --- validation samples (every rank takes part: an FSDP2 forward is collective)
            if cfg.validate_every and (step % cfg.validate_every == 0 or step == cfg.max_steps):
                path = run_validation(
                    adapter,
                    transformer,
                    pretrained=pretrained,
                    cfg=cfg,
                    step=step,
                    train_dir=train_dir,
                    device=device,
                    max_sequence_length=text_len,
                    is_main=ctx.is_main,
                    tb_writer=tb,
                )
                if path is not None:
                    validations.append(str(path))

            # --- checkpoint
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.max_steps):
                _check_finite_weights(trainable, ctx, step)  # never a checkpoint with a non-finite weight
                trainer_state = {
                    "loader": loader.state_dict(),
                    "loss": last_loss,
                    "skipped_steps": skipped,
                    "skipped_in_row": skipped_in_row,
                    "seed": seed,
                    "world_size": ctx.world_size,
                    "mode": cfg.mode,
                    "family": adapter.family,
                    "strategy": parallel.strategy,
                    "config": to_dict(cfg),
                    "manifest_fingerprint": manifest.get("fingerprint"),
                    "provenance": provenance,
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
                    sharded=ctx.sharded,
                )
    if tb is not None:
        tb.close()

    # ---------------------------------------------------------------- export
    exported = None
    if cfg.export:
        full = _unsharded_copy(adapter, transformer, cfg, pretrained, ctx) if ctx.sharded else transformer
        if ctx.is_main:
            exported = adapter.export(
                full.to("cpu"),
                mode=cfg.mode,
                pretrained=pretrained,
                export_dir=export_dir if export_dir is not None else train_dir / "export",
            )
            _write_provenance(Path(exported), provenance, cfg, step, last_loss, manifest)
            log.info("exported %s weights to %s", cfg.mode, exported)
    ctx.barrier()

    return {
        "steps": step,
        "steps_this_run": step - start_step,
        "final_loss": last_loss,
        "samples_per_s": samples_seen / train_time if train_time else 0.0,
        "data_wait_fraction": data_time / train_time if train_time else 0.0,
        "peak_rss_mb": peak_rss_mb(),
        "peak_mem_mb": peak_mem_mb(device),
        "export_dir": str(exported) if exported is not None else None,
        "resumed_from": str(resume_path) if resume_path is not None else None,
        "world_size": ctx.world_size,
        "epochs": loader.epoch + loader.batch_index / max(1, len(loader)),  # position of this rank's data
        "family": adapter.family,
        "validation": validations,
        **provenance,
    }


def _write_provenance(exported: Path, provenance: dict[str, Any], cfg: TrainerConfig, step: int, loss: float,
                      manifest: dict) -> None:
    """``latentmill.json`` beside an export: which data (snapshot) and settings made these weights."""
    folder = exported if exported.is_dir() else exported.parent
    info = {**provenance, "mode": cfg.mode, "steps": step, "final_loss": loss,
            "cache_fingerprint": manifest.get("fingerprint"), "trainer": to_dict(cfg)}
    (folder / "latentmill.json").write_text(json.dumps(info, indent=1, sort_keys=True, default=str))


def _follow_current_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, learning_rate: float) -> None:
    """After a resume: take the LR from this run's schedule at the restored step, not the saved value.

    Equal to the saved value when the recipe is unchanged; a resumed run with a new ``max_steps`` or
    ``learning_rate`` (a longer cosine, say) follows the new schedule from its current step.
    """
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _check_finite_weights(params: list[torch.nn.Parameter], ctx: DistContext, step: int) -> None:
    """Raise before a checkpoint could store a non-finite weight (each rank checks its shard; all agree)."""
    bad = 0
    with torch.no_grad():
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            bad += int(not bool(torch.isfinite(local).all()))
    if ctx.sum(bad):
        raise FloatingPointError(f"step {step}: a trainable weight is not finite; no checkpoint is written "
                                 "(the previous one is intact: resume from it with a lower learning rate)")


def _text_length(manifest: dict) -> int:
    """Token count the cached prompt embeddings were made with (the pipeline's ``max_sequence_length``)."""
    text = manifest.get("text") or {}
    return int(text.get("pad_to") or manifest.get("max_sequence_length") or 512)


def _grad_sync(model: torch.nn.Module, sync: bool, hsdp: bool = False):
    """Context for one micro-batch: which cross-rank gradient reduction to skip before the last (``sync``).

    DDP skips its all-reduce (replicated gradients stay the size of the model anyway). FSDP2 reduce-scatters
    on every micro-batch: skipping it (``set_requires_gradient_sync(False)``) would keep every gradient
    unsharded in float32 until the last micro-batch, the whole model's size on every rank (+48 GB per GPU
    for FLUX.1-dev). Under HSDP only the all-reduce across replicas waits for the last micro-batch.
    """
    if sync:
        return nullcontext()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if hsdp and hasattr(model, "set_requires_all_reduce"):
        return _FSDPNoAllReduce(model)
    return nullcontext()


class _FSDPNoAllReduce:
    """HSDP: reduce-scatter within a replica every micro-batch, all-reduce across replicas on the last."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.set_requires_all_reduce(False)

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_all_reduce(True)


def _unsharded_copy(
    adapter: ModelAdapter, transformer: torch.nn.Module, cfg: TrainerConfig, pretrained: str, ctx: DistContext
) -> torch.nn.Module:
    """Gather the FSDP2-sharded weights (collective) into a plain CPU model on rank 0 (other ranks: as is)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full_sd = get_model_state_dict(
        transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not ctx.is_main:
        return transformer
    copy = adapter.load(
        pretrained,
        mode=cfg.mode,
        device="cpu",
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_target_modules=cfg.lora_target_modules,
        base_dtype=torch.float32,
    )
    copy.load_state_dict(full_sd)
    return copy
