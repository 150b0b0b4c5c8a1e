"""The flow-matching trainer: reads ONLY cached latent shards, trains an unmodified Diffusers transformer.

Public API::

    from latentmill.trainer import TrainerConfig, ParallelConfig, train
    summary = train(TrainerConfig(max_steps=200), cache_dir=..., pretrained=..., train_dir=..., seed=0)

Modules: ``config`` (typed recipe sections), ``objective`` (flow matching: timestep sampling, shift,
interpolation, target, loss weighting), ``adapter`` / ``adapters`` (the per-family interface and registry),
``flux`` (Flux-class images), ``wan`` (Wan-class videos), ``loader`` (``LatentLoader``, cache format 1 and 2),
``checkpoint`` (atomic step folders; DCP shards under FSDP2), ``parallel`` (none / DDP / FSDP2 / HSDP,
activation checkpointing, compile), ``validation`` (sample grids), ``train`` (the loop).
"""

from latentmill.trainer.adapter import ModelAdapter
from latentmill.trainer.adapters import ADAPTERS, get_adapter
from latentmill.trainer.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from latentmill.trainer.config import ParallelConfig, TrainerConfig
from latentmill.trainer.flux import (
    FluxAdapter,
    export_flux,
    flux_forward,
    latent_image_ids,
    load_flux_transformer,
    pack_latents,
    unpack_latents,
)
from latentmill.trainer.loader import LatentLoader, read_manifest
from latentmill.trainer.objective import (
    flow_matching_loss,
    interpolate,
    loss_weights,
    resolution_mu,
    sample_sigmas,
    shift_sigmas,
    velocity_target,
)
from latentmill.trainer.train import train
from latentmill.trainer.wan import WanAdapter, wan_forward

__all__ = [
    "ADAPTERS",
    "FluxAdapter",
    "LatentLoader",
    "ModelAdapter",
    "ParallelConfig",
    "TrainerConfig",
    "WanAdapter",
    "export_flux",
    "flow_matching_loss",
    "flux_forward",
    "get_adapter",
    "interpolate",
    "latent_image_ids",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_flux_transformer",
    "loss_weights",
    "pack_latents",
    "read_manifest",
    "resolution_mu",
    "sample_sigmas",
    "save_checkpoint",
    "shift_sigmas",
    "train",
    "unpack_latents",
    "velocity_target",
    "wan_forward",
]
