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


def test_a_side_stream_is_counted_at_its_own_widths():
    """LTX-2's audio tokens run through every block beside the video's: counted as the latents are, at the audio
    widths (``ModelAdapter.side_streams``), and split by cp as the video's."""
    import dataclasses

    from latentmill.trainer.adapters import get_adapter

    video = ActivationShape((768, 512, 121), 24576, 1024, False, (0, 64), 4096, 16384, 48, 1)
    audio = (126, 2048, 8192)
    both = dataclasses.replace(video, side_streams=(audio,))
    for checkpointing in (True, False):
        alone = dataclasses.replace(video, latent_tokens=audio[0], hidden=audio[1], ffn=audio[2])
        assert _tokens_part(both, checkpointing=checkpointing) == (
            _tokens_part(video, checkpointing=checkpointing) + _tokens_part(alone, checkpointing=checkpointing))
        assert 2 * _tokens_part(both, checkpointing=checkpointing, cp=2) == _tokens_part(both, checkpointing=checkpointing)
    # the adapter declares it from the transformer's config and the sample's audio latents [C_a, frames, mel bins]
    ltx2 = get_adapter("ltx2")
    config = {"audio_num_attention_heads": 32, "audio_attention_head_dim": 64}
    assert ltx2.side_streams(config, {"audio_latents": (8, 126, 16)}) == [audio]
    assert get_adapter("wan").side_streams({}, {}) == []


# Z-Image without its refiners (which see only the image or the caption tokens) and LTX-2 at reduced depth, at their
# real widths (the shipped configs): 1024² (4,608 tokens with 512 of text) and 1024 x 768 x 25 frames (3,072 video
# tokens and 26 audio tokens)
MEASURED = [("z-image", "Z-Image-Turbo", {"n_layers": 2, "n_refiner_layers": 0}, [1024, 1024, 1]),
            ("ltx2", "LTX-2", {"num_layers": 2}, [1024, 768, 25])]


@pytest.mark.slow
@pytest.mark.heavy  # the families after FLUX.1 and Wan (which set the constants): 4 tracked steps of about 5 s
@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize(("family", "folder", "depth", "bucket"), MEASURED, ids=[m[0] for m in MEASURED])
def test_zimage_and_ltx2_estimates_are_within_15_percent_of_memtracker(family, folder, depth, bucket, checkpointing):
    """What each family declares (Z-Image's SwiGLU width and float32 norms and RoPE, LTX-2's float32 RoPE and audio
    stream) brings the formula within 15% of torch's MemTracker on the real class under FakeTensorMode."""
    import torch
    from latentmill.trainer.adapters import get_adapter

    from latentmill.activations import activation_shape
    from latentmill.plan import shipped_models_dir
    from latentmill.recipe import load_recipe

    adapter = get_adapter(family)
    cls = adapter.diffusers_class(adapter.transformer_class)
    config = {**cls.load_config(str(shipped_models_dir() / folder), subfolder="transformer"), **depth}
    with torch.device("meta"):
        blocks = len(adapter.blocks(cls.from_config(config)))
    frames = [f"bucket.max_frames={bucket[2]}", f"bucket.frame_counts=[{bucket[2]}]"] if bucket[2] > 1 else []
    recipe = load_recipe("demo", [f"bucket.resolution={round((bucket[0] * bucket[1]) ** 0.5)}",
                                  f"bucket.aspect_ratios=[{bucket[0] / bucket[1]}]", "cache.max_sequence_length=512",
                                  "trainer.batch_size=1", *frames])
    shape = activation_shape(adapter, family, shipped_models_dir() / folder, config, recipe, blocks)
    assert (blocks, list(shape.bucket)) == (2, bucket if bucket[2] > 1 else bucket[:2])
    assert shape.side_streams == (((26, 2048, 8192),) if family == "ltx2" else ())
    measured = measured_activation_bytes(family, config, bucket, 512, checkpointing=checkpointing)
    estimate = activation_bytes(shape, checkpointing=checkpointing)
    assert 1 * 2**30 < measured < 4 * 2**30
    assert abs(estimate / measured - 1) <= 0.15
