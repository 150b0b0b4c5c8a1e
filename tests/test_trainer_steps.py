"""The trainer's parts on their own (``latentmill.trainer.train._Run``): draws, one micro-batch, one step,
and the per-step reduction, without the loop around them."""

from __future__ import annotations

import math

import pytest
import torch
from latentmill.trainer.config import ParallelConfig, TrainerConfig
from latentmill.trainer.objective import flow_matching_loss, interpolate, velocity_target
from latentmill.trainer.parallel import DistContext
from latentmill.trainer.train import _reduce_step_stats, _Run, draw_micro_batch

from tests.trainer_helpers import build_tiny_transformer, torch_threads, write_fake_cache


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    build_tiny_transformer(root / "pretrained")
    write_fake_cache(root / "cache", {(64, 48, 1): 8}, latents="distribution")
    cfg = TrainerConfig(max_steps=3, batch_size=4, learning_rate=1e-3, save_every=0, export=False,
                        grad_accum_steps=2)
    with torch_threads(1):
        yield _Run(cfg, DistContext(), ParallelConfig(), root / "cache", str(root / "pretrained"), root / "train",
                   0, None, {})


def _draw(run, shape: torch.Size, **kw):
    """The draws of a micro-batch of ``shape`` in ``run`` (its config, seed and device)."""
    return draw_micro_batch(run.cfg, run.seed, shape, device=run.device, **kw)


def test_draws_are_keyed_by_epoch_and_ordinal_not_by_how_the_batch_is_cut(run):
    shape = torch.Size([4, 16, 6, 8])
    expert = run.parts[0].expert
    audio = torch.Size([4, 2, 5, 3])  # a noised stream beside the latents (LTX-2's audio): drawn per sample too
    eps4, sig4, noise4, _, (audio4,) = _draw(run, shape, epoch=1, ordinals=[4, 5, 6, 7], posterior=True, shift=1.0,
                                             expert=expert, extra_shapes=[audio])
    # the same samples in halves or one by one, in another order (other ranks or micro-batches): the same draws
    for cut in ([[6, 7], [4, 5]], [[7], [5], [6], [4]]):
        parts = {o[0]: _draw(run, torch.Size([len(o), *shape[1:]]), epoch=1, ordinals=o, posterior=True, shift=1.0,
                             expert=expert, extra_shapes=[torch.Size([len(o), *audio[1:]])]) for o in cut}
        parts = [parts[first] for first in sorted(parts)]
        assert torch.equal(eps4, torch.cat([h[0] for h in parts]))
        assert torch.equal(sig4, torch.cat([h[1] for h in parts]))
        assert torch.equal(noise4, torch.cat([h[2] for h in parts]))
        assert torch.equal(audio4, torch.cat([h[4][0] for h in parts])) and audio4.shape == audio
    assert sig4.shape == (4,) and bool(((sig4 > 0) & (sig4 < 1)).all())
    assert len(set(sig4.tolist())) == 4  # every sample its own draw
    # another epoch, other ordinals: other draws
    other = _draw(run, shape, epoch=2, ordinals=[4, 5, 6, 7], posterior=True, shift=1.0, expert=expert)
    assert not torch.equal(other[2], noise4)
    assert not torch.equal(_draw(run, shape, epoch=1, ordinals=[0, 1, 2, 3], posterior=True, shift=1.0,
                                 expert=expert)[2], noise4)
    assert _draw(run, shape, epoch=1, ordinals=[0, 1, 2, 3], posterior=False, shift=1.0, expert=expert)[0] is None


def test_forward_backward_is_the_flow_matching_loss_of_its_draws(run):
    batch = next(iter(run.loader))
    run.parts[0].optimizer.zero_grad(set_to_none=True)
    loss = run.forward_backward(batch, run.parts[0], last_micro=True, micro_batches=run.cfg.grad_accum_steps)
    latents = batch["latents"]
    eps, sigmas, noise, _, _ = _draw(run, latents.shape, epoch=batch["epoch"], ordinals=batch["ordinals"],
                                     posterior=True, shift=1.0, expert=run.parts[0].expert)  # by hand
    x0 = latents + batch["latents_std"] * eps
    with torch.no_grad():
        pred = run.adapter.forward(run.parts[0].model, interpolate(x0, noise, sigmas), sigmas, batch, run.cfg)
    expected = flow_matching_loss(pred, velocity_target(x0, noise), None)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    grads = [p.grad for p in run.parts[0].trainable]
    assert all(g is not None for g in grads) and all(bool(torch.isfinite(g).all()) for g in grads)


def test_train_step_consumes_accum_batches_and_reports_the_read_values(run):
    batches = iter(run.loader)
    position = run.loader.epoch * len(run.loader) + run.loader.batch_index
    before = [p.detach().clone() for p in run.parts[0].trainable]
    step_before = run.step
    record = run.train_step(batches)
    assert record["step"] == run.step == step_before + 1
    assert record["skipped"] is False and math.isfinite(record["loss"]) and record["grad_norm"] > 0
    assert record["samples_per_s"] > 0 and record["loss"] == run.last_loss
    assert any(not torch.equal(a, p) for a, p in zip(before, run.parts[0].trainable))  # the weights moved
    # two micro-batches (grad_accum_steps 2) of the 2-batch epoch
    assert run.loader.epoch * len(run.loader) + run.loader.batch_index == position + 2


def test_reduce_step_stats_without_a_process_group():
    g = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    loss, samples, nonfinite, norm, _ = _reduce_step_stats(DistContext(), torch.tensor(1.5), 6, g, grad_replicas=1)
    assert (loss, samples, nonfinite, norm) == (1.5, 6, False, 5.0)  # the norm clip_grad_norm_ computes
    assert float(torch.nn.utils.get_total_norm(g)) == norm
    loss, _, nonfinite, norm, _ = _reduce_step_stats(DistContext(), torch.tensor(float("nan")), 6, g, grad_replicas=1)
    assert math.isnan(loss) and nonfinite and norm == 5.0
    _, _, nonfinite, norm, _ = _reduce_step_stats(DistContext(), torch.tensor(1.0), 6,
                                                  [torch.tensor([float("inf")])], grad_replicas=1)
    assert not nonfinite and not math.isfinite(norm)  # the caller skips on either
