"""Training Wan 2.2 TI2V (family ``wan2.2-ti2v``): the loop's image-to-video step is the objective computed by
hand, and the exports load into WanPipeline and WanImageToVideoPipeline and generate."""

from __future__ import annotations

import pytest
import torch
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.objective import first_frame_mask, flow_matching_loss, interpolate, sample_sigmas
from latentmill.trainer.train import derive_seed
from latentmill.trainer.wan22_ti2v import ti2v_forward

from tests.trainer_helpers import read_metrics, torch_threads, write_fake_cache

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """64 x 32 px, 9 frames: latents [48, 3, 2, 4]; 16 UMT5 tokens."""
    root = tmp_path_factory.mktemp("ti2v-cache")
    write_fake_cache(root, {(64, 32, 9): 3}, family="wan2.2-ti2v", channels=48, seq_len=16, dtype=torch.float32)
    return root


@pytest.mark.parametrize("i2v", [0.0, 1.0])
def test_first_step_loss_is_the_objective_by_hand(tiny_wan_ti2v, cache, tmp_path, i2v):
    """Step 1's logged loss, recomputed from the run's own draws: T2V noises every frame; I2V keeps latent
    frame 0 clean (timestep 0 on its tokens) and leaves it out of the loss."""
    cfg = TrainerConfig(mode="full", max_steps=1, batch_size=1, save_every=0, export=False, shift=5.0,
                        i2v_probability=i2v)
    train(cfg, cache_dir=cache, pretrained=str(tiny_wan_ti2v), train_dir=tmp_path, progress=False, seed=3)
    (record,) = read_metrics(tmp_path)

    batch = next(iter(LatentLoader(cache, 1, 3)))
    x0, embeds = batch["latents"], batch["prompt_embeds"]
    # the sample's own generator: keyed by (seed, epoch, its epoch ordinal), as the run drew it
    gen = torch.Generator().manual_seed(derive_seed(3, f"sample:{batch['epoch']}:{batch['ordinals'][0]}"))
    sigma = sample_sigmas(1, cfg, gen, shift=5.0)
    noise = torch.randn(x0.shape[1:], generator=gen)[None]
    clean = torch.rand(1, generator=gen) < i2v if i2v else torch.tensor([False])
    assert bool(clean) == (i2v == 1.0)
    mask = first_frame_mask(x0.shape, clean)
    noisy = mask * interpolate(x0, noise, sigma) + (1 - mask) * x0
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(tiny_wan_ti2v, subfolder="transformer")
    with torch.no_grad():
        pred = ti2v_forward(transformer, noisy, sigma, embeds, mask if i2v else None)
    expected = flow_matching_loss(pred, noise - x0, mask=mask if i2v else None)
    assert record["loss"] == pytest.approx(float(expected), rel=1e-5)
    if i2v:  # the clean frame is out of the loss: counting it would give another value
        assert float(flow_matching_loss(pred, noise - x0)) != pytest.approx(record["loss"], rel=1e-3)


def _image():
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    return Image.fromarray((torch.rand(32, 64, 3, generator=gen) * 255).byte().numpy())


GENERATE = dict(height=32, width=64, num_frames=9, num_inference_steps=2, output_type="np")


def _generate_both(t2v, i2v):
    """A T2V clip from WanPipeline and an I2V clip from WanImageToVideoPipeline (given prompt_embeds: its own
    prompt cleaning needs ftfy); returns the I2V clip's first frame and the image it was given, both [0, 1]."""
    frames = t2v(prompt="a red ball", max_sequence_length=16, generator=torch.Generator().manual_seed(0),
                 **GENERATE).frames
    assert frames.shape == (1, 9, 32, 64, 3) and frames.std() > 0
    embeds = t2v.encode_prompt("a red ball", do_classifier_free_guidance=False, max_sequence_length=16)[0]
    image = _image()
    video = i2v(image=image, prompt_embeds=embeds, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                **GENERATE).frames
    assert video.shape == (1, 9, 32, 64, 3)
    return video, image


def test_full_export_generates_text_and_image_to_video(tiny_wan_ti2v, cache, tmp_path):
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline, WanPipeline

    cfg = TrainerConfig(mode="full", max_steps=2, batch_size=2, learning_rate=1e-3, save_every=0,
                        i2v_probability=0.5)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_wan_ti2v), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    assert summary["family"] == "wan2.2-ti2v"
    t2v = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(t2v, WanPipeline) and t2v.config.expand_timesteps
    i2v = WanImageToVideoPipeline.from_pretrained(summary["export_dir"])
    assert i2v.config.expand_timesteps
    base = WanPipeline.from_pretrained(tiny_wan_ti2v).transformer.state_dict()
    assert any(not torch.equal(base[k], v.to(base[k].dtype)) for k, v in t2v.transformer.state_dict().items())
    _generate_both(t2v, i2v)


@pytest.mark.heavy
def test_lora_export_loads_into_both_pipelines(tiny_wan_ti2v, cache, tmp_path):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    cfg = TrainerConfig(mode="lora", max_steps=2, batch_size=2, learning_rate=1e-2, lora_rank=4, save_every=0,
                        i2v_probability=0.5)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_wan_ti2v), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    t2v = WanPipeline.from_pretrained(tiny_wan_ti2v)
    i2v = WanImageToVideoPipeline.from_pretrained(tiny_wan_ti2v)
    for pipe in (t2v, i2v):
        pipe.load_lora_weights(summary["export_dir"])
        (adapter,) = pipe.get_active_adapters()
        assert pipe.transformer.peft_config[adapter].r == 4
    _generate_both(t2v, i2v)


def test_a_one_frame_sample_trains_text_to_video(tiny_wan_ti2v, tmp_path):
    """An image in a video cache (1 latent frame) has no frame to learn after a clean first one: it trains as
    text-to-video (a mask over nothing would divide by zero)."""
    write_fake_cache(tmp_path / "cache", {(64, 32, 1): 2}, family="wan2.2-ti2v", channels=48, seq_len=16)
    cfg = TrainerConfig(mode="full", max_steps=2, batch_size=2, save_every=0, export=False, i2v_probability=1.0)
    summary = train(cfg, cache_dir=tmp_path / "cache", pretrained=str(tiny_wan_ti2v), train_dir=tmp_path / "t",
                    progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "t")]
    assert summary["steps"] == 2 and all(0 < x < 1e3 for x in losses), losses
