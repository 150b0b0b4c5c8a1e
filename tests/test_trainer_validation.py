"""Validation grids: the stock pipeline around the in-training transformer, fixed seed, no effect on training."""

import numpy as np
import pytest
import torch
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.validation import image_grid
from PIL import Image

from tests.trainer_helpers import add_validation_prompts, read_metrics, torch_threads, write_fake_cache

PROMPTS = ["a red square", "a blue circle"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_flux):
    root = tmp_path_factory.mktemp("validation-cache")
    write_fake_cache(root, {(32, 48, 1): 4}, seq_len=16, smooth=True)
    add_validation_prompts(root, str(tiny_flux), [*PROMPTS, "a cat"], max_sequence_length=16)  # as a prep does
    return root


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _cfg(**kw):
    return TrainerConfig(
        **{"max_steps": 3, "batch_size": 2, "learning_rate": 1e-3, "save_every": 0, "export": False, **kw}
    )


def test_validation_grid_is_what_the_exported_pipeline_generates(tiny_flux, cache, tmp_path):
    from diffusers import DiffusionPipeline

    cfg = _cfg(
        validate_every=2,
        validation_prompts=PROMPTS,
        validation_steps=2,
        validation_size=[32, 48],
        export=True,
        export_dtype="float32",  # the validation samples ran on the float32 weights: export those exactly
    )
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_flux), train_dir=tmp_path / "t", progress=False)
    grids = sorted((tmp_path / "t" / "validation").iterdir())
    assert [p.name for p in grids] == ["step-000002.png", "step-000003.png"]  # every 2 steps and the last
    assert summary["validation"] == [str(p) for p in grids]
    grid = Image.open(grids[-1])
    assert grid.size == (32, 2 * 48)  # one row per prompt

    # the last grid is the exported pipeline (same weights) sampled with the same seed
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    images = pipe(
        PROMPTS,
        height=48,
        width=32,
        num_inference_steps=2,
        guidance_scale=cfg.guidance_scale,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(0),
    ).images
    assert np.array_equal(np.asarray(grid), np.asarray(image_grid([[im] for im in images])))

    # sampling does not touch the training RNG streams: the losses are those of a run without validation
    train(_cfg(), cache_dir=cache, pretrained=str(tiny_flux), train_dir=tmp_path / "plain", progress=False)
    assert [r["loss"] for r in read_metrics(tmp_path / "t")] == [
        r["loss"] for r in read_metrics(tmp_path / "plain")
    ]


def test_validation_image_goes_to_tensorboard(tiny_flux, cache, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(
        max_steps=1,
        validate_every=1,
        validation_prompts=["a cat"],
        validation_steps=1,
        validation_size=[32, 32],
    )
    train(cfg, cache_dir=cache, pretrained=str(tiny_flux), train_dir=tmp_path, progress=False)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("validation")
    assert image.step == 1 and (image.width, image.height) == (32, 32)


def test_image_grid_layout():
    red, blue = Image.new("RGB", (4, 3), "red"), Image.new("RGB", (4, 3), "blue")
    grid = image_grid([[red, blue], [blue]])
    assert grid.size == (8, 6)
    assert grid.getpixel((0, 0)) == (255, 0, 0) and grid.getpixel((5, 0)) == (0, 0, 255)
    assert grid.getpixel((0, 4)) == (0, 0, 255) and grid.getpixel((5, 4)) == (0, 0, 0)
