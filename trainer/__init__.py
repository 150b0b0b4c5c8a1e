"""The flow-matching trainer: reads ONLY cached latent shards, trains an unmodified Diffusers transformer.

Public API::

    from trainer import TrainerConfig, ParallelConfig, train
    summary = train(TrainerConfig(max_steps=200), cache_dir=..., pretrained=..., train_dir=..., seed=0)

Modules: ``config`` (typed recipe sections), ``objective`` (flow matching), ``flux`` (Flux model adapter,
load and export), ``loader`` (``LatentLoader``), ``checkpoint`` (atomic step folders), ``parallel``
(none / DDP under torchrun), ``train`` (the loop).
"""

from trainer.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from trainer.config import ParallelConfig, TrainerConfig
from trainer.flux import (
    export_flux,
    flux_forward,
    latent_image_ids,
    load_flux_transformer,
    pack_latents,
    unpack_latents,
)
from trainer.loader import LatentLoader, read_manifest
from trainer.objective import flow_matching_loss, interpolate, sample_sigmas, shift_sigmas, velocity_target
from trainer.train import train

__all__ = [
    "LatentLoader",
    "ParallelConfig",
    "TrainerConfig",
    "export_flux",
    "flow_matching_loss",
    "flux_forward",
    "interpolate",
    "latent_image_ids",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_flux_transformer",
    "pack_latents",
    "read_manifest",
    "sample_sigmas",
    "save_checkpoint",
    "shift_sigmas",
    "train",
    "unpack_latents",
    "velocity_target",
]
