"""One ``Validator`` per run (issue 16, item 9): components loaded once, the same grids, the cache's VAE dtype.

Loads are counted at the real loading calls: ``from_pretrained`` of the Transformers and Diffusers model base
classes is wrapped to record the class it loads and then load it as before.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel, ModelMixin, WanTransformer3DModel
from latentmill.trainer import TrainerConfig
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.validation import (
    Validator,
    component_dtypes,
    grid_frames,
    image_grid,
    run_validation,
    video_path,
)
from PIL import Image
from transformers import PreTrainedModel

from tests.trainer_helpers import torch_threads

PROMPTS = ["a red square", "a blue circle"]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture()
def loads(monkeypatch) -> Counter:
    """Class name -> ``from_pretrained`` calls of Transformers / Diffusers models (each a real load)."""
    counts: Counter = Counter()
    for base in (PreTrainedModel, ModelMixin):
        original = base.__dict__["from_pretrained"].__func__

        def counting(cls, *args, _original=original, **kwargs):
            counts[cls.__name__] += 1
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(base, "from_pretrained", classmethod(counting))
    return counts


def _cfg(size: list[int]) -> TrainerConfig:
    return TrainerConfig(validation_prompts=PROMPTS, validation_steps=2, validation_size=size, validation_seed=3)


def _reference_grid(adapter, transformer, pretrained: str, cfg, max_sequence_length: int) -> np.ndarray:
    """The grid of the previous ``run_validation`` on CPU: a fresh ``from_pretrained`` pipeline, fork_rng."""
    pipe = adapter.diffusers_class(adapter.pipeline_class).from_pretrained(pretrained, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        rows = adapter.validation_images(
            pipe, {"prompt": PROMPTS}, {}, size=list(cfg.validation_size), steps=cfg.validation_steps,
            generator=torch.Generator("cpu").manual_seed(cfg.validation_seed),
            max_sequence_length=max_sequence_length, guidance_scale=cfg.guidance_scale,
        )
    return np.asarray(image_grid([grid_frames(row) for row in rows]))


def test_one_validator_loads_the_components_once(tiny_flux, loads, tmp_path):
    adapter, pretrained = get_adapter("flux"), str(tiny_flux)
    transformer = FluxTransformer2DModel.from_pretrained(pretrained, subfolder="transformer")
    cfg = _cfg([32, 48])
    loads.clear()
    validator = Validator(adapter, pretrained, "cpu")
    first = validator.run(transformer, cfg=cfg, step=1, train_dir=tmp_path / "v", max_sequence_length=16)
    text_encoder = validator.pipe.text_encoder_2
    with torch.no_grad():  # the weights move between validations
        transformer.proj_out.bias.add_(0.5)
    second = validator.run(transformer, cfg=cfg, step=2, train_dir=tmp_path / "v", max_sequence_length=16)
    assert dict(loads) == {"AutoencoderKL": 1, "CLIPTextModel": 1, "T5EncoderModel": 1}  # once, for two
    assert validator.pipe.text_encoder_2 is text_encoder
    assert validator.pipe.transformer is None  # the pipeline does not hold the training model between runs
    assert not np.array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(second)))

    # the one-off path (what every validation did before): each call loads everything again
    loads.clear()
    for step in (1, 2):
        run_validation(adapter, transformer, pretrained=pretrained, cfg=cfg, step=step, train_dir=tmp_path / "r",
                       device=torch.device("cpu"), max_sequence_length=16)
    assert dict(loads) == {"AutoencoderKL": 2, "CLIPTextModel": 2, "T5EncoderModel": 2}

    # the second grid of the Validator is the grid of a fresh pipeline on the same weights, pixel for pixel
    reference = _reference_grid(adapter, transformer, pretrained, cfg, 16)
    assert reference.shape == (2 * 48, 32, 3)
    assert np.array_equal(np.asarray(Image.open(second)), reference)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "r" / "validation" / "step-000002.png")), reference)


def test_wan_validator_grids_equal_a_fresh_pipeline(tiny_wan, loads, tmp_path):
    adapter, pretrained = get_adapter("wan"), str(tiny_wan)
    transformer = WanTransformer3DModel.from_pretrained(pretrained, subfolder="transformer")
    cfg = _cfg([32, 32, 5])
    loads.clear()
    validator = Validator(adapter, pretrained, "cpu")
    paths = [validator.run(transformer, cfg=cfg, step=s, train_dir=tmp_path, max_sequence_length=16)
             for s in (1, 2)]
    assert dict(loads) == {"AutoencoderKLWan": 1, "UMT5EncoderModel": 1}
    reference = _reference_grid(adapter, transformer, pretrained, cfg, 16)
    assert reference.shape == (2 * 32, 4 * 32, 3)  # one row per prompt: 4 frames of each video
    for path in paths:  # the components' round trip to the device and back changes nothing
        assert np.array_equal(np.asarray(Image.open(path)), reference)
        with Image.open(video_path(path)) as video:  # every frame, the two prompts side by side
            assert (video.format, video.n_frames, video.size) == ("GIF", 5, (2 * 32, 32))


def test_dtype_table_follows_the_cache():
    f32, bf16 = torch.float32, torch.bfloat16
    assert component_dtypes("wan", "cuda") == {"vae": f32, "text": bf16, "transformer": bf16}
    assert component_dtypes("flux", "cuda") == {"vae": bf16, "text": bf16, "transformer": bf16}
    for family in ("wan", "flux"):
        assert component_dtypes(family, "cpu") == {"vae": f32, "text": f32, "transformer": f32}


def test_wan_components_load_in_the_cache_dtypes_and_the_vae_decodes_outside_autocast(tiny_wan):
    """A CUDA validator's components, loaded on the CPU (they stay there between validations): the Wan VAE
    in float32, the text encoder in bf16; the VAE's decode ignores the caller's bf16 autocast."""
    adapter = get_adapter("wan")
    transformer = WanTransformer3DModel.from_pretrained(str(tiny_wan), subfolder="transformer")
    validator = Validator(adapter, str(tiny_wan), "cuda")
    pipe = validator._pipeline(transformer)
    assert pipe.vae.dtype == torch.float32 and pipe.text_encoder.dtype == torch.bfloat16
    assert {p.device.type for c in validator._components() for p in c.parameters()} == {"cpu"}
    z = torch.randn(1, pipe.vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = pipe.vae.decode(z, return_dict=False)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = pipe.vae.decode(z, return_dict=False)[0]
    assert plain.dtype == under_autocast.dtype == torch.float32
    assert plain.shape == (1, 3, 5, 32, 32)
    assert torch.equal(plain, under_autocast)  # in bf16 convolutions: up to 5e-3 apart
