"""Training options in the loop: gradient accumulation, activation checkpointing, compile, objective options,
cache inputs (posterior sampling, caption dropout) under an exact resume, and observability."""

import pytest
import torch
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import (
    build_tiny_transformer,
    read_metrics,
    run_train,
    torch_threads,
    write_fake_cache,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(pretrained, cache): 8 samples in two buckets, with posterior std, trimmed text."""
    root = tmp_path_factory.mktemp("options")
    pretrained = build_tiny_transformer(root / "pretrained")
    cache = root / "cache"
    write_fake_cache(
        cache, {(48, 64, 1): 4, (64, 32, 1): 4}, smooth=True, latents="distribution", trimmed=True
    )
    return str(pretrained), cache


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _run(setup, train_dir, **overrides):
    return run_train(setup, train_dir, **{"max_steps": 6, "batch_size": 2, **overrides})


ALL_OPTIONS = dict(
    grad_accum_steps=2,
    caption_dropout=0.3,
    timestep_sampling="mode",
    shift_mode="resolution",
    loss_weighting="cosmap",
    lr_schedule="cosine",
    warmup_steps=2,
    min_lr_ratio=0.1,
)


def test_every_option_on_and_resume_is_still_bitwise(setup, tmp_path):
    kw = dict(max_steps=7, keep_latest_k=0, **ALL_OPTIONS)
    _run(setup, tmp_path / "a", save_every=3, **kw)
    full_run = read_metrics(tmp_path / "a")
    assert [r["step"] for r in full_run] == list(range(1, 8))
    _run(setup, tmp_path / "b", save_every=3, **{**kw, "max_steps": 3})
    _run(setup, tmp_path / "b", save_every=3, resume="latest", **kw)
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == [r["loss"] for r in full_run]
    # lr: warmup 2 steps, then cosine from 1 to 0.1 over the remaining 5
    import math

    expected = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * k / 5)) for k in range(5)]
    assert [r["lr"] for r in full_run] == pytest.approx([3e-3 * m for m in expected])


def test_gradient_accumulation_consumes_accum_batches_per_step(setup, tmp_path):
    from safetensors.torch import load_file  # noqa: F401

    summary = _run(setup, tmp_path, max_steps=3, grad_accum_steps=2, save_every=3)
    assert summary["steps"] == 3 and len(read_metrics(tmp_path)) == 3
    import json

    (_, ckpt), = list_checkpoints(tmp_path / "checkpoints")  # fmt: skip
    loader = json.loads((ckpt / "trainer_state.json").read_text())["loader"]
    # 8 samples in batches of 2: 4 batches per epoch; 3 steps x 2 micro-batches = 6 batches
    assert (loader["epoch"], loader["batch_index"]) == (1, 2)


def test_gradient_accumulation_averages_micro_batch_gradients(setup, tmp_path, monkeypatch):
    """One step of accum 2 x batch 2 has the mean gradient of two plain steps on the same micro-batches.

    With a vanishing learning rate the weights do not move, and each sample's noise is keyed by its place in
    the epoch either way, so the two plain steps see exactly the accumulated inputs.
    """
    seen = []
    real_step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):  # the gradients the optimizer steps on
        seen.append([p.grad.clone() for group in self.param_groups for p in group["params"] if p.grad is not None])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    _run(setup, tmp_path / "accum", max_steps=1, grad_accum_steps=2, learning_rate=1e-30, grad_clip=0.0)
    (accumulated,) = seen
    _run(setup, tmp_path / "plain", max_steps=2, grad_accum_steps=1, learning_rate=1e-30, grad_clip=0.0)
    first, second = seen[1:]
    for a, g1, g2 in zip(accumulated, first, second):
        torch.testing.assert_close(a, (g1 + g2) / 2, rtol=1e-4, atol=1e-7)
    plain = read_metrics(tmp_path / "plain")
    assert read_metrics(tmp_path / "accum")[0]["loss"] == pytest.approx(
        (plain[0]["loss"] + plain[1]["loss"]) / 2
    )


def test_activation_checkpointing_gives_the_same_losses(setup, tmp_path, monkeypatch):
    import latentmill.trainer.parallel as parallel_mod

    calls = []
    real = parallel_mod.apply_activation_checkpointing
    monkeypatch.setattr(parallel_mod, "apply_activation_checkpointing", lambda m: (calls.append(m), real(m)))
    _run(setup, tmp_path / "plain", max_steps=4)
    _run(setup, tmp_path / "ac", max_steps=4, activation_checkpointing=True)
    assert len(calls) == 1 and calls[0].gradient_checkpointing
    plain, ac = ([r["loss"] for r in read_metrics(tmp_path / d)] for d in ("plain", "ac"))
    assert ac == pytest.approx(plain, rel=1e-5, abs=1e-6)


def test_compile_flag_compiles_each_block(setup, tmp_path, monkeypatch):
    import latentmill.trainer.parallel as parallel_mod

    compiled = []
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__)
    )
    _run(setup, tmp_path, max_steps=1, compile=True)
    assert compiled == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert parallel_mod.apply_compile is not None


def test_metrics_and_tensorboard(setup, tmp_path):
    pytest.importorskip("tensorboard")
    summary = _run(setup, tmp_path, max_steps=3)
    for record in read_metrics(tmp_path):
        assert record["peak_mem_mb"] > 50 and 0 <= record["data_wait_fraction"] < 1
    assert summary["peak_mem_mb"] > 50
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/peak_mem_mb", "train/data_wait_fraction"} <= set(
        events.Tags()["scalars"]
    )
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx([r["loss"] for r in read_metrics(tmp_path)])


def test_without_tensorboard_training_goes_on(setup, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    _run(setup, tmp_path, max_steps=1)
    assert not (tmp_path / "tb").exists() and len(read_metrics(tmp_path)) == 1
