"""The training entry point: ``train(cfg, cache_dir=..., pretrained=..., train_dir=..., seed=...)``.

Reads ONLY the cache stage's latent shards, trains the transformer of the cache's model family (the
manifest's ``family``: Flux-class images, Wan-class videos; see ``latentmill.trainer.adapters``) with flow matching,
writes ``<train_dir>/metrics.jsonl`` (one JSON object per optimizer step; the same numbers, the validation grids,
the recipe and the snapshot also go to ``trainer.trackers``: ``latentmill.trainer.trackers``), checkpoints under
``<train_dir>/checkpoints/``, validation grids under ``<train_dir>/validation/`` and, at the end, a Diffusers
export with its model card (``latentmill.trainer.card``). CUDA if available
(bfloat16 autocast), else CPU in float32. One process, or DDP / FSDP2 under torchrun (see ``parallel``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import resource
import signal
import sys
import time
import traceback
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from latentmill.trainer.adapter import Expert, choose_experts
from latentmill.trainer.adapters import check_i2v, check_validation, get_adapter
from latentmill.trainer.card import trigger_phrase, write_model_card
from latentmill.trainer.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    read_trainer_state,
    resolve_resume,
    save_checkpoint,
)
from latentmill.trainer.config import LoaderConfig, ParallelConfig, TrainerConfig
from latentmill.trainer.context import check_context_parallel, check_cp_batch, check_cp_validation
from latentmill.trainer.evaluation import Evaluator, clip_score, clip_scorer
from latentmill.trainer.experts import Part, expert_sigma, other_parts, route_micro_batches, routing_warning
from latentmill.trainer.export import export_trained
from latentmill.trainer.loader import (
    LatentLoader,
    check_streams,
    manifest_family,
    read_manifest,
    resume_batch_size,
)
from latentmill.trainer.model_load import load_for_training
from latentmill.trainer.objective import (
    derive_seed,
    first_frame_mask,
    flow_matching_loss,
    interpolate,
    loss_weights,
    shift_for,
    velocity_target,
)
from latentmill.trainer.parallel import DistContext, init_distributed, shutdown
from latentmill.trainer.shard_check import CorruptShardError
from latentmill.trainer.stream import StreamSource, cache_fit_warning
from latentmill.trainer.threads import ThreadChoice, choose_cpu_threads
from latentmill.trainer.trackers import Trackers, start_trackers
from latentmill.trainer.validation import CachedPrompts, Validator, cached_prompts, grid_frames, video_path
from tqdm.auto import tqdm

from latentmill import interrupt
from latentmill.core.config import ConfigError, to_dict

log = logging.getLogger(__name__)

_SAMPLES_FILE = re.compile(r"samples-rank\d+\.jsonl")  # trainer.record_samples: one file per rank


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


def _samples_files(train_dir: Path) -> list[Path]:
    """The ``samples-rank<r>.jsonl`` files of ``trainer.record_samples`` in ``train_dir`` (not set-aside ones)."""
    return [p for p in train_dir.glob("samples-rank*.jsonl") if _SAMPLES_FILE.fullmatch(p.name)]


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
    for path in _samples_files(train_dir):
        os.replace(path, train_dir / f"{path.stem}.previous-{number}.jsonl")


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
    recipe: dict[str, Any] | None = None,
    stream: StreamSource | None = None,
    loader: LoaderConfig | None = None,
) -> dict[str, Any]:
    """Train on the latents in ``cache_dir``, starting from the Diffusers pipeline ``pretrained``.

    The cache manifest's ``family`` picks the adapter (``flux`` when absent). ``check_cache(manifest)``
    (optional) raises if the cached latents were made by other encoders than the recipe's. ``on_step(record)``
    (optional) is called on rank 0 with each step's metrics record, after it is written (a flow's progress
    report; keep it cheap). ``provenance`` (optional: the dataset snapshot's name and id, the run) goes into
    every checkpoint's trainer state, the summary, and ``latentmill.json`` beside the export, so every model
    traces back to its data. ``recipe`` (optional: the whole resolved recipe, else the trainer section) is what
    the trackers record as the run's settings. ``stream`` (optional): the snapshot is on an object store, and
    ``cache_dir`` holds its manifest only; the shards come through ``latentmill.trainer.stream``. ``loader``
    (optional): the recipe's loader section, whose ``shuffle_block`` orders the epochs. ``export_dir``
    defaults to ``<train_dir>/export`` (used when ``cfg.export``). Returns a summary: ``steps``,
    ``steps_this_run``, ``final_loss``, ``samples_per_s``, ``data_wait_fraction``, ``peak_rss_mb``,
    ``peak_mem_mb``, ``export_dir``, ``resumed_from``, ``world_size``, ``epochs`` (epochs of data this rank
    has read), ``family``, ``validation`` (grid paths), ``trackers`` (where each started tracker shows the
    run, by name), ``cpu_threads`` and ``cpu_threads_reason`` (torch's
    intra-op threads in this run and why: ``latentmill.trainer.threads``), ``shards_checked`` (shards this
    rank hashed against the manifest). A damaged shard stops the run with ``CorruptShardError``. Under
    torchrun with ``parallel.strategy: ddp | fsdp2`` every rank calls this; rank 0 writes metrics, weights
    and the export (its summary has ``export_dir``).
    """
    cfg.validate()
    parallel = parallel or ParallelConfig()
    ctx = init_distributed(parallel)
    finished = False
    threads = torch.get_num_threads()  # the caller's, restored at the end (_Run chooses the run's own)
    try:
        summary = _train(cfg, ctx, parallel, Path(cache_dir), pretrained, Path(train_dir), seed, export_dir,
                         progress=progress, check_cache=check_cache, on_step=on_step,
                         provenance=provenance or {}, recipe=recipe, stream=stream,
                         shuffle_block=(loader or LoaderConfig()).shuffle_block)  # fmt: skip
        finished = True
        return summary
    except (interrupt.Interrupted, CorruptShardError) as err:
        # every rank stopped at the same point (_Run.stop, _stop_on_bad_shard): all of them reach the barrier.
        # The traceback's finished frames let the model go, so its process groups end in shutdown, not with
        # their threads still running at interpreter exit (where a rank could hang or abort)
        traceback.clear_frames(err.__traceback__)
        finished = True
        raise
    finally:
        shutdown(ctx, synchronize=finished)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


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
    recipe: dict[str, Any] | None = None,
    stream: StreamSource | None = None,
    shuffle_block: int | None = None,
) -> dict[str, Any]:
    """The body of ``train`` for one process (rank ``ctx.rank`` of ``ctx.world_size``): set up, loop, export."""
    run = _Run(cfg, ctx, parallel, cache_dir, pretrained, train_dir, seed, check_cache, provenance, stream,
               shuffle_block)
    run.resume()
    run.clip = clip_scorer(recipe) if ctx.is_main and cfg.validate_every else None
    trackers = Trackers([])
    if ctx.is_main:
        trackers = start_trackers(cfg.active_trackers(), project=cfg.tracker_project, run_name=train_dir.name,
                                  log_dir=train_dir, required=cfg.trackers_required)
        trackers.log_info(recipe or {"trainer": to_dict(cfg)}, run.info())
    try:
        summary = _loop(run, trackers, progress=progress, on_step=on_step, export_dir=export_dir)
    except BaseException as err:
        trackers.close("killed" if isinstance(err, (interrupt.Interrupted, KeyboardInterrupt)) else "failed")
        raise
    urls = trackers.urls  # before close, which lets the trackers go
    trackers.close()
    return {**summary, "trackers": urls}


def _loop(run: _Run, trackers: Trackers, *, progress: bool, on_step: Callable[[dict], None] | None,
          export_dir: str | Path | None) -> dict[str, Any]:
    """The training loop of ``_train``: steps, validations, checkpoints, then the export and the summary."""
    cfg, ctx, train_dir = run.cfg, run.ctx, run.train_dir
    batches = iter(run.loader)
    bar = tqdm(total=cfg.max_steps, initial=run.start_step, disable=not (progress and ctx.is_main), unit="step")
    metrics_file = open(run.metrics_path, "a") if ctx.is_main else nullcontext()
    samples_file = open(train_dir / f"samples-rank{ctx.rank}.jsonl", "a") if cfg.record_samples else nullcontext()
    validations: list[str] = []
    # SIGINT and SIGTERM end the loop after the step in flight (latentmill.interrupt, Run.stop_signal)
    with bar, run.loader, metrics_file, samples_file, interrupt.stop_on_signals():
        while run.step < cfg.max_steps:
            record = run.train_step(batches)
            validating = cfg.validate_every and (run.step % cfg.validate_every == 0 or run.step == cfg.max_steps)
            path, scores = _validation(run) if validating else (None, {})  # before the record, which holds scores
            if scores:
                record["eval"] = scores
            if ctx.is_main:
                _log_record(record, metrics_file, trackers, on_step)
            if cfg.record_samples:
                samples_file.write(json.dumps({"step": run.step, "batches": run.step_batches}) + "\n")
                samples_file.flush()
            bar.update(1)
            if run.step % cfg.log_every == 0 or run.step == cfg.max_steps:
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                log.info("step %d loss %.5f lr %.3g grad_norm %.3g", run.step, record["loss"], record["lr"],
                         record["grad_norm"])
            if run.stop_signal is not None and run.step < cfg.max_steps:  # every rank read it in the same step
                run.stop()
            if path is not None:
                validations.append(str(path))
                trackers.log_image("validation", path, run.step)
                if video_path(path).is_file():  # a video family's videos, every frame
                    trackers.log_video("validation_video", video_path(path), run.step)
            if cfg.save_every and (run.step % cfg.save_every == 0 or run.step == cfg.max_steps):
                run.save()
        run.check_shards_read(wait=True)  # the run ends only on shards checked whole (before the loader closes)
    if run.validator is not None:
        run.validator.close()
    if run.evaluator is not None:
        run.evaluator.close()
    exported = run.export(export_dir if export_dir is not None else train_dir / "export", validations) \
        if cfg.export else None
    return run.summary(exported, validations)


def _validation(run: _Run) -> tuple[Path | None, dict[str, float]]:
    """A validation step's work: the held-out evaluation, the samples (every rank takes part) and, with the
    curate CLIP scorer, their CLIP score. The grid's path and the scores on rank 0 (None and {} elsewhere,
    but the evaluation's under FSDP2)."""
    scores = run.evaluate() if run.evaluator is not None else {}
    path = run.validate()
    if path is not None and run.clip is not None:
        rows = [grid_frames(row) for row in run.validator.rows]
        scores["clip_score"] = clip_score(run.clip, rows, run.cfg.validation_prompts)
    return path, scores


def _log_record(record: dict, metrics_file: Any, trackers: Trackers, on_step: Callable[[dict], None] | None) -> None:
    """Rank 0: one metrics line per optimizer step, the trackers' scalars, the caller's progress hook."""
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    trackers.log_metrics(record)
    if "eval" in record:
        trackers.log_metrics({"step": record["step"], **record["eval"]}, prefix="eval")
    if on_step is not None:
        on_step(record)


Draws = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None, list[torch.Tensor]]


def draw_micro_batch(cfg: TrainerConfig, seed: int, shape: torch.Size, *, epoch: int, ordinals: list[int],
                     device: torch.device, posterior: bool, shift: float, expert: Expert,
                     extra_shapes: list[torch.Size] = ()) -> Draws:
    """(posterior eps or None, sigmas [B] (in ``expert``'s range), noise, image-to-video flags [B] or None, the
    noise of each of ``extra_shapes``: the adapter's ``noised_streams``) of one micro-batch of latents ``shape``,
    drawn sample by sample on ``device``.

    Per sample, in order: its posterior eps, its sigma, its noise, the noise of each noised stream and
    (``trainer.i2v_probability`` > 0) whether its first frame is a clean image condition, all from a generator
    of its own on ``device``, seeded by (run ``seed``, ``epoch``, the sample's epoch ordinal: its place in the
    epoch's global sequence, ``ordinals``). So a sample's draws depend neither on the rank that reads it, nor on
    the number of ranks, nor on how the global batch is cut into micro-batches: a run resumed on other ranks
    draws what the uninterrupted run drew, and accumulation 2 at batch B sees the same noise as accumulation 1
    at batch 2B. Nothing is drawn on the host and copied: a CUDA generator's draws are kernels seeded from
    its host-side state (they differ from the CPU's numbers, so a CPU run draws what it always drew).
    """
    eps, sigmas, noise, clean = [], [], [], []
    extra: list[list[torch.Tensor]] = [[] for _ in extra_shapes]
    i2v = cfg.i2v_probability
    for ordinal in ordinals:
        gen = torch.Generator(device).manual_seed(derive_seed(seed, f"sample:{epoch}:{ordinal}"))
        if posterior:
            eps.append(torch.randn(shape[1:], generator=gen, dtype=torch.float32, device=device))
        sigmas.append(expert_sigma(cfg, gen, shift, expert))
        noise.append(torch.randn(shape[1:], generator=gen, dtype=torch.float32, device=device))
        for draws, extra_shape in zip(extra, extra_shapes):
            draws.append(torch.randn(extra_shape[1:], generator=gen, dtype=torch.float32, device=device))
        if i2v > 0:
            clean.append(torch.rand(1, generator=gen, device=device) < i2v)
    return (torch.stack(eps) if posterior else None, torch.cat(sigmas), torch.stack(noise),
            torch.cat(clean) if i2v > 0 else None, [torch.stack(draws) for draws in extra])


class _Run:
    """One process's training run: data, model, optimizer and their state, and the steps that change them.

    Split the way torchtitan splits its trainer: ``__init__`` builds (data, model, optimizer), ``resume``
    restores, ``forward_backward`` is one micro-batch, ``train_step`` one optimizer step (micro-batches,
    one reduction of the step's statistics, clip, step or skip), ``save``, ``validate`` and ``export`` the
    periodic and final work. ``_train`` is the loop around them.
    """

    def __init__(self, cfg: TrainerConfig, ctx: DistContext, parallel: ParallelConfig, cache_dir: Path,
                 pretrained: str, train_dir: Path, seed: int, check_cache: Callable[[dict], None] | None,
                 provenance: dict[str, Any], stream: StreamSource | None = None,
                 shuffle_block: int | None = None) -> None:
        self.cfg, self.ctx, self.parallel, self.pretrained, self.seed = cfg, ctx, parallel, pretrained, seed
        self.train_dir, self.provenance = train_dir, provenance
        self.ckpt_dir, self.metrics_path = train_dir / "checkpoints", train_dir / "metrics.jsonl"
        # which checkpoint, and the per-rank batch that keeps its global batch here, before any work
        self.resume_path = resolve_resume(cfg.resume, self.ckpt_dir, announce=ctx.is_main)
        if self.resume_path is not None:
            self.cfg = cfg = _resumed_batch(cfg, read_trainer_state(self.resume_path), ctx, self.resume_path)
        if ctx.is_main:
            train_dir.mkdir(parents=True, exist_ok=True)
        self.device = ctx.device
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.cpu_threads = _use_cpu_threads(cfg, self.device)
        self._build_data(cache_dir, check_cache, stream, shuffle_block)
        self._build_model()
        self._build_optimizer()
        self.start_step = self.step = 0
        self.last_loss, self.skipped, self.skipped_in_row = float("nan"), 0, 0
        self.samples_seen, self.train_time, self.data_time = 0, 0.0, 0.0
        self.step_batches: list[dict[str, Any]] = []  # where the last step's micro-batches sat (record_samples)
        self.stop_signal: int | None = None  # a stop request every rank agreed on (train_step)
        # validation's VAE: loaded at the first validation, kept on the CPU in between (its prompts: _build_data)
        self.validator = Validator(self.adapter, pretrained, self.device, component=self.parts[0].expert.component,
                                   prompts=self.validation_prompts) if cfg.validate_every else None
        self.evaluator = self._build_evaluator(cache_dir)
        self.clip: Any = None  # the curate stage's CLIP scorer of validation images (_train: the recipe's)
        self.last_eval: dict[str, float] = {}

    # ---------------------------------------------------------------- building
    def _validation_prompts(self, cache_dir: Path) -> CachedPrompts | None:
        """The validation prompts' cached embeddings (and the negative prompt's); None for a family whose
        pipeline encodes its prompts itself."""
        if not self.adapter.prompts_from_cache:
            return None
        return cached_prompts(self.manifest, cache_dir, [*self.cfg.validation_prompts, self.adapter.negative_prompt],
                              str(cache_dir))

    def _build_data(self, cache_dir: Path, check_cache: Callable[[dict], None] | None,
                    stream: StreamSource | None, shuffle_block: int | None) -> None:
        """The cache manifest, the family's adapter, and this rank's loader."""
        cfg, ctx = self.cfg, self.ctx
        self.stream_source = stream
        self.manifest = read_manifest(cache_dir)
        if check_cache is not None:
            check_cache(self.manifest)
        self.adapter = get_adapter(manifest_family(self.manifest))
        check_streams(self.manifest, self.adapter.family, self.adapter.streams, str(cache_dir / "manifest.json"))
        check_i2v(cfg.i2v_probability, self.adapter.family)
        check_validation(cfg.validate_every, self.adapter.family)
        check_context_parallel(self.parallel, self.adapter, ctx.device)
        # the ranks of a cp group read the same samples (latentmill.trainer.context)
        self.loader = LatentLoader(
            cache_dir, cfg.batch_size, self.seed, dtype=torch.float32, drop_last=cfg.drop_last,
            verify=cfg.verify_shards, manifest=self.manifest, rank=ctx.dp_rank, world_size=ctx.dp_size,
            caption_dropout=cfg.caption_dropout, check_on_read=not cfg.verify_shards,
            stream=stream.open(ctx.rank) if stream is not None else None, shuffle_block=shuffle_block,
        )
        warning = cache_fit_warning(self.loader.stream, shuffle_block) if self.loader.stream is not None else None
        if warning and ctx.is_main:
            log.warning(warning)
        self.text_len = _text_length(self.manifest)
        if cfg.validate_every:  # every cp rank samples the validation prompts: the plan splits their sequences
            check_cp_validation(self.parallel, self.adapter, cfg.validation_size, self.pretrained, self.text_len)
        # validation prompts' embeddings from the snapshot, before any model loads (a snapshot without them stops here)
        self.validation_prompts = self._validation_prompts(cache_dir) if cfg.validate_every else None
        log.info("%s cache %s: %d samples in %d buckets, %d batches per epoch and rank", self.adapter.family,
                 cache_dir, self.loader.num_samples, len(self.loader.buckets), len(self.loader))

    def _build_evaluator(self, cache_dir: Path) -> Evaluator | None:
        """The held-out evaluation at each validation (``trainer.evaluation``): on rank 0, or on every rank under
        FSDP2 (a collective forward); none without validations, held-out samples, or with context parallelism."""
        ctx = self.ctx
        if not self.cfg.validate_every or not any("held_out" in e for e in self.manifest["shards"]):
            return None
        if ctx.cp_size > 1 or not (ctx.is_main or ctx.sharded):
            if ctx.is_main:
                log.warning("held-out evaluation is off with context parallelism (parallel.cp_size > 1)")
            return None
        return Evaluator(cache_dir, self.manifest, self.cfg.batch_size, self.adapter, self.device,
                         stream=self.stream_source, rank=ctx.rank)

    def _build_model(self) -> None:
        """The trained models (``self.parts``: the pipeline's transformer, or the experts ``trainer.expert``
        names), each loaded and parallelised on its own (FSDP2: sharded apart, each its own root)."""
        cfg, ctx = self.cfg, self.ctx
        experts = choose_experts(self.adapter.experts(self.pretrained), cfg.expert, self.pretrained)
        self.expert_name = cfg.expert or "all"  # what the checkpoints record and a resume must match
        self.parts: list[Part] = []
        for expert in experts:
            # FSDP2: built on the meta device, sharded, and each rank reads only its own rows of the checkpoint;
            # a LoRA run's frozen base is bf16 on CUDA (float32 LoRA weights and masters)
            transformer, model = load_for_training(
                self.adapter, self.pretrained, cfg=cfg, parallel=self.parallel, ctx=ctx,
                init_seed=derive_seed(self.seed, "init" if len(experts) == 1 else f"init:{expert.name}"),
                component=expert.component)
            trainable = [p for p in transformer.parameters() if p.requires_grad]
            self.parts.append(Part(expert, transformer, model, trainable))
            log.info("%s mode, %s: %d trainable parameters", cfg.mode, expert.component,
                     sum(p.numel() for p in trainable))
        warning = routing_warning([p.expert for p in self.parts], cfg)
        if warning and ctx.is_main:
            log.warning(warning)
        # how many ranks hold each gradient element: all (DDP), one (FSDP2), the replicas (HSDP)
        self.grad_replicas = (self.parallel.hsdp_replicate if ctx.sharded else ctx.world_size) if ctx.initialized \
            else 1

    def _build_optimizer(self) -> None:
        """AdamW and the LR schedule of each model."""
        cfg = self.cfg
        for part in self.parts:
            part.optimizer = torch.optim.AdamW(part.trainable, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas),
                                               eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
            part.scheduler = torch.optim.lr_scheduler.LambdaLR(
                part.optimizer, lr_lambda(cfg.warmup_steps, cfg.max_steps, cfg.lr_schedule, cfg.min_lr_ratio))

    def resume(self) -> None:
        """Restore the latest (or the named) checkpoint, or set a previous run aside for a fresh start."""
        ctx = self.ctx
        if self.resume_path is not None:
            first = self.parts[0]
            state = load_checkpoint(self.resume_path, model=first.transformer, optimizer=first.optimizer,
                                    scheduler=first.scheduler, rank=ctx.rank, others=other_parts(self.parts))
            if state.get("expert", "all") != self.expert_name:  # same shapes: it would load without a word
                raise ConfigError(f"trainer.expert: {self.resume_path} trained expert {state.get('expert', 'all')!r}, "
                                  f"this run {self.expert_name!r}; resume with the same trainer.expert")
            self.loader.load_state_dict(state["loader"])
            for part in self.parts:
                _follow_current_schedule(part.scheduler, self.cfg.learning_rate)
            self.start_step = self.step = int(state["step"])
            self.last_loss = float(state.get("loss", float("nan")))
            self.skipped = int(state.get("skipped_steps", 0))
            self.skipped_in_row = int(state.get("skipped_in_row", 0))
            if ctx.is_main:  # every rank's samples record too: a run on fewer ranks leaves the others' files
                for path in [self.metrics_path, *_samples_files(self.train_dir)]:
                    _rewind_metrics(path, self.start_step)
            log.info("resumed from %s at step %d", self.resume_path, self.start_step)
        elif ctx.is_main:
            _set_aside_previous_run(self.train_dir, self.ckpt_dir, self.metrics_path)
            self.metrics_path.write_text("")
        ctx.barrier()  # every rank has decided where to start before rank 0 writes anything new

    # ---------------------------------------------------------------- one step
    def forward_backward(self, batch: dict[str, Any], part: Part, *, last_micro: bool,
                         micro_batches: int) -> torch.Tensor:
        """Flow-matching loss of one micro-batch on ``part``, backpropagated (scaled by 1/``micro_batches``, the
        part's micro-batches in this step); returns it detached.

        Each sample's randomness comes from its own generator on the device (``draw_micro_batch``). DDP reduces
        gradients on the last micro-batch only; FSDP2 reduce-scatters on every one (gradients stay sharded).
        """
        cfg, device, adapter = self.cfg, self.device, self.adapter
        inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        latents = inputs["latents"]
        check_cp_batch(adapter, inputs, self.ctx.cp_size)  # every bucket: its sequences must split evenly
        extra = adapter.noised_streams
        eps, sigmas, noise, clean_first, extra_noise = draw_micro_batch(
            cfg, self.seed, latents.shape, device=device, epoch=batch["epoch"], ordinals=batch["ordinals"],
            posterior="latents_std" in inputs, shift=shift_for(cfg, adapter.seq_len(latents), adapter.resolution_mu), expert=part.expert,
            extra_shapes=[inputs[name].shape for name in extra])
        if eps is not None:  # a fresh draw from the cached posterior each time
            latents = latents + inputs["latents_std"] * eps
        noisy = interpolate(latents, noise, sigmas)
        target = velocity_target(latents, noise)
        extra_targets = {}
        for name, stream_noise in zip(extra, extra_noise):  # noised at the same sigma as the latents
            extra_targets[name] = velocity_target(inputs[name], stream_noise)
            inputs[name] = interpolate(inputs[name], stream_noise, sigmas)
        mask = None
        # image-to-video: frame 0 is the image latent (the pipeline's argmax encode); a one-frame sample (an
        # image) has no later frame to learn from it and trains as text-to-video
        if clean_first is not None and latents.shape[2] > 1:
            mask = inputs["first_frame_mask"] = first_frame_mask(latents.shape, clean_first)
            noisy = mask * noisy + (1 - mask) * inputs["latents"]
        weights = loss_weights(sigmas, cfg.loss_weighting) if cfg.loss_weighting != "none" else None
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        with _grad_sync(part.model, last_micro, hsdp=self.parallel.hsdp_replicate > 1):
            with autocast:
                pred = adapter.forward(part.model, noisy, sigmas, inputs, cfg)
            pred, extra_preds = pred if extra else (pred, {})
            loss = flow_matching_loss(pred, target, weights, mask)
            for name, extra_pred in extra_preds.items():
                loss = loss + cfg.audio_loss_weight * flow_matching_loss(extra_pred, extra_targets[name], weights)
            # FSDP2 also averages over the cp ranks, whose gradients are shares to be summed (trainer/context.py)
            (loss * self.ctx.cp_size / micro_batches).backward()
        return loss.detach()

    def train_step(self, batches: Any) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns its metrics record.

        One all-reduce of one small tensor (this rank's loss sum, sample count and non-finite flag, and the
        gradient norm) and one host read of it per step and trained model: the skip decision, the logged loss
        and the global batch all come from those reads. A step with a non-finite loss or gradient changes no
        weight; every rank reads the same reduced values, so all skip together.

        Two experts (``trainer.expert: both``): each micro-batch goes to the expert ``route_micro_batches`` picks; each
        expert in turn runs its micro-batches (its gradients averaged over them), is clipped and stepped by its
        own optimizer, and drops its gradients before the other one runs.
        """
        cfg, ctx = self.cfg, self.ctx
        accum = cfg.grad_accum_steps
        t_start = time.perf_counter()
        t_data, fetched = 0.0, []
        for _ in range(accum):
            t_fetch = time.perf_counter()
            fetched.append(next(batches))
            t_data += time.perf_counter() - t_fetch
        self.step_batches = [{k: b[k] for k in ("epoch", "index", "keys", "ordinals")} for b in fetched]
        if self.step == self.start_step:
            for part in self.parts:
                self.adapter.check_batch(part.transformer, {k: v for k, v in fetched[0].items()
                                                            if isinstance(v, torch.Tensor)})
        routes = route_micro_batches(self.parts, self.cfg, self.seed, self.step)
        loss_total, global_batch, squares, skip = 0.0, 0, 0.0, False
        expert_norms, expert_micro = {}, {}
        check = self.loader.shard_check
        for index, part in enumerate(self.parts):
            micro = [i for i, route in enumerate(routes) if route == index]
            if not micro:  # every rank routed alike: none of them runs this part in this step
                continue
            part.optimizer.zero_grad(set_to_none=True)
            loss_sum, step_samples = None, 0
            for j, i in enumerate(micro):
                step_samples += int(fetched[i]["latents"].shape[0])
                loss = self.forward_backward(fetched[i], part, last_micro=j == len(micro) - 1,
                                             micro_batches=len(micro))
                loss_sum = loss if loss_sum is None else loss_sum + loss  # on the device: no read per micro-batch
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                     for p in part.trainable if p.grad is not None]  # this rank's (shards of the) averaged grads
            try:
                part_loss, part_samples, nonfinite, norm, self.stop_signal = _reduce_step_stats(
                    ctx, loss_sum, step_samples, grads, grad_replicas=self.grad_replicas,
                    stop=interrupt.requested(), bad_shard=check is not None and check.failure is not None)
            except _BadShardSeen:
                self._stop_on_bad_shard()
            loss_total += part_loss
            global_batch += part_samples // ctx.cp_size  # every rank of a cp group counted the same samples
            squares += norm * norm
            expert_norms[part.expert.name], expert_micro[part.expert.name] = norm, len(micro)
            if nonfinite or not (math.isfinite(part_loss) and math.isfinite(norm)):
                skip = True
                part.optimizer.zero_grad(set_to_none=True)
                continue
            if cfg.grad_clip > 0 and norm > cfg.grad_clip:  # clip_grad_norm_'s rule, with the norm already read
                torch._foreach_mul_(grads, cfg.grad_clip / (norm + 1e-6))
            part.optimizer.step()
            if len(self.parts) > 1:  # this expert's gradients go before the other one trains
                part.optimizer.zero_grad(set_to_none=True)
        self.last_loss = loss_total / (accum * ctx.world_size)  # the mean loss of the global batch
        norm = next(iter(expert_norms.values())) if len(expert_norms) == 1 \
            else math.sqrt(squares) if math.isfinite(squares) else float("nan")  # over both experts' gradients
        lr = self.parts[0].scheduler.get_last_lr()[0]
        if skip:
            self._skip(norm)
        else:
            self.skipped_in_row = 0
        with warnings.catch_warnings():  # a skipped first step: the schedule follows steps, not updates
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for part in self.parts:  # the schedule follows steps: an expert without micro-batches keeps pace
                part.scheduler.step()
        self.step += 1
        # no device synchronize for the timing: the next step's read waits for this step's optimizer kernels,
        # so step times add up to the run's wall time
        t_step = time.perf_counter() - t_start
        self.samples_seen += global_batch
        self.train_time += t_step
        self.data_time += t_data
        return {
            "step": self.step,
            "loss": self.last_loss,
            "lr": lr,
            "grad_norm": norm,
            "samples_per_s": global_batch / t_step,
            "data_wait_s": t_data,
            "data_wait_fraction": t_data / t_step if t_step else 0.0,
            "step_time_s": t_step,
            "skipped": skip,
            "skipped_steps": self.skipped,
            "peak_mem_mb": peak_mem_mb(self.device),
            "epoch": fetched[-1]["epoch"],
            "bucket": fetched[-1]["bucket"],
            **({"expert_grad_norms": expert_norms, "expert_micro_batches": expert_micro} if len(self.parts) > 1
               else {}),
        }

    def _skip(self, norm: float) -> None:
        """Count a skipped step (its gradients are dropped); stop after ``max_skipped_steps`` in a row."""
        for part in self.parts:
            part.optimizer.zero_grad(set_to_none=True)
        self.skipped, self.skipped_in_row = self.skipped + 1, self.skipped_in_row + 1
        log.warning("step %d: loss %s, gradient norm %s: step skipped (%d in a row)", self.step + 1,
                    self.last_loss, norm, self.skipped_in_row)
        if self.skipped_in_row > self.cfg.max_skipped_steps:
            raise FloatingPointError(
                f"{self.skipped_in_row} steps in a row had a non-finite loss or gradient (up to step "
                f"{self.step + 1}, trainer.max_skipped_steps={self.cfg.max_skipped_steps}); the weights are still "
                "finite and the last checkpoint holds them: lower trainer.learning_rate, check the data, or use "
                "bf16 autocast and gradient clipping")

    # ---------------------------------------------------------------- periodic and final work
    def stop(self) -> None:
        """End the run after this step (SIGINT or SIGTERM): raise ``latentmill.interrupt.Interrupted``.

        SIGTERM, which SLURM and Kubernetes send before they kill a job, saves a checkpoint of this step
        first, so that the requeued job resumes here (``trainer.resume: latest``) exactly; SIGINT (Ctrl-C)
        stops without one, unless this is a checkpoint step anyway. Every rank calls this after the same step.
        """
        cfg, signum = self.cfg, self.stop_signal
        if signum == signal.SIGTERM or (cfg.save_every and self.step % cfg.save_every == 0):
            self.save()
        detail = stopped_detail(self.step, self.ckpt_dir, cfg.resume)
        if self.ctx.is_main:
            log.warning("%s by %s", detail, signal.Signals(signum).name)
        raise interrupt.Interrupted(signum, detail)

    def validate(self) -> Path | None:
        """Validation samples of the current weights (every rank takes part); the grid path on rank 0."""
        return self.validator.run(self.parts[0].transformer, cfg=self.cfg, step=self.step, train_dir=self.train_dir,
                                  max_sequence_length=self.text_len, is_main=self.ctx.is_main,
                                  others={p.expert.component: p.transformer for p in self.parts[1:]})

    def evaluate(self) -> dict[str, float]:
        """The held-out losses of the current weights (``trainer.evaluation``), every trained model serving its
        sigmas; logged on rank 0."""
        self.last_eval = self.evaluator.run([(p.expert, p.transformer) for p in self.parts], self.cfg)
        if self.ctx.is_main:
            log.info("step %d eval loss %.5f on %d held-out samples", self.step, self.last_eval.get("loss", float("nan")),
                     self.evaluator.samples)
        return self.last_eval

    def check_shards_read(self, *, wait: bool) -> None:
        """Stop, naming the shard, when any rank's shard check found a damaged one (every rank takes part);
        ``wait``: first let the checks of every shard read so far finish (a checkpoint, the end of the run)."""
        check = self.loader.shard_check
        if check is None:  # verify_shards: checked before the first step (the same on every rank)
            return
        if wait:
            check.wait()
        if self.ctx.sum(int(check.failure is not None)):
            self._stop_on_bad_shard()

    def _stop_on_bad_shard(self) -> None:
        """Raise ``CorruptShardError`` with what every rank's shard check found (every rank calls this)."""
        failure = self.loader.shard_check.failure
        found = [failure] if failure else []
        if self.ctx.initialized:
            gathered: list[str | None] = [None] * self.ctx.world_size
            torch.distributed.all_gather_object(gathered, failure)
            found = sorted({f for f in gathered if f})
        raise CorruptShardError("\n".join(found)) from None

    def save(self) -> None:
        """A checkpoint of everything an exact resume needs (never one that holds a non-finite weight, nor one
        trained on a shard whose check has not finished)."""
        self.check_shards_read(wait=True)
        _check_finite_weights([p for part in self.parts for p in part.trainable], self.ctx, self.step)
        trainer_state = {
            "loader": self.loader.state_dict(),
            "loss": self.last_loss,
            "skipped_steps": self.skipped,
            "skipped_in_row": self.skipped_in_row,
            "seed": self.seed,
            "world_size": self.ctx.world_size,
            "cp_size": self.ctx.cp_size,
            "mode": self.cfg.mode,
            "family": self.adapter.family,
            "expert": self.expert_name,
            "strategy": self.parallel.strategy,
            "config": to_dict(self.cfg),
            "manifest_fingerprint": self.manifest.get("fingerprint"),
            "provenance": self.provenance,
        }
        first = self.parts[0]
        save_checkpoint(self.ckpt_dir, self.step, model=first.transformer, optimizer=first.optimizer,
                        scheduler=first.scheduler, trainer_state=trainer_state,
                        others=other_parts(self.parts),
                        keep_latest_k=self.cfg.keep_latest_k, rank=self.ctx.rank, barrier=self.ctx.barrier,
                        sharded=self.ctx.sharded,
                        # streamed from a store: each node trains in its own work folder, its local rank 0 keeps it
                        folder_rank=self.ctx.local_rank if self.stream_source is not None else None)

    def info(self) -> dict[str, Any]:
        """What trackers and the model card say about the run's data: the provenance (snapshot name and id),
        the family, and the snapshot's samples (``held_out`` of them never trained on), buckets and prep summary
        (``snapshot.prep``)."""
        snapshot = self.manifest.get("snapshot") or {}
        return {**self.provenance, "family": self.adapter.family,
                "samples": snapshot.get("samples", self.loader.num_samples),
                "held_out": (snapshot.get("eval") or {}).get("samples", 0),
                "buckets": snapshot.get("buckets", {}), "prep": snapshot.get("prep", {})}

    def export(self, export_dir: str | Path, validations: list[str]) -> Path | None:
        """The Diffusers artefact of the trained transformer, with ``latentmill.json`` and its model card
        (``README.md``, the last of ``validations`` in ``images/``); its path on rank 0, None elsewhere.

        Every rank takes part in the gathers (a LoRA export gathers only the LoRA weights; a full export
        streams the weights in ``trainer.export_dtype`` into safetensors files, no second model); ranks > 0
        return when the gathers are done, so none waits on a collective while rank 0 writes.
        """
        cfg = self.cfg
        first = self.parts[0]
        exported = export_trained(self.adapter, first.transformer, mode=cfg.mode, pretrained=self.pretrained,
                                  export_dir=export_dir, ctx=self.ctx, export_dtype=cfg.export_dtype,
                                  component=first.expert.component, lora_subfolder=first.expert.lora_folder,
                                  others=tuple((p.transformer, p.expert.component, p.expert.lora_folder)
                                               for p in self.parts[1:]))
        if exported is not None:
            folder = exported if exported.is_dir() else exported.parent
            _write_provenance(folder, self.provenance, cfg, self.step, self.last_loss, self.manifest)
            write_model_card(folder, cfg=cfg, info=self.info(), pretrained=self.pretrained, steps=self.step,
                             final_loss=self.last_loss, video=self.adapter.latent_ndim == 4,
                             validations=validations,
                             trigger=trigger_phrase(self.loader.captions()))
            log.info("exported %s weights to %s", cfg.mode, exported)
        return exported

    def summary(self, exported: Path | None, validations: list[str]) -> dict[str, Any]:
        """What ``train`` returns (see its docstring)."""
        loader = self.loader
        return {
            "steps": self.step,
            "steps_this_run": self.step - self.start_step,
            "final_loss": self.last_loss,
            "samples_per_s": self.samples_seen / self.train_time if self.train_time else 0.0,
            "data_wait_fraction": self.data_time / self.train_time if self.train_time else 0.0,
            "peak_rss_mb": peak_rss_mb(),
            "peak_mem_mb": peak_mem_mb(self.device),
            "export_dir": str(exported) if exported is not None else None,
            "resumed_from": str(self.resume_path) if self.resume_path is not None else None,
            "world_size": self.ctx.world_size,
            "cp_size": self.ctx.cp_size,  # ranks that split each sample's sequence (parallel.cp_size)
            "epochs": loader.epoch + loader.batch_index / max(1, len(loader)),  # position of this rank's data
            "family": self.adapter.family,
            "expert": self.expert_name,
            "validation": validations,
            **({"eval": self.last_eval} if self.last_eval else {}),
            "cpu_threads": self.cpu_threads.threads,  # intra-op threads of this run (CUDA: torch's own)
            "cpu_threads_reason": self.cpu_threads.reason,
            "shards_checked": self.loader.shard_check.checked if self.loader.shard_check is not None
            else len(self.loader.verified_shards),
            # a snapshot on a store: what this rank's stream fetched (requests, bytes, downloads, evictions)
            **({"stream": self.loader.stream.counters()} if self.loader.stream is not None else {}),
            **self.provenance,
        }


class _BadShardSeen(Exception):
    """Some rank's shard check found a damaged shard (``_reduce_step_stats``: every rank raises it at once)."""


def stopped_detail(step: int | None, ckpt_dir: Path, resume: str | None) -> str:
    """What a stopped run says about where it stopped and how to go on (after "interrupted; ")."""
    saved = list_checkpoints(ckpt_dir)
    after = f"stopped after step {step}" if step is not None else "stopped"
    if not saved:
        return f"{after}, before the first checkpoint; run the same command to start over"
    where = "a checkpoint of it saved" if saved[-1][0] == step else f"last checkpoint: step {saved[-1][0]}"
    how = "run the same command again" if resume == "latest" else "run the same command with trainer.resume=latest"
    return f"{after} ({where}); {how} to resume from the checkpoint"


def _reduce_step_stats(ctx: DistContext, loss_sum: torch.Tensor, samples: int, grads: list[torch.Tensor], *,
                       grad_replicas: int, stop: int | None = None,
                       bad_shard: bool = False) -> tuple[float, int, bool, float, int | None]:
    """One all-reduce (sum) of [loss sum, non-finite flag, squared gradient norm, samples, SIGINT and SIGTERM
    flags, bad-shard flag], one host read.

    ``grads`` are this rank's gradients (local shards under FSDP2); ``stop`` the signal that asked this rank
    to stop (``latentmill.interrupt.requested()``). Returns (loss sum over ranks, samples over ranks, any
    rank's loss was not finite, the global gradient norm, the stop every rank agrees on: SIGTERM when any
    rank got it, else SIGINT when any rank got it, else None). Each gradient element is held by
    ``grad_replicas`` ranks (all of them under DDP, one under FSDP2, the replicas of HSDP), so the summed
    squares are divided by it. A signal reaches the ranks at different moments; agreeing here, in the read
    the step makes anyway, stops them all after the same step without a collective of its own. Raises
    ``_BadShardSeen`` on every rank when any rank passed ``bad_shard`` (its shard check found a damaged shard).
    """
    device = loss_sum.device
    loss_sum = loss_sum.detach().to(torch.float64).reshape(())
    if grads:
        norms = torch._foreach_norm(grads)  # one kernel per dtype and device, no read
        squares = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float64, device=device)
    flag = (~torch.isfinite(loss_sum)).to(torch.float64)
    # the host's values enter as fill kernels' arguments: a copy from the host would wait for the step's kernels
    host = [torch.full((), float(v), dtype=torch.float64, device=device)
            for v in (samples, stop == signal.SIGINT, stop == signal.SIGTERM, bad_shard)]
    stats = torch.stack([torch.nan_to_num(loss_sum, nan=0.0, posinf=0.0, neginf=0.0), flag, squares, *host])
    if ctx.initialized:
        torch.distributed.all_reduce(stats)
    total_loss, nonfinite, squares_sum, total_samples, sigints, sigterms, bad_shards = stats.tolist()
    if bad_shards:
        raise _BadShardSeen()
    norm = math.sqrt(squares_sum / grad_replicas) if math.isfinite(squares_sum) else float("nan")
    agreed = signal.SIGTERM if sigterms else signal.SIGINT if sigints else None
    return (float("nan") if nonfinite else total_loss), int(total_samples), nonfinite > 0, norm, agreed


def _resumed_batch(cfg: TrainerConfig, state: dict[str, Any], ctx: DistContext, path: Path) -> TrainerConfig:
    """``cfg`` with the per-rank batch size that keeps checkpoint ``path``'s global batch on this run's
    data-parallel ranks (``resume_batch_size``; a ``ConfigError`` when they cannot split it)."""
    saved = state.get("loader", {})
    batch = resume_batch_size(saved, cfg.batch_size, ctx.dp_size, str(path))
    if batch == cfg.batch_size:
        return cfg
    if ctx.is_main:
        log.warning("resuming %s on %d data-parallel ranks: trainer.batch_size %d per rank (saved: %d on %d ranks) "
                    "keeps its global batch", path, ctx.dp_size, batch, saved.get("batch_size"),
                    saved.get("world_size", 1))
    return dataclasses.replace(cfg, batch_size=batch)


def _write_provenance(folder: Path, provenance: dict[str, Any], cfg: TrainerConfig, step: int, loss: float,
                      manifest: dict) -> None:
    """``latentmill.json`` in an export folder: which data (snapshot) and settings made these weights."""
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


def _use_cpu_threads(cfg: TrainerConfig, device: torch.device) -> ThreadChoice:
    """On the CPU: set torch's intra-op threads to ``choose_cpu_threads``'s choice; on CUDA leave torch's
    (the step's work is on the GPU; its CPU threads only launch kernels and copy batches)."""
    if device.type != "cpu":
        return ThreadChoice(torch.get_num_threads(), f"{device.type}: torch's default, left as it is")
    choice = choose_cpu_threads(cfg.cpu_threads)
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    log.info("CPU training on %d intra-op threads (%s)", choice.threads, choice.reason)
    return choice


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
