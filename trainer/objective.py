"""Rectified-flow / flow-matching objective, in the convention of Diffusers' Flux and SD3 pipelines.

With clean latents x0, Gaussian noise eps and a noise level sigma in [0, 1]:

    x_sigma = (1 - sigma) * x0 + sigma * eps        (sigma = 0: data, sigma = 1: pure noise)
    target  = d x_sigma / d sigma = eps - x0        (the velocity the network predicts)
    loss    = mean((prediction - target) ** 2)

``FlowMatchEulerDiscreteScheduler`` samples with ``x_next = x + (sigma_next - sigma) * prediction``, which is
exactly this velocity. The network is given ``timestep = sigma`` (the Flux pipeline passes ``t / 1000`` with
``t = 1000 * sigma``).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class SigmaSampling(Protocol):
    """The fields of ``TrainerConfig`` that choose how training noise levels are drawn."""

    timestep_sampling: str
    logit_mean: float
    logit_std: float
    shift: float


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Flux/SD3 fixed timestep shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma)."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def sample_sigmas(n: int, cfg: SigmaSampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw ``n`` noise levels in (0, 1) as float32 on the CPU, from ``generator``.

    ``logit_normal``: sigma = sigmoid(u), u ~ N(logit_mean, logit_std) (SD3's default weighting by density);
    ``uniform``: sigma ~ U[0, 1). Then the fixed ``shift`` is applied (``shift_sigmas``).
    """
    if cfg.timestep_sampling == "logit_normal":
        u = torch.randn(n, generator=generator, dtype=torch.float32)
        sigmas = torch.sigmoid(cfg.logit_mean + cfg.logit_std * u)
    elif cfg.timestep_sampling == "uniform":
        sigmas = torch.rand(n, generator=generator, dtype=torch.float32)
    else:
        raise ValueError(f"unknown timestep_sampling {cfg.timestep_sampling!r}")
    return shift_sigmas(sigmas, cfg.shift)


def _per_sample(sigma_B: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape per-sample values [B] to broadcast against ``like`` [B, ...]."""
    return sigma_B.to(device=like.device, dtype=like.dtype).view(-1, *([1] * (like.ndim - 1)))


def interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma_B: torch.Tensor) -> torch.Tensor:
    """Point on the straight path from data to noise: (1 - sigma) * x0 + sigma * noise."""
    sigma = _per_sample(sigma_B, x0)
    return (1.0 - sigma) * x0 + sigma * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """What the network should predict at any sigma: noise - x0."""
    return noise - x0


def flow_matching_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over all elements, computed in float32 (uniform weighting over sigma)."""
    return F.mse_loss(pred.float(), target.float())
