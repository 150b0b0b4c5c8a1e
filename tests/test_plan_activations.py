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


def test_a_dense_attention_mask_is_counted_per_token_pair_and_block():
    """HunyuanVideo 1.5's blocks save a bf16 [S, S] attention mask (``attention_mask_bytes``): quadratic in the
    sequence, which holds its glyph and image tokens too (``text_tokens``); one block's mask with checkpointing, every
    block's without; ``suggest`` rebuilds it from plan's JSON."""
    import dataclasses

    from latentmill.trainer.adapters import get_adapter

    from latentmill.plan import suggest

    hunyuan, i2v, wan = (get_adapter(f) for f in ("hunyuanvideo1.5", "hunyuanvideo1.5-i2v", "wan"))
    assert (hunyuan.attention_mask_bytes, i2v.attention_mask_bytes, wan.attention_mask_bytes) == (2, 2, 0)
    shapes = {"latents": (32, 31, 30, 53), "prompt_embeds": (1000, 3584), "prompt_embeds_2": (256, 1472)}
    assert (hunyuan.text_tokens(shapes), wan.text_tokens(shapes)) == (1000 + 256 + 1, 1000)
    assert i2v.text_tokens({**shapes, "image_embeds": (729, 1152)}) == 1000 + 256 + 729
    plain = ActivationShape((848, 480, 121), 49290, 1257, True, (0, 0), 2048, 8192, 54, 1)
    masked = dataclasses.replace(plain, mask_bytes=2)
    pairs = 50547 * 50547
    assert activation_bytes(masked, checkpointing=True) - activation_bytes(plain, checkpointing=True) == 2 * pairs
    assert activation_bytes(masked, checkpointing=False) - activation_bytes(plain, checkpointing=False) == 108 * pairs
    # a GPU that holds the activations without the mask but not with it: suggest sees the mask
    gpu = activation_bytes(plain, checkpointing=True) + pairs
    per_rank = dict.fromkeys(("static_bytes", "context_bytes", "comm_buffer_bytes", "optimizer_temp_bytes"), 0)
    for shape, fits in ((plain, True), (masked, False)):
        a = {"bucket": list(shape.bucket), "latent_tokens": shape.latent_tokens, "text_tokens": shape.text_tokens,
             "text_in_blocks": True, "float32_extra": [0, 0], "hidden": 2048, "ffn": 8192, "blocks": 54,
             "batch_size": 1, "side_streams": [], "mask_bytes": shape.mask_bytes, "cp_options": [1]}
        got = suggest({"activations": a, "per_rank": per_rank, "gpu_memory_bytes": gpu})
        assert (got["cp_size"] == 1) is fits


def _family_shape(family: str, folder: str, overrides: dict, bucket: list[int], text: int):
    """The point bench/actplan.py measures: ``folder``'s config with ``overrides``, a recipe whose largest bucket is
    ``bucket`` with ``text`` tokens."""
    from latentmill.activations import shipped_point

    return shipped_point(family, folder, overrides, bucket, text)


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
    config, shape = _family_shape(family, folder, depth, bucket, 512)
    assert (shape.blocks, list(shape.bucket)) == (2, bucket if bucket[2] > 1 else bucket[:2])
    assert shape.side_streams == (((26, 2048, 8192),) if family == "ltx2" else ())
    measured = measured_activation_bytes(family, config, bucket, 512, checkpointing=checkpointing)
    estimate = activation_bytes(shape, checkpointing=checkpointing)
    assert 1 * 2**30 < measured < 4 * 2**30
    assert abs(estimate / measured - 1) <= 0.15


HUNYUAN = ("hunyuanvideo1.5", "HunyuanVideo-1.5-480p_t2v")


@pytest.mark.slow
@pytest.mark.heavy  # real tensors on the CPU: about 15-40 s a point
@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("bucket", [[256, 256, 5], [512, 256, 9]], ids=["512-latent-tokens", "1536-latent-tokens"])
def test_hunyuan_video15_estimate_is_within_15_percent_of_memtracker_on_real_tensors(bucket, checkpointing):
    """HunyuanVideo 1.5's forward branches on its inputs' values, so it runs on real tensors on the CPU: its real width
    (2048, 16 heads) at 2 of its 54 blocks, 256 Qwen tokens, the 256 glyph tokens and 1 image token that its adapter
    declares in the blocks' sequence (``text_tokens``; they were uncounted) against MemTracker's peak."""
    config, shape = _family_shape(*HUNYUAN, {"num_layers": 2}, bucket, 256)
    latent = (bucket[2] - 1) // 4 + 1  # latent frames
    assert (shape.blocks, shape.latent_tokens, shape.text_tokens) == (2, latent * bucket[0] * bucket[1] // 256, 513)
    measured = measured_activation_bytes(HUNYUAN[0], config, bucket, 256, checkpointing=checkpointing, fake=False)
    estimate = activation_bytes(shape, checkpointing=checkpointing)
    assert 150 * 2**20 < measured < 1000 * 2**20
    assert abs(estimate / measured - 1) <= 0.15


@pytest.mark.slow
@pytest.mark.heavy  # real tensors on the CPU: 4 steps of 10-35 s
def test_hunyuan_video15_blocks_save_their_dense_attention_mask():
    """Each HunyuanVideo 1.5 block's attention builds a boolean [S, S] mask that SDPA saves as a bf16 one (2 bytes a
    token pair, ``attention_mask_bytes``): at 128 wide (1 head) and 2,561 tokens it is 43% of what a block saves.
    What one more block adds to the peak without checkpointing (4 blocks against 2) is within 15% of the estimate's;
    without the mask term the estimate was 51% under."""
    per_block = []
    for blocks in (2, 4):
        config, shape = _family_shape(*HUNYUAN, {"num_layers": blocks, "num_attention_heads": 1}, [512, 512, 5], 256)
        assert (shape.tokens, shape.mask_bytes) == (2 * 32 * 32 + 513, 2)
        measured = measured_activation_bytes(HUNYUAN[0], config, [512, 512, 5], 256, checkpointing=False, fake=False)
        per_block.append((measured, activation_bytes(shape, checkpointing=False)))
    (measured_2, estimate_2), (measured_4, estimate_4) = per_block
    assert abs((estimate_4 - estimate_2) / (measured_4 - measured_2) - 1) <= 0.15
    assert (estimate_4 - estimate_2) / 2 > 2 * 2561**2  # the mask is counted: more than the mask alone per block
