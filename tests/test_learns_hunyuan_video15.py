"""HunyuanVideo 1.5 learns a fine detail it is shown, through the whole path (prep, cache, train, export,
generate): where a small dark mark sits in a still clip (one of four corners, captioned so), at shift 1.0 and at
the family's own shift (5.0, the 480p scheduler's). The exported HunyuanVideo15Pipeline then generates from each
caption a latent nearer its own caption's cached latents than any other corner's.

The mark is 16 x 16 px of a 64 x 64 clip: one latent pixel of the 4 x 4 the VAE (16x) makes per frame.
"""

from __future__ import annotations

import pytest
import torch

from tests.learning import (
    CORNERS,
    assert_loss_fell,
    assert_nearest_own,
    cached_latents,
    losses,
    marked_caption,
    marked_clips,
    run,
    video_overrides,
)

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # 9-13 minutes each on 2 busy cores (make test-all)


@pytest.mark.parametrize(("shift", "steps"), [(1.0, 1000), (5.0, 600)])
def test_hunyuan_video15_generates_the_detail_it_was_shown(tiny_hunyuan_video15, tmp_path, shift, steps):
    clips = tmp_path / "clips"
    marked_clips(clips)
    out = tmp_path / "run"
    run("demo-hunyuanvideo1.5.yaml", out, tiny_hunyuan_video15, clips, *video_overrides(64, 5, steps),
        f"trainer.shift={shift}")
    # measured, first 60 steps -> last 60: shift 1.0 0.75 -> 0.042, shift 5.0 0.49 -> 0.034
    assert_loss_fell(losses(out / "train"), 60, 0.2)

    reference = cached_latents(out / "prep" / "cache")
    assert sorted(reference) == sorted(marked_caption(c) for c in CORNERS)
    from diffusers import ClassifierFreeGuidance, DiffusionPipeline, HunyuanVideo15Pipeline

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, HunyuanVideo15Pipeline)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=1.0)  # no empty prompt was trained: no guidance
    prompts = list(reference)
    latents = pipe(prompts, height=64, width=64, num_frames=5, num_inference_steps=8, output_type="latent",
                   generator=torch.Generator().manual_seed(0)).frames
    generated = dict(zip(prompts, latents))
    assert next(iter(generated.values())).shape == next(iter(reference.values())).shape == (16, 2, 4, 4)
    # measured (8 sampling steps at the scheduler's shift 5.0): own / nearest other 0.02-0.04 at shift 1.0,
    # 0.11-0.12 at shift 5.0
    assert_nearest_own(generated, reference, margin=0.5)
