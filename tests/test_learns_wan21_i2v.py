"""Wan 2.1 I2V learns a fine detail from its caption, given the same first frame, through the whole path (prep,
cache with the first frame's conditioning, train, export, generate): every clip opens on a plain light frame,
then a small dark mark appears in one of four corners, captioned so. At shift 1.0 and at the family's own (3.0,
the sampler's flow_shift), the exported WanImageToVideoPipeline, given that plain frame and each caption, generates
clips whose later latent frame is nearer its own caption's cached one than half any other corner's.

The mark is 16 x 16 px of a 32 x 32 clip: 2 x 2 of the 4 x 4 latent pixels the Wan VAE (8x) makes per frame.
"""

from __future__ import annotations

import pytest

from tests.learning import (
    CORNERS,
    appearing_marks,
    assert_generates_own_detail,
    assert_loss_fell,
    cached_latents,
    losses,
    run,
    video_overrides,
)

# 20 s each on 2 idle cores, 2 minutes on 2 busy ones; heavy: make test's learning tests are FLUX.1's and Wan
# 2.1's (test_learns.py)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]
SIZE = 32  # the mark (16 px): 2 x 2 of the 4 x 4 latent pixels the Wan VAE (8x) makes per frame


# make test runs the family's own shift, make test-all shift 1.0 too
@pytest.mark.parametrize(("shift", "steps"), [pytest.param(1.0, 1000, marks=pytest.mark.heavy), (3.0, 1000)])
def test_i2v_generates_the_detail_its_caption_names(tiny_wan_i2v, tmp_path, shift, steps):
    clips = tmp_path / "clips"
    appearing_marks(clips, SIZE)
    out = tmp_path / "run"
    run("demo-wan2.1-i2v.yaml", out, tiny_wan_i2v, clips, *video_overrides(SIZE, 5, steps),
        "bucket.scene_split=false",  # the mark's appearance is not a cut
        f"trainer.shift={shift}")
    # measured, first 60 steps -> last 60: shift 1.0 1.10 -> 0.037, shift 3.0 0.91 -> 0.021
    assert_loss_fell(losses(out / "train"), 60, 0.25)

    reference = cached_latents(out / "prep" / "cache")
    assert sorted(reference) == sorted(f"a dark mark appears in the {c} corner" for c in CORNERS)
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, WanImageToVideoPipeline)
    # measured (own / nearest other corner, the mean of 4 same-noise clips): shift 1.0 0.29-0.36, shift 3.0 0.20-0.27
    assert_generates_own_detail(pipe, reference, SIZE)
