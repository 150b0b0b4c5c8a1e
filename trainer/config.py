"""Typed configuration of the trainer room: ``TrainerConfig`` (the ``trainer:`` recipe section) and
``ParallelConfig`` (the ``parallel:`` section).

Both load through ``latentmill.config.from_dict``, which checks types and Literal choices and then calls
``validate()`` for the cross-field rules below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from latentmill.config import ConfigError


@dataclass
class TrainerConfig:
    """How to train: mode, optimiser, schedule, timestep sampling, checkpointing, LoRA and export."""

    mode: Literal["full", "lora"] = "full"
    max_steps: int = 100
    batch_size: int = 4
    # --- optimiser (AdamW) and schedule (linear warmup, then constant) ---
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    # --- checkpointing ---
    save_every: int = 50  # also saves at the final step; 0 disables checkpoints
    keep_latest_k: int = 3  # 0 keeps all
    # "latest" (none yet: fresh start) | path to a step-NNNNNN folder | null (fresh start; a previous run in
    # the same train_dir is moved to checkpoints.previous/ and metrics.previous.jsonl)
    resume: Optional[str] = None
    # --- flow-matching timesteps: sigma ~ sampling, then sigma' = shift*sigma / (1 + (shift-1)*sigma) ---
    timestep_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    guidance_scale: float = 3.5  # fed to guidance-embedding models (FLUX.1-dev style), ignored otherwise
    # --- LoRA (mode: lora) ---
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["to_k", "to_q", "to_v", "to_out.0"])
    # --- data ---
    drop_last: bool = False  # drop each bucket's last partial batch
    verify_shards: bool = False  # check each shard's sha256 against the manifest before training
    # --- logging and export ---
    log_every: int = 10  # progress-bar / log line cadence; metrics.jsonl gets every step regardless
    export: bool = True

    def validate(self) -> None:
        """Reject values that type-check but cannot work, naming the key."""
        positive = {"max_steps": self.max_steps, "batch_size": self.batch_size, "log_every": self.log_every}
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"trainer.{key}: must be >= 1, got {value}")
        non_negative = {
            "warmup_steps": self.warmup_steps,
            "save_every": self.save_every,
            "keep_latest_k": self.keep_latest_k,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
        }
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"trainer.{key}: must be >= 0, got {value}")
        if self.learning_rate <= 0:
            raise ConfigError(f"trainer.learning_rate: must be > 0, got {self.learning_rate}")
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ConfigError(f"trainer.adam_betas: each must be in [0, 1), got {list(self.adam_betas)}")
        if self.shift <= 0:
            raise ConfigError(f"trainer.shift: must be > 0, got {self.shift}")
        if self.logit_std <= 0:
            raise ConfigError(f"trainer.logit_std: must be > 0, got {self.logit_std}")
        if self.mode == "lora":
            if self.lora_rank < 1:
                raise ConfigError(f"trainer.lora_rank: must be >= 1, got {self.lora_rank}")
            if not self.lora_target_modules:
                raise ConfigError("trainer.lora_target_modules: must name at least one module in lora mode")
        if self.resume is not None and not str(self.resume).strip():
            raise ConfigError("trainer.resume: use 'latest', a checkpoint folder path, or null")


@dataclass
class ParallelConfig:
    """How to spread training over processes: ``none`` (one process) or ``ddp`` (under torchrun)."""

    strategy: Literal["none", "ddp", "fsdp2"] = "none"

    def validate(self) -> None:
        """Fail early for strategies that are declared in the recipe schema but not implemented yet."""
        if self.strategy == "fsdp2":
            raise ConfigError(
                "parallel.strategy: 'fsdp2' is not available yet in this version of the trainer; "
                "use 'none' (single process) or 'ddp' (one full model copy per process)"
            )
