"""The flow-matching objective against its formulas and against Diffusers' scheduler."""

import math

import pytest
import torch
from latentmill.trainer.config import TrainerConfig
from latentmill.trainer.objective import (
    flow_matching_loss,
    interpolate,
    loss_weights,
    resolution_mu,
    sample_sigmas,
    shift_for,
    shift_sigmas,
    velocity_target,
)
from latentmill.trainer.train import lr_lambda


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


def test_mode_sampling_matches_sd3_formula_and_diffusers():
    from diffusers.training_utils import compute_density_for_timestep_sampling

    cfg = TrainerConfig(timestep_sampling="mode", mode_scale=1.29)
    sig = sample_sigmas(64, cfg, torch.Generator().manual_seed(2))
    u = torch.rand(64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(sig, 1 - u - 1.29 * (torch.cos(math.pi * u / 2) ** 2 - 1 + u))
    ref = compute_density_for_timestep_sampling(
        "mode", 64, mode_scale=1.29, generator=torch.Generator().manual_seed(2)
    )
    torch.testing.assert_close(sig, ref)
    flat = sample_sigmas(10_000, TrainerConfig(timestep_sampling="mode", mode_scale=0.0), torch.Generator())
    assert flat.mean().item() == pytest.approx(0.5, abs=0.02)  # mode_scale 0 is uniform (1 - u)


def test_resolution_shift_is_flux_calculate_shift():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for seq_len in (64, 256, 1024, 4096, 6000):
        assert resolution_mu(seq_len) == pytest.approx(calculate_shift(seq_len, 256, 4096, 0.5, 1.15))
    assert resolution_mu(256) == pytest.approx(0.5) and resolution_mu(4096) == pytest.approx(1.15)
    cfg = TrainerConfig(shift_mode="resolution")
    assert shift_for(cfg, 1024) == pytest.approx(math.exp(calculate_shift(1024)))
    assert shift_for(TrainerConfig(shift=3.0), 1024) == 3.0  # fixed mode ignores the size
    # the scheduler's dynamic shift (time_shift with mu) is the same map as shift_sigmas(exp(mu))
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    plain = torch.linspace(1.0, 1 / 1000, 50)
    mu = resolution_mu(1024)
    sched.set_timesteps(sigmas=plain.numpy(), mu=mu)
    torch.testing.assert_close(sched.sigmas[:-1], shift_sigmas(plain, math.exp(mu)))


def test_sampled_sigmas_use_the_given_shift():
    cfg = TrainerConfig(timestep_sampling="uniform", shift_mode="resolution")
    plain = sample_sigmas(32, TrainerConfig(timestep_sampling="uniform"), torch.Generator().manual_seed(4))
    shifted = sample_sigmas(32, cfg, torch.Generator().manual_seed(4), shift=shift_for(cfg, 4096))
    torch.testing.assert_close(shifted, shift_sigmas(plain, math.exp(1.15)))


@pytest.mark.parametrize("scheme", ["none", "sigma_sqrt", "cosmap"])
def test_loss_weights_match_diffusers_sd3(scheme):
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    sigmas = torch.tensor([0.05, 0.3, 0.5, 0.9])
    torch.testing.assert_close(loss_weights(sigmas, scheme), compute_loss_weighting_for_sd3(scheme, sigmas))
    formula = {
        "none": torch.ones(4),
        "sigma_sqrt": 1 / sigmas**2,
        "cosmap": 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2)),
    }[scheme]
    torch.testing.assert_close(loss_weights(sigmas, scheme), formula)


def test_weighted_loss_is_the_diffusers_training_loss():
    pred, target = _data((4, 3, 2, 2))
    w = torch.tensor([1.0, 2.0, 0.5, 4.0])
    # diffusers' SD3/Flux scripts: mean over samples of mean over elements of w * err^2
    expected = torch.mean((w.view(-1, 1, 1, 1) * (pred - target) ** 2).reshape(4, -1), 1).mean()
    torch.testing.assert_close(flow_matching_loss(pred, target, w), expected)
    torch.testing.assert_close(
        flow_matching_loss(pred, target, torch.ones(4)), flow_matching_loss(pred, target)
    )


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedules_after_warmup(schedule):
    f = lr_lambda(warmup_steps=4, max_steps=14, schedule=schedule, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for step in range(4, 20):
        p = min(1.0, (step - 4) / 10)
        expected = {
            "constant": 1.0,
            "linear": 1 - 0.9 * p,
            "cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)),
        }[schedule]
        assert f(step) == pytest.approx(expected)
    assert lr_lambda(0, 10, "cosine")(0) == 1.0 and lr_lambda(0, 10, "cosine")(10) == pytest.approx(0.0)
