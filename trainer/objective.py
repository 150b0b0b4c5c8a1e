"""Rectified-flow / flow-matching objective, in the convention of Diffusers' Flux, SD3 and Wan pipelines.

With clean latents x0, Gaussian noise eps and a noise level sigma in [0, 1]:

    x_sigma = (1 - sigma) * x0 + sigma * eps        (sigma = 0: data, sigma = 1: pure noise)
    target  = d x_sigma / d sigma = eps - x0        (the velocity the network predicts)
    loss    = mean(w(sigma) * (prediction - target) ** 2)      (w = 1 unless loss_weighting says otherwise)

``FlowMatchEulerDiscreteScheduler`` samples with ``x_next = x + (sigma_next - sigma) * prediction``, which is
exactly this velocity; ``UniPCMultistepScheduler(prediction_type="flow_prediction")`` (Wan) recovers
``x0 = x_sigma - sigma * prediction`` from the same velocity.

Noise levels: sigma is drawn by ``timestep_sampling`` (SD3's ``logit_normal``, ``mode`` or ``uniform``), then
shifted by ``sigma' = s * sigma / (1 + (s - 1) * sigma)``: ``s = shift`` (fixed), or ``s = exp(mu)`` with
``mu`` linear in the latent token count (``shift_mode: resolution``, Flux's ``calculate_shift``; the shift
``time_shift(mu, 1, sigma)`` of the Flux pipeline is the same map with ``s = exp(mu)``).

Image-to-video by a clean first frame (Wan 2.2 TI2V, ``trainer.i2v_probability``): a sample drawn for it keeps
latent frame 0 clean (``first_frame_mask`` is 0 there), its tokens get timestep 0, and only the other frames
count in the loss, as ``WanImageToVideoPipeline`` runs with ``expand_timesteps``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for one purpose (model init, noise sampling) from the run seed."""
    digest = hashlib.sha256(f"latentmill:{purpose}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SigmaSampling(Protocol):
    """The fields of ``TrainerConfig`` that choose how training noise levels are drawn."""

    timestep_sampling: str
    logit_mean: float
    logit_std: float
    shift: float


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Flux/SD3 timestep shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma)."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def resolution_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """Flux's ``calculate_shift``: mu linear in the token count, base_shift at base_seq_len, max_shift at max."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def shift_for(cfg, image_seq_len: int, mu_for: Callable[[int, Any], float] | None = None) -> float:
    """The shift of a batch whose latents are ``image_seq_len`` transformer tokens, per ``cfg.shift_mode``:
    ``resolution`` takes ``exp(mu)``, mu from ``mu_for(image_seq_len, cfg)`` (the family's rule, its
    adapter's ``resolution_mu``), by default Flux's ``calculate_shift`` over the cfg's base/max values."""
    if getattr(cfg, "shift_mode", "fixed") == "fixed":
        return cfg.shift
    if mu_for is not None:
        return math.exp(mu_for(image_seq_len, cfg))
    mu = resolution_mu(
        image_seq_len, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
    )
    return math.exp(mu)


def sample_sigmas(
    n: int, cfg: SigmaSampling, generator: torch.Generator | None = None, shift: float | None = None
) -> torch.Tensor:
    """Draw ``n`` noise levels in [0, 1] as float32 from ``generator``, on its device (the CPU without one).

    ``logit_normal``: sigma = sigmoid(u), u ~ N(logit_mean, logit_std) (SD3's default);
    ``mode``: u ~ U[0, 1), sigma = 1 - u - mode_scale * (cos(pi u / 2)^2 - 1 + u) (SD3's mode sampling);
    ``uniform``: sigma ~ U[0, 1). Then ``shift`` (default ``cfg.shift``) is applied (``shift_sigmas``).
    """
    device = generator.device if generator is not None else None
    if cfg.timestep_sampling == "logit_normal":
        u = torch.randn(n, generator=generator, dtype=torch.float32, device=device)
        sigmas = torch.sigmoid(cfg.logit_mean + cfg.logit_std * u)
    elif cfg.timestep_sampling == "mode":
        u = torch.rand(n, generator=generator, dtype=torch.float32, device=device)
        sigmas = 1.0 - u - cfg.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1.0 + u)
    elif cfg.timestep_sampling == "uniform":
        sigmas = torch.rand(n, generator=generator, dtype=torch.float32, device=device)
    else:
        raise ValueError(f"unknown timestep_sampling {cfg.timestep_sampling!r}")
    return shift_sigmas(sigmas, cfg.shift if shift is None else shift)


# draws of sample_sigmas_within before it gives up: the range holds (almost) none of the distribution
MAX_DRAWS = 10_000


def sample_sigmas_within(cfg: SigmaSampling, generator: torch.Generator | None, shift: float, low: float,
                         high: float) -> torch.Tensor:
    """One noise level [1] drawn like ``sample_sigmas`` (after the shift), conditioned on ``low <= sigma < high``.

    Draws are repeated until one falls in the range (rejection), so the sigmas an expert trains on follow the
    recipe's distribution restricted to the noise levels that expert serves at inference.
    """
    for _ in range(MAX_DRAWS):
        sigma = sample_sigmas(1, cfg, generator, shift=shift)
        if low <= float(sigma) < high:
            return sigma
    raise ValueError(f"trainer.expert: no sigma in [{low:g}, {min(high, 1.0):g}] in {MAX_DRAWS} draws of "
                     f"timestep_sampling {cfg.timestep_sampling!r} at shift {shift:g}: that expert's noise levels "
                     "are (almost) never drawn; change trainer.shift or trainer.timestep_sampling")


def loss_weights(sigmas_B: torch.Tensor, scheme: str = "none") -> torch.Tensor:
    """Per-sample loss weights [B] (diffusers' ``compute_loss_weighting_for_sd3``).

    ``none``: 1; ``sigma_sqrt``: sigma^-2; ``cosmap``: 2 / (pi * (1 - 2 sigma + 2 sigma^2)).
    """
    sigmas_B = sigmas_B.float()
    if scheme == "none":
        return torch.ones_like(sigmas_B)
    if scheme == "sigma_sqrt":
        return sigmas_B**-2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * sigmas_B + 2.0 * sigmas_B**2))
    raise ValueError(f"unknown loss_weighting {scheme!r}")


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


def first_frame_mask(shape: torch.Size, clean_B: torch.Tensor) -> torch.Tensor:
    """[B, 1, F, H, W] float32 for latents of ``shape`` [B, C, F, H, W]: 0 on latent frame 0 of the samples
    where ``clean_B`` (bool [B]) is true (their image condition, kept clean), 1 everywhere else."""
    mask = torch.ones(shape[0], 1, *shape[2:], dtype=torch.float32, device=clean_B.device)
    mask[:, :, 0] = (~clean_B).float().view(-1, 1, 1, 1)
    return mask


def flow_matching_loss(
    pred: torch.Tensor, target: torch.Tensor, weights_B: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over samples of (weight x mean squared error over the sample's elements), in float32.

    Without weights or mask this is the plain MSE over all elements (samples of one batch have the same size).
    ``mask`` (broadcast against ``pred``, 1 where a latent is learned, 0 on a clean condition): each sample's
    error is the mean over its learned elements only.
    """
    if weights_B is None and mask is None:
        return F.mse_loss(pred.float(), target.float())
    err = (pred.float() - target.float()).square()
    if mask is None:
        err_B = err.reshape(pred.shape[0], -1).mean(dim=1)
    else:
        mask = mask.to(err.device, torch.float32).expand_as(err)
        err_B = (err * mask).reshape(pred.shape[0], -1).sum(1) / mask.reshape(pred.shape[0], -1).sum(1)
    if weights_B is None:
        return err_B.mean()
    return (err_B * weights_B.to(err_B.device, torch.float32)).mean()
