"""``examples/jax_flow_matching.py``: a Flax/Optax DiT trained on a latentmill snapshot on the CPU.

One run of the example's command-line path (a few dozen jitted steps on a one-bucket snapshot): its loss
falls, it writes its summary and samples, and its compiled sampler (the whole Euler loop in one
``fori_loop``, ``vmap`` over samples) gives the latents' shape and is a pure function of its key."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_jax_loader import make_snapshot

# two XLA compilations (train step, sampler): ~10-20 s on 2 CPU cores; heavy: make test covers the JAX loader in
# test_jax_loader.py
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "jax_flow_matching.py"
STEPS = 40


def _load_example():
    spec = importlib.util.spec_from_file_location("jax_flow_matching", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load_example()


@pytest.fixture(scope="module")
def ran(example, tmp_path_factory):
    """The example's ``run`` on an output_dir whose latest snapshot holds one bucket (16 samples 32x32)."""
    root = tmp_path_factory.mktemp("jax")
    make_snapshot(root / "output", {(32, 32, 1): 16}, smooth=True)
    args = example.parse_args([str(root / "output"), "--steps", str(STEPS), "--batch", "4", "--width", "32",
                               "--depth", "1", "--lr", "3e-3", "--sample-steps", "4", "--samples", "3",
                               "--repeat", "2", "--out", str(root / "run")])
    return example.run(args), root / "run"


def test_loss_falls(ran):
    result, _ = ran
    losses = result.summary["losses"]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert 1.5 < first < 2.5  # a zero prediction at the start: E[(noise - x0)^2] = 2 for unit latents
    assert last < 0.8 * first, (first, last)
    assert result.summary["train_step"]["repeats"] == STEPS - 1  # warm-up (compile) excluded from the median


def test_writes_summary_and_samples(ran):
    result, out = ran
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loss_last"] == pytest.approx(result.summary["loss_last"])
    assert summary["sampler"]["sample_shape"] == [3, 16, 4, 4]  # 3 samples of latents [16, 32/8, 32/8]
    assert summary["sampler"]["repeats"] == 2 and summary["sampler"]["median_s"] > 0
    samples = np.load(out / "samples.npy")
    assert samples.shape == (3, 16, 4, 4) and np.isfinite(samples).all()
    # 16 samples, batch 4 (drop_last): 4 batches an epoch; after 40 steps, 10 whole epochs read: a batch's
    # position carries the state after it, so the next is epoch 10's first (LatentLoader's state)
    assert (result.summary["loader_state"]["epoch"], result.summary["loader_state"]["batch_index"]) == (10, 0)


def test_sampler_is_deterministic_under_a_fixed_key(example, ran):
    result, _ = ran
    inputs = example.model_inputs(result.result.first_batch)
    text, pooled = inputs["prompt_embeds"][:3], inputs["pooled_prompt_embeds"][:3]

    def draw(seed):
        return np.asarray(result.sampler(result.result.params, example.sample_keys(seed, 3), text, pooled,
                                         (16, 4, 4)))

    a, b, c = draw(0), draw(0), draw(1)
    assert a.shape == (3, 16, 4, 4)
    assert np.array_equal(a, b)
    assert np.abs(a - c).max() > 0.1
    assert np.array_equal(a, result.samples)  # the run's first sampler call used seed 0 too
    assert np.abs(a[0] - a[1]).max() > 0.1  # each sample its own key (vmap over keys)
