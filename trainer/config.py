"""Typed configuration of the trainer room: ``TrainerConfig`` (the ``trainer:`` recipe section) and
``ParallelConfig`` (the ``parallel:`` section).

Both load through ``latentmill.core.config.from_dict``, which checks types and Literal choices and then calls
``validate()`` for the cross-field rules below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from latentmill.core.config import ConfigError


@dataclass
class TrainerConfig:
    """How to train: mode, optimiser, schedule, timestep sampling, checkpointing, LoRA, validation, export."""

    mode: Literal["full", "lora"] = "full"
    # a pipeline of two experts (Wan 2.2 A14B: high-noise transformer, low-noise transformer_2): the one this run
    # trains, on the noise levels it serves (sigma >= boundary_ratio: high), or both (each micro-batch goes to
    # the expert its drawn sigma selects); null for a one-transformer pipeline
    expert: Optional[Literal["high", "low", "both"]] = None
    max_steps: int = 100  # optimizer steps
    # samples per rank and micro-batch; a run resumed on another number of ranks keeps its global batch, and
    # with it this size x ranks (docs/training.md, "Resume on another number of GPUs")
    batch_size: int = 4
    grad_accum_steps: int = 1  # micro-batches per optimizer step (global batch = batch x accum x ranks)
    # --- optimiser (AdamW) and schedule (linear warmup, then lr_schedule down to min_lr_ratio) ---
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warmup, until max_steps
    min_lr_ratio: float = 0.0  # cosine/linear end at learning_rate * min_lr_ratio
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    # A step whose loss or gradient norm is not finite is skipped (no weight changes, counted as
    # skipped_steps); more than this many in a row stop the run with an error.
    max_skipped_steps: int = 10
    # --- checkpointing ---
    save_every: int = 50  # also saves at the final step; 0 disables checkpoints
    keep_latest_k: int = 3  # 0 keeps all
    # "latest" (none yet: fresh start) | path to a step-NNNNNN folder | null (fresh start; a previous run in
    # the same train_dir is moved to checkpoints.previous/ and metrics.previous.jsonl)
    resume: Optional[str] = None
    # --- flow-matching timesteps: sigma ~ sampling, then sigma' = shift*sigma / (1 + (shift-1)*sigma) ---
    timestep_sampling: Literal["logit_normal", "uniform", "mode"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29  # timestep_sampling: mode (SD3's value)
    # fixed: `shift`; resolution: shift = exp(mu), mu linear in the latent token count (Flux calculate_shift)
    shift_mode: Literal["fixed", "resolution"] = "fixed"
    shift: float = 1.0
    base_shift: float = 0.5  # shift_mode resolution: mu at base_image_seq_len tokens (FLUX.1-dev values)
    max_shift: float = 1.15  # ... and at max_image_seq_len tokens
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"  # as diffusers' SD3 weighting schemes
    # guidance-embedding models (FLUX.1-dev style): their guidance input, in training and validation;
    # models without one (Wan): only the classifier-free guidance scale of validation samples
    guidance_scale: float = 3.5
    caption_dropout: float = 0.0  # per-sample probability of training on the empty prompt instead
    # per-sample probability of training image-to-video: latent frame 0 stays clean as the image condition
    # (families whose adapter has first_frame_conditioning: Wan 2.2 TI2V); 0: text-to-video only
    i2v_probability: float = 0.0
    # weight of the audio term of the loss, for families that denoise a clip's sound with its frames (LTX-2):
    # loss = video MSE + audio_loss_weight x audio MSE, both at the sample's noise level
    audio_loss_weight: float = 1.0
    # --- LoRA (mode: lora) ---
    lora_rank: int = 16
    lora_alpha: float = 16.0
    # module-name suffixes, or one "re:<regex>" entry; null: the family's (its adapter's lora_targets)
    lora_target_modules: Optional[list[str]] = None
    # --- memory and speed, applied from outside to the unmodified model ---
    activation_checkpointing: bool = False  # recompute each transformer block in backward
    compile: bool = False  # torch.compile each transformer block
    # intra-op threads of CPU training; 0: OMP_NUM_THREADS when set, else the usable cores shared among the
    # node's ranks, less one for the loader's read-ahead thread (latentmill.trainer.threads; on CUDA unused)
    cpu_threads: int = 0
    # --- data ---
    drop_last: bool = False  # drop each bucket's last partial batch
    # false: each shard is checked against the manifest's sha256 the first time the run reads it, in a
    # background thread; the run stops naming a damaged shard, and checkpoints and the end of the run wait
    # for the checks of every shard read so far. true: every shard is checked before the first step.
    verify_shards: bool = False
    # write the samples of every step to <train_dir>/samples-rank<r>.jsonl, one file per rank (each micro-batch's
    # epoch, global batch index, sample keys and epoch ordinals): an audit of what a run read
    record_samples: bool = False
    # --- validation: sample the in-training model with the recipe's VAE/text encoders ---
    validate_every: int = 0  # 0: never; else every N optimizer steps (and at the last step)
    validation_prompts: list[str] = field(default_factory=list)
    validation_steps: int = 8  # denoising steps
    validation_size: list[int] = field(
        default_factory=lambda: [128, 128]
    )  # [width, height] or [w, h, frames]
    validation_seed: int = 0
    # --- logging and export ---
    log_every: int = 10  # progress-bar / log line cadence; metrics.jsonl gets every step regardless
    # where the metrics, validation images, recipe and snapshot also go, on rank 0: tensorboard (<run>/tb),
    # wandb, mlflow (extras; connected through their own environment variables); one that cannot start is a
    # warning and the run goes on without it, unless trackers_required
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    trackers_required: bool = False
    tracker_project: str = "latentmill"  # the W&B project, the MLflow experiment
    tensorboard: Optional[bool] = None  # the older key: true adds tensorboard to trackers, false removes it
    # the model card's license (a Hugging Face license id: apache-2.0, other, ...); null: the card names none
    license: Optional[str] = None
    export: bool = True
    # dtype of a full export's transformer weights (the model's storage dtype; bf16 halves the files and the
    # gather against the float32 training copy). A LoRA export keeps its float32 weights.
    export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    def active_trackers(self) -> list[str]:
        """``trackers`` with the older ``tensorboard`` key applied."""
        names = [n for n in self.trackers if not (n == "tensorboard" and self.tensorboard is False)]
        return names + ["tensorboard"] if self.tensorboard and "tensorboard" not in names else names

    def validate(self) -> None:
        """Reject values that type-check but cannot work, naming the key."""
        from latentmill.trainer.trackers import KNOWN_TRACKERS

        for name in self.trackers:
            if name not in KNOWN_TRACKERS:
                raise ConfigError(f"trainer.trackers: {name!r} is not a known tracker; known: "
                                  f"{', '.join(repr(k) for k in KNOWN_TRACKERS)}")
        if not self.tracker_project.strip():
            raise ConfigError("trainer.tracker_project: give a project name (the W&B project, the MLflow experiment)")
        positive = {
            "max_steps": self.max_steps,
            "batch_size": self.batch_size,
            "log_every": self.log_every,
            "grad_accum_steps": self.grad_accum_steps,
            "validation_steps": self.validation_steps,
            "base_image_seq_len": self.base_image_seq_len,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"trainer.{key}: must be >= 1, got {value}")
        non_negative = {
            "warmup_steps": self.warmup_steps,
            "save_every": self.save_every,
            "keep_latest_k": self.keep_latest_k,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
            "validate_every": self.validate_every,
            "max_skipped_steps": self.max_skipped_steps,
            "cpu_threads": self.cpu_threads,
        }
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"trainer.{key}: must be >= 0, got {value}")
        if self.learning_rate <= 0:
            raise ConfigError(f"trainer.learning_rate: must be > 0, got {self.learning_rate}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"trainer.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ConfigError(f"trainer.adam_betas: each must be in [0, 1), got {list(self.adam_betas)}")
        if self.shift <= 0:
            raise ConfigError(f"trainer.shift: must be > 0, got {self.shift}")
        if self.logit_std <= 0:
            raise ConfigError(f"trainer.logit_std: must be > 0, got {self.logit_std}")
        if self.max_image_seq_len <= self.base_image_seq_len:
            raise ConfigError(
                f"trainer.max_image_seq_len: must be > base_image_seq_len ({self.base_image_seq_len}), "
                f"got {self.max_image_seq_len}"
            )
        if self.expert == "both" and self.shift_mode != "fixed":
            raise ConfigError("trainer.expert: 'both' routes each micro-batch by a sigma drawn at trainer.shift, "
                              "the same on every rank: use trainer.shift_mode: fixed (the Wan pipelines' own)")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ConfigError(f"trainer.caption_dropout: must be in [0, 1], got {self.caption_dropout}")
        if not (self.audio_loss_weight >= 0.0 and math.isfinite(self.audio_loss_weight)):
            raise ConfigError(f"trainer.audio_loss_weight: must be a finite number >= 0, got {self.audio_loss_weight}")
        if not 0.0 <= self.i2v_probability <= 1.0:
            raise ConfigError(f"trainer.i2v_probability: must be in [0, 1], got {self.i2v_probability}")
        if self.mode == "lora":
            if self.lora_rank < 1:
                raise ConfigError(f"trainer.lora_rank: must be >= 1, got {self.lora_rank}")
            if self.lora_target_modules is not None and not self.lora_target_modules:
                raise ConfigError("trainer.lora_target_modules: must name at least one module in lora mode, or be "
                                  "null (the model family's)")
            regexes = [m for m in self.lora_target_modules or [] if str(m).startswith("re:")]
            if regexes and len(self.lora_target_modules) > 1:
                raise ConfigError("trainer.lora_target_modules: a 're:<regex>' entry must be the only one")
            if regexes:
                import re

                try:
                    re.compile(regexes[0][3:])
                except re.error as err:
                    raise ConfigError(f"trainer.lora_target_modules: {regexes[0]!r} is not a regex: {err}") from None
        if self.resume is not None and not str(self.resume).strip():
            raise ConfigError("trainer.resume: use 'latest', a checkpoint folder path, or null")
        if self.validate_every and not self.validation_prompts:
            raise ConfigError("trainer.validation_prompts: give at least one prompt when validate_every > 0")
        if len(self.validation_size) not in (2, 3) or any(v < 1 for v in self.validation_size):
            raise ConfigError(
                f"trainer.validation_size: expected [width, height] or [width, height, frames], "
                f"got {self.validation_size}"
            )


@dataclass
class ParallelConfig:
    """How to spread training over processes: one process, DDP, or FSDP2 (optionally HSDP), under torchrun."""

    strategy: Literal["none", "ddp", "fsdp2"] = "none"
    # fsdp2 only: replicate groups of a 2-D (replicate x shard) mesh; 1 = plain FSDP over all ranks (HSDP
    # with e.g. 2 on 2 nodes x 8 GPUs: shard within a node, replicate across nodes)
    hsdp_replicate: int = 1
    mixed_precision: bool = True  # fsdp2 on CUDA: bf16 params/compute, fp32 gradient reduction
    # how long a collective (barrier, all-reduce, gather) may wait for the other ranks before the job fails;
    # generous, because one rank may be saving a checkpoint of tens of GB to a slow shared disk meanwhile
    # (NCCL's own default is 10 minutes)
    timeout_minutes: int = 120
    # context parallelism (fsdp2 only): this many consecutive ranks split each sample's token sequence
    # (Diffusers' ContextParallelConfig: their attention exchanges heads or keys); they read the same samples,
    # so the data-parallel width is world / cp_size. 1 = off
    cp_size: int = 1
    # ulysses: all-to-all of heads (cp_size must divide the heads); ring: keys and values passed round the
    # ranks (CUDA flash/cuDNN attention only)
    cp_kind: Literal["ulysses", "ring"] = "ulysses"
    # nodes the recipe is laid out for (each running --nproc processes): ``latentmill plan``'s layout and the
    # default of ``train``/``run --nnodes``; null: one node (plan: parallel.hsdp_replicate nodes for HSDP)
    nnodes: Optional[int] = None

    def launch_nodes(self, given: int | None) -> int:
        """The nodes a training launch spans: ``given`` (``--nnodes``) when set, else ``nnodes``, else one."""
        return (self.nnodes or 1) if given is None else given

    def validate(self) -> None:
        """Check the options that only make sense together."""
        if self.nnodes is not None and self.nnodes < 1:
            raise ConfigError(f"parallel.nnodes: must be >= 1 (or null: one node), got {self.nnodes}")
        if (self.nnodes or 1) > 1 and self.strategy == "none":
            raise ConfigError(f"parallel.nnodes: {self.nnodes} nodes need parallel.strategy 'ddp' or 'fsdp2'")
        replicas = self.hsdp_replicate
        if self.nnodes is not None and replicas > 1 and self.nnodes % replicas and replicas % self.nnodes:
            raise ConfigError(f"parallel.nnodes: {self.nnodes} nodes cannot hold parallel.hsdp_replicate: {replicas} "
                              "replicas along node boundaries; set nnodes to a multiple or a divisor of "
                              "hsdp_replicate, or leave it unset (plan then counts hsdp_replicate nodes)")
        if self.cp_size < 1:
            raise ConfigError(f"parallel.cp_size: must be >= 1, got {self.cp_size}")
        if self.cp_size > 1 and self.strategy != "fsdp2":
            raise ConfigError(f"parallel.cp_size: {self.cp_size} needs parallel.strategy 'fsdp2' "
                              f"(got {self.strategy!r})")
        if self.timeout_minutes < 1:
            raise ConfigError(f"parallel.timeout_minutes: must be >= 1, got {self.timeout_minutes}")
        if self.hsdp_replicate < 1:
            raise ConfigError(f"parallel.hsdp_replicate: must be >= 1, got {self.hsdp_replicate}")
        if self.hsdp_replicate > 1 and self.strategy != "fsdp2":
            raise ConfigError(
                f"parallel.hsdp_replicate: {self.hsdp_replicate} needs parallel.strategy 'fsdp2' "
                f"(got {self.strategy!r})"
            )


@dataclass
class LoaderConfig:
    """How the trainer orders an epoch (``shuffle_block``) and reads a snapshot on an object store
    (``output_dir: s3://...``): its shards are streamed into a local cache folder of bounded size
    (``latentmill.trainer.stream``). A local snapshot is read in place."""

    # the local cache folder of streamed shards (each rank its own subfolder); null: <work folder>/stream-cache
    cache_dir: Optional[str] = None
    # the most bytes of shards kept there per rank: an int or a string like "20GB", "512MiB"; null: no limit
    # (a limit below a rank's share of the snapshot evicts shards and may fetch some again)
    cache_limit: Optional[Union[int, str]] = None
    # shards per shuffle block (mosaicml-streaming's shuffle_block_size, counted in shards: the cache limit
    # counts their bytes): each bucket's shards shuffled, cut into blocks of this many, samples shuffled within
    # a block and the blocks read one after another, so a rank needs about shuffle_block + 1 shards in its
    # cache; null: each bucket shuffled whole (any batch may read any shard)
    shuffle_block: Optional[int] = None

    def validate(self) -> None:
        from latentmill.trainer.stream import parse_bytes

        parse_bytes(self.cache_limit, "loader.cache_limit")
        if self.shuffle_block is not None and self.shuffle_block < 1:
            raise ConfigError(f"loader.shuffle_block: a number of shards >= 1, or null (each bucket shuffled "
                              f"whole), got {self.shuffle_block!r}")

    @property
    def limit_bytes(self) -> int | None:
        """``cache_limit`` in bytes."""
        from latentmill.trainer.stream import parse_bytes

        return parse_bytes(self.cache_limit, "loader.cache_limit")
