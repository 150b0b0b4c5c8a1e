"""The flow-matching trainer: reads ONLY cached latent shards, trains an unmodified Diffusers transformer.

Public API::

    from latentmill.trainer import TrainerConfig, ParallelConfig, train
    summary = train(TrainerConfig(max_steps=200), cache_dir=..., pretrained=..., train_dir=..., seed=0)

Modules: ``config`` (typed recipe sections), ``objective`` (flow matching: timestep sampling, shift,
interpolation, target, loss weighting), ``adapter`` / ``adapters`` (the per-family interface and registry),
``flux`` (Flux-class images), ``wan`` (Wan-class videos), ``loader`` (``LatentLoader``, cache format 3),
``checkpoint`` (atomic step folders; DCP shards under FSDP2), ``parallel`` (none / DDP / FSDP2 / HSDP,
activation checkpointing, compile), ``validation`` (sample grids), ``train`` (the loop).
"""

import importlib
import sys
import types

# Each public name and the module it comes from, imported on first use (PEP 562): a recipe's trainer
# sections (``latentmill.trainer.config``) load without torch and the model code.
_EXPORTS = {
    "ModelAdapter": "adapter",
    "ADAPTERS": "adapters", "get_adapter": "adapters",
    "latest_checkpoint": "checkpoint", "list_checkpoints": "checkpoint", "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "ParallelConfig": "config", "TrainerConfig": "config",
    "FluxAdapter": "flux", "export_flux": "flux", "flux_forward": "flux", "latent_image_ids": "flux",
    "load_flux_transformer": "flux", "pack_latents": "flux", "unpack_latents": "flux",
    "LatentLoader": "loader", "read_manifest": "loader",
    "flow_matching_loss": "objective", "interpolate": "objective", "loss_weights": "objective",
    "resolution_mu": "objective", "sample_sigmas": "objective", "shift_sigmas": "objective",
    "velocity_target": "objective",
    "train": "train",
    "WanAdapter": "wan", "wan_forward": "wan",
}


class _Trainer(types.ModuleType):
    """This package, with its public names imported when first used."""

    def __getattr__(self, name: str):
        if name in _EXPORTS:
            value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule not yet imported
            value = importlib.import_module(f"{__name__}.{name}")
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        # Importing the submodule ``latentmill.trainer.train`` binds it here as ``train``: the package's
        # ``train`` stays the function, as when this file imported every module.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_EXPORTS})


sys.modules[__name__].__class__ = _Trainer

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
