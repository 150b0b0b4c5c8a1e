"""The activation term of ``latentmill plan``: how it scales, and its check against torch's memory tracker."""

from __future__ import annotations

import pytest

from latentmill.activations import FIXED_BYTES, ActivationShape, activation_bytes, measured_activation_bytes
from latentmill.cli import main

FLUX_BLOCKS = ActivationShape((1024, 1024), 4096, 512, True, (0, 0), 3072, 12288, 57, 1)


def _tokens_part(shape: ActivationShape, **kwargs) -> int:
    return activation_bytes(shape, **kwargs) - FIXED_BYTES


@pytest.mark.parametrize("checkpointing", [True, False])
def test_activations_scale_linearly_in_tokens_and_batch_and_halve_at_cp_2(checkpointing):
    import dataclasses

    one = _tokens_part(FLUX_BLOCKS, checkpointing=checkpointing)
    double_tokens = dataclasses.replace(FLUX_BLOCKS, latent_tokens=2 * 4096, text_tokens=2 * 512)
    assert _tokens_part(double_tokens, checkpointing=checkpointing) == 2 * one
    assert _tokens_part(dataclasses.replace(FLUX_BLOCKS, batch=3), checkpointing=checkpointing) == 3 * one
    assert 2 * _tokens_part(FLUX_BLOCKS, checkpointing=checkpointing, cp=2) == one
    # cross-attention families: the text tokens do not join the sequence
    cross = dataclasses.replace(FLUX_BLOCKS, text_in_blocks=False)
    assert _tokens_part(cross, checkpointing=checkpointing) * 4608 == one * 4096


def test_checkpointing_keeps_block_inputs_and_one_blocks_saved_tensors():
    on, off = (_tokens_part(FLUX_BLOCKS, checkpointing=c) for c in (True, False))
    # FLUX.1-dev at 1024², batch 1: 57 block inputs of 4,608 x 3072 in bf16 are 1.50 GiB
    assert on > 57 * 4608 * 3072 * 2
    assert 2.3 * 2**30 < on + FIXED_BYTES < 2.6 * 2**30  # MemTracker measured 2.44 GiB at the full depth
    assert off > 15 * on


def test_suggest_without_gpu_memory_is_one_line(capsys):
    assert main(["plan", "configs/flux-dev-full.yaml", "--suggest"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu-memory" in err and err.startswith("latentmill: error:")


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_estimate_is_within_15_percent_of_memtracker(checkpointing):
    """FLUX.1-dev's real widths (3072 hidden, 24 heads) at 1 double + 2 single blocks, 512² (1,024 latent + 512
    text tokens): the formula against torch's MemTracker on the real class under FakeTensorMode."""
    from diffusers import FluxTransformer2DModel

    from latentmill.plan import shipped_models_dir

    config = dict(FluxTransformer2DModel.load_config(str(shipped_models_dir() / "FLUX.1-dev"), subfolder="transformer"))
    config.update(num_layers=1, num_single_layers=2)
    measured = measured_activation_bytes("flux", config, [512, 512, 1], 512, checkpointing=checkpointing)
    shape = ActivationShape((512, 512), 1024, 512, True, (0, 0), 3072, 12288, 3, 1)
    estimate = activation_bytes(shape, checkpointing=checkpointing)
    assert 300 * 2**20 < measured < 1000 * 2**20
    assert abs(estimate / measured - 1) <= 0.15
