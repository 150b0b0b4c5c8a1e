"""The flow-matching objective against its formulas and against Diffusers' scheduler."""

import math

import pytest
import torch

from trainer.config import TrainerConfig
from trainer.objective import (
    flow_matching_loss,
    interpolate,
    sample_sigmas,
    shift_sigmas,
    velocity_target,
)


def _data(shape=(3, 16, 4, 6)):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_interpolate_endpoints_and_midpoint():
    x0, noise = _data()
    n = x0.shape[0]
    assert torch.equal(interpolate(x0, noise, torch.zeros(n)), x0)
    assert torch.equal(interpolate(x0, noise, torch.ones(n)), noise)
    torch.testing.assert_close(interpolate(x0, noise, torch.full((n,), 0.25)), 0.75 * x0 + 0.25 * noise)


def test_interpolate_uses_one_sigma_per_sample():
    x0, noise = _data()
    sigmas = torch.tensor([0.0, 0.5, 1.0])
    out = interpolate(x0, noise, sigmas)
    assert torch.equal(out[0], x0[0])
    torch.testing.assert_close(out[1], 0.5 * x0[1] + 0.5 * noise[1])
    assert torch.equal(out[2], noise[2])


def test_target_is_the_velocity_of_the_path():
    x0, noise = _data()
    target = velocity_target(x0, noise)
    assert torch.equal(target, noise - x0)
    # An Euler step of the FlowMatch scheduler, x + (sigma_next - sigma) * v, stays on the straight path.
    s, s_next = torch.full((3,), 0.8), torch.full((3,), 0.3)
    stepped = interpolate(x0, noise, s) + (0.3 - 0.8) * target
    torch.testing.assert_close(stepped, interpolate(x0, noise, s_next))


def test_loss_is_mean_squared_error():
    pred, target = _data((2, 5))
    assert flow_matching_loss(pred, target).item() == pytest.approx(((pred - target) ** 2).mean().item())
    assert flow_matching_loss(target, target).item() == 0.0
    assert flow_matching_loss(pred.to(torch.bfloat16), target).dtype == torch.float32


def test_shift_formula_on_known_values():
    sig = torch.tensor([0.0, 0.25, 0.5, 1.0])
    # sigma' = 3 s / (1 + 2 s): 0, 0.75/1.5, 1.5/2, 1
    torch.testing.assert_close(shift_sigmas(sig, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    assert torch.equal(shift_sigmas(sig, 1.0), sig)
    assert (shift_sigmas(sig[1:3], 0.5) < sig[1:3]).all()  # shift < 1 moves toward the data end


def test_shift_matches_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    plain = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).sigmas
    shifted = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).sigmas
    torch.testing.assert_close(shift_sigmas(plain, 3.0), shifted)


def test_logit_normal_sigmas_statistics():
    cfg = TrainerConfig(timestep_sampling="logit_normal", logit_mean=1.0, logit_std=0.5)
    sig = sample_sigmas(200_000, cfg, torch.Generator().manual_seed(0))
    assert sig.dtype == torch.float32 and sig.shape == (200_000,)
    assert 0.0 < sig.min() and sig.max() < 1.0
    # median of sigmoid(N(m, s)) is sigmoid(m); the mean by numerical integration over the normal density
    assert sig.median().item() == pytest.approx(1 / (1 + math.exp(-1.0)), abs=3e-3)
    u = torch.linspace(-8, 8, 20001, dtype=torch.float64)
    density = torch.exp(-0.5 * u**2) / math.sqrt(2 * math.pi)
    expected = (torch.sigmoid(1.0 + 0.5 * u) * density).sum() * (u[1] - u[0])
    assert sig.mean().item() == pytest.approx(expected.item(), abs=2e-3)
    assert torch.logit(sig.double()).std().item() == pytest.approx(0.5, abs=5e-3)


def test_uniform_sigmas_and_shift_applied_after_sampling():
    gen = torch.Generator().manual_seed(0)
    sig = sample_sigmas(100_000, TrainerConfig(timestep_sampling="uniform"), gen)
    assert sig.mean().item() == pytest.approx(0.5, abs=5e-3)
    assert 0.0 <= sig.min() and sig.max() < 1.0
    plain = sample_sigmas(64, TrainerConfig(timestep_sampling="uniform"), torch.Generator().manual_seed(1))
    shifted = sample_sigmas(
        64, TrainerConfig(timestep_sampling="uniform", shift=3.0), torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(shifted, 3 * plain / (1 + 2 * plain))


def test_sampling_is_a_function_of_the_generator():
    cfg = TrainerConfig()
    a = sample_sigmas(16, cfg, torch.Generator().manual_seed(5))
    b = sample_sigmas(16, cfg, torch.Generator().manual_seed(5))
    c = sample_sigmas(16, cfg, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
