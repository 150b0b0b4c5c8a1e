"""A non-finite loss or gradient skips its step (issue 16, item 5): no NaN weight, no NaN checkpoint."""

import importlib

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer_helpers import (
    build_tiny_transformer,
    read_metrics,
    run_train,
    torch_threads,
    write_fake_cache,
)

loop = importlib.import_module("latentmill.trainer.train")  # the module (the package exports a function)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    pretrained = build_tiny_transformer(root / "pretrained")
    write_fake_cache(root / "cache", {(48, 64, 1): 4, (64, 32, 1): 4}, smooth=True)
    return str(pretrained), root / "cache"


def _poison(monkeypatch, bad_calls: set[int] | None):
    """Make the loss of the given calls (1-based; None: every call) NaN, so its gradients are NaN too."""
    real, calls = loop.flow_matching_loss, [0]

    def loss(*args, **kwargs):
        calls[0] += 1
        value = real(*args, **kwargs)
        return value * float("nan") if bad_calls is None or calls[0] in bad_calls else value

    monkeypatch.setattr(loop, "flow_matching_loss", loss)


def _weights_finite(checkpoint) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(checkpoint / "model.safetensors").values())


def test_a_nan_step_is_skipped_counted_and_training_goes_on(setup, tmp_path, monkeypatch):
    _poison(monkeypatch, {3})
    with torch_threads(1):
        summary = run_train(setup, tmp_path, max_steps=6, batch_size=2, save_every=3)
    records = read_metrics(tmp_path)
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert summary["steps"] == 6 and records[-1]["loss"] == summary["final_loss"] < records[0]["loss"]
    for step in ("step-000003", "step-000006"):  # the checkpoint right after the skipped step is finite too
        assert _weights_finite(tmp_path / "checkpoints" / step)


def test_too_many_nan_steps_in_a_row_stop_with_a_clear_error(setup, tmp_path, monkeypatch):
    _poison(monkeypatch, None)
    with torch_threads(1), pytest.raises(FloatingPointError, match=r"3 steps in a row had a non-finite loss or "
                                                                   r"gradient \(up to step 3, trainer.max_skipped_steps=2\)"):
        run_train(setup, tmp_path, max_steps=6, batch_size=2, save_every=1, max_skipped_steps=2)
    assert [r["skipped_steps"] for r in read_metrics(tmp_path)] == [1, 2]
    for checkpoint in (tmp_path / "checkpoints").glob("step-*"):  # what was saved holds the original weights
        assert _weights_finite(checkpoint)


def test_a_non_finite_weight_is_never_checkpointed(setup, tmp_path, monkeypatch):
    real_step = torch.optim.AdamW.step

    def corrupting_step(self, *args, **kwargs):  # an optimizer step that writes a NaN into a weight
        result = real_step(self, *args, **kwargs)
        self.param_groups[0]["params"][0].data.view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", corrupting_step)
    with torch_threads(1), pytest.raises(FloatingPointError, match="step 2: a trainable weight is not finite; "
                                                                   "no checkpoint is written"):
        run_train(setup, tmp_path, max_steps=4, batch_size=2, save_every=2)
    assert not list((tmp_path / "checkpoints").glob("step-*"))
