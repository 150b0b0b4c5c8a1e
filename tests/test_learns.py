"""The system learns what it is shown, through the whole path: prep, cache, train, export, generate.

Four solid colours, each captioned "a <colour> square", go through the real recipe and CLI (`latentmill run`
on the demo recipe, the tiny models of data/tiny-flux.yaml). The exported pipeline, loaded with
``DiffusionPipeline.from_pretrained``, then generates with ``output_type="latent"``: for each prompt the latent
must lie nearest to the cached training latents of its own caption, clearly nearer than to any other colour's.
A model too narrow to fit the data (the tiny Flux had width 32 < its 64 input channels), or latents normalised so
that the captions are indistinguishable (the tiny Wan had Wan2.1's statistics), fail.

Wan 2.1 (data/tiny-wan.yaml) and FLUX.2 (data/tiny-flux2-klein.yaml, data/tiny-flux2.yaml) learn a finer thing
than colour: where a small dark mark sits (one of four corners, captioned so), at shift 1.0 and at the family's
own shift. The shared pieces of every learning test are in tests/learning.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.learning import (
    CORNERS,
    SHADES,
    assert_loss_fell,
    assert_nearest_own,
    cached_latents,
    losses,
    marked_caption,
    marked_clips,
    marked_images,
    run,
    video_overrides,
)

pytestmark = pytest.mark.slow

COLORS = {"red": (220, 40, 40), "green": (40, 180, 70), "blue": (40, 80, 220), "yellow": (235, 210, 40)}


def test_flux_generates_the_colour_it_was_shown(tiny_flux, tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for colour, rgb in COLORS.items():
        for i, shade in enumerate(SHADES):
            Image.new("RGB", (64, 64), tuple(c + shade for c in rgb)).save(images / f"{colour}_{i}.png")
            (images / f"{colour}_{i}.txt").write_text(f"a {colour} square")
    out = tmp_path / "run"
    run("demo.yaml", out, tiny_flux, images, "bucket.resolution=64", "bucket.aspect_ratios=[1.0]",
        "trainer.max_steps=400", "trainer.learning_rate=2.0e-3")
    # measured: 0.59 over the first 40 steps, 0.027 over the last 40 (at width 32: a plateau at 0.55)
    assert_loss_fell(losses(out / "train"), 40, 0.1)

    reference = cached_latents(out / "prep" / "cache")
    assert sorted(reference) == sorted(f"a {c} square" for c in COLORS)
    from diffusers import DiffusionPipeline, FluxPipeline
    from latentmill.trainer.flux import unpack_latents

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, FluxPipeline)
    prompts = list(reference)
    packed = pipe(prompts, height=64, width=64, num_inference_steps=8, output_type="latent",
                  max_sequence_length=32, generator=torch.Generator().manual_seed(0)).images
    generated = dict(zip(prompts, unpack_latents(packed, 8, 8)))
    assert next(iter(generated.values())).shape == next(iter(reference.values())).shape == (16, 8, 8)
    # measured: own 0.006-0.013, nearest other 0.016-0.025 (ratios 0.36-0.59)
    assert_nearest_own(generated, reference, margin=0.8)


# make test runs Wan 2.1's own shift (3.0, the tiny sampler's flow_shift, the recipe's trainer.shift); make
# test-all shift 1.0 too, with the 1000 steps of the other Wan tests at shift 1.0 (its high-noise steps, where the
# sampler decides what the clip shows, are rarer)
@pytest.mark.parametrize(("shift", "steps"), [pytest.param(1.0, 1000, marks=pytest.mark.heavy), (3.0, 600)])
def test_wan_generates_the_detail_it_was_shown(tiny_wan, tmp_path, shift, steps):
    clips = tmp_path / "clips"
    marked_clips(clips, size=32)  # the mark: 2 x 2 of the 4 x 4 latent pixels the Wan VAE (8x) makes per frame
    out = tmp_path / "run"
    run("demo-video.yaml", out, tiny_wan, clips, *video_overrides(32, 5, steps), f"trainer.shift={shift}")
    # measured, first 60 steps -> last 60: shift 1.0 1.31 -> 0.069, shift 3.0 1.41 -> 0.044
    assert_loss_fell(losses(out / "train"), 60, 0.25)

    reference = cached_latents(out / "prep" / "cache")
    assert sorted(reference) == sorted(marked_caption(c) for c in CORNERS)
    from diffusers import DiffusionPipeline, WanPipeline

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, WanPipeline)
    prompts = list(reference)
    # guidance_scale 1: no classifier-free guidance (the empty prompt was never trained on here). The mean of 4
    # noise draws, the same ones for every caption: one draw is one sample of the model's clips, and at shift 1.0
    # the first draw of seed 0 put the bottom-left caption between the corners (0.60; the other draws 0.05-0.09)
    latents = torch.stack([pipe(prompts, height=32, width=32, num_frames=5, num_inference_steps=8, guidance_scale=1.0,
                                output_type="latent", max_sequence_length=32,
                                generator=[torch.Generator().manual_seed(seed) for _ in prompts]).frames
                           for seed in range(4)]).mean(0)
    generated = dict(zip(prompts, latents))
    assert next(iter(generated.values())).shape == next(iter(reference.values())).shape == (16, 2, 4, 4)
    # measured (8 sampling steps at the sampler's flow_shift 3.0; own / nearest other corner): shift 1.0 0.021-0.027
    # (ratios 0.12-0.17), shift 3.0 0.011-0.016 (ratios 0.08-0.10)
    assert_nearest_own(generated, reference, margin=0.5)


SHIFTS = {"shift-1": ["trainer.shift_mode=fixed", "trainer.shift=1.0"], "flux2-empirical-mu": ["trainer.shift_mode=resolution"]}


@pytest.mark.parametrize(("variant", "shift"), [
    # make test runs klein at FLUX.2's own shift; make test-all also shift 1.0 and the same for FLUX.2 [dev]
    # (guidance embedding, Mistral text side)
    pytest.param("klein", "shift-1", marks=pytest.mark.heavy),
    pytest.param("klein", "flux2-empirical-mu", marks=pytest.mark.heavy),  # make test learns FLUX.1 and Wan 2.1
    pytest.param("dev", "shift-1", marks=pytest.mark.heavy),
    pytest.param("dev", "flux2-empirical-mu", marks=pytest.mark.heavy)])
def test_flux2_generates_the_detail_it_was_shown(request, variant, shift, tmp_path):
    pretrained = request.getfixturevalue(f"tiny_flux2_{variant}")
    recipe = "demo-flux2-klein.yaml" if variant == "klein" else "demo-flux2.yaml"
    seq = 32 if variant == "klein" else 64
    images = tmp_path / "images"
    marked_images(images)  # the mark (16 px of 64): 1/16 of the picture, one FLUX.2 latent token
    out = tmp_path / "run"
    run(recipe, out, pretrained, images, "bucket.resolution=64", "bucket.aspect_ratios=[1.0]", "trainer.max_steps=400",
        "trainer.learning_rate=2.0e-3", *SHIFTS[shift])
    # measured, first 40 steps -> last 40: klein shift 1.0 0.69 -> 0.054, FLUX.2's shift 0.60 -> 0.021; dev 0.66 ->
    # 0.061 and 0.57 -> 0.024
    assert_loss_fell(losses(out / "train"), 40, 0.15)

    reference = cached_latents(out / "prep" / "cache")
    assert sorted(reference) == sorted(marked_caption(c) for c in CORNERS)
    from diffusers import DiffusionPipeline
    from latentmill.stages.family_flux2 import patchify

    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert type(pipe).__name__ == ("Flux2KleinPipeline" if variant == "klein" else "Flux2Pipeline")
    prompts = list(reference)
    # klein: guidance_scale 1, no classifier-free guidance (the empty prompt was never trained on here); dev: the
    # guidance embedding's input of training (trainer.guidance_scale, 3.5)
    out_latents = pipe(prompt=prompts, height=64, width=64, num_inference_steps=8, output_type="latent",
                       guidance_scale=1.0 if variant == "klein" else 3.5, max_sequence_length=seq,
                       generator=torch.Generator().manual_seed(0)).images
    if variant == "klein":  # its "latent" output is the VAE's (unpatchified, de-normalised): back to the cache's
        bn = pipe.vae.bn
        std = torch.sqrt(bn.running_var + pipe.vae.config.batch_norm_eps).view(1, -1, 1, 1)
        normalised = (patchify(out_latents.float()) - bn.running_mean.view(1, -1, 1, 1)) / std
    else:  # dev's is the packed tokens [B, H*W, C] of the cache's form
        normalised = out_latents.float().permute(0, 2, 1).reshape(len(prompts), 64, 4, 4)
    generated = dict(zip(prompts, normalised))
    assert next(iter(generated.values())).shape == next(iter(reference.values())).shape == (64, 4, 4)
    # measured (klein; 8 sampling steps at the pipeline's own shift, exp(1.91) = 6.8 at 16 tokens): shift 1.0 own
    # 0.009-0.025, nearest other 0.053-0.066 (ratios 0.16-0.33); FLUX.2's shift own 0.011-0.020, nearest other
    # 0.055-0.074 (ratios 0.20-0.26); dev: ratios 0.24-0.37 (shift 1.0) and 0.34-0.38 (FLUX.2's). The captions
    # differ in two words, the pictures in one of 16 latent tokens.
    assert_nearest_own(generated, reference, margin=0.5)
