"""Training Wan 2.1 I2V (family ``wan2.1-i2v``): the loop's step is the objective computed by hand over the
conditioned input, and the full and LoRA exports load into WanImageToVideoPipeline and generate from an image."""

from __future__ import annotations

import pytest
import torch
from latentmill.stages.families import WanI2VEncoders
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.objective import flow_matching_loss, interpolate, sample_sigmas
from latentmill.trainer.train import derive_seed
from latentmill.trainer.wan21_i2v import i2v_forward, wan_prompt_embeds

from tests.trainer_helpers import read_metrics, torch_threads, write_fake_cache

pytestmark = pytest.mark.slow
STREAMS = [s.to_json() for s in WanI2VEncoders.STREAMS]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """48 x 32 px, 9 frames: latents and condition_latents [16, 3, 4, 6]; image_embeds [17, 32]; 16 UMT5 tokens."""
    root = tmp_path_factory.mktemp("i2v-cache")
    write_fake_cache(root, {(48, 32, 9): 3}, family="wan2.1-i2v", seq_len=16, dtype=torch.float32, streams=STREAMS)
    return root


def test_first_step_loss_is_the_objective_by_hand(tiny_wan_i2v, cache, tmp_path):
    """Step 1's logged loss, recomputed from the run's own draws through the pipeline's conditioned input."""
    cfg = TrainerConfig(mode="full", max_steps=1, batch_size=1, save_every=0, export=False, shift=3.0)
    train(cfg, cache_dir=cache, pretrained=str(tiny_wan_i2v), train_dir=tmp_path, progress=False, seed=3)
    (record,) = read_metrics(tmp_path)

    batch = next(iter(LatentLoader(cache, 1, 3)))
    x0 = batch["latents"]
    # the sample's own generator: keyed by (seed, epoch, its epoch ordinal), as the run drew it
    gen = torch.Generator().manual_seed(derive_seed(3, f"sample:{batch['epoch']}:{batch['ordinals'][0]}"))
    sigma = sample_sigmas(1, cfg, gen, shift=3.0)
    noise = torch.randn(x0.shape[1:], generator=gen)[None]
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(tiny_wan_i2v, subfolder="transformer")
    args = (batch["prompt_embeds"], batch["condition_latents"], batch["image_embeds"])
    with torch.no_grad():
        pred = i2v_forward(transformer, interpolate(x0, noise, sigma), sigma, *args)
        unconditioned = i2v_forward(transformer, interpolate(x0, noise, sigma), sigma, args[0],
                                    torch.zeros_like(args[1]), torch.zeros_like(args[2]))
    assert record["loss"] == pytest.approx(float(flow_matching_loss(pred, noise - x0)), rel=1e-5)
    # the conditioning reaches the prediction: without it the same draws give another one
    assert float((pred - unconditioned).abs().max()) > 1e-2, float((pred - unconditioned).abs().max())


def _image():
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    return Image.fromarray((torch.rand(32, 48, 3, generator=gen) * 255).byte().numpy())


def _generate(pipe):
    """A 9-frame clip from an image (given prompt_embeds: the I2V pipeline's prompt cleaning needs ftfy)."""
    video = pipe(image=_image(), prompt_embeds=wan_prompt_embeds(pipe, ["a red ball"], 16), guidance_scale=1.0,
                 height=32, width=48, num_frames=9, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).frames
    assert video.shape == (1, 9, 32, 48, 3) and video.std() > 0
    return video


def test_full_export_generates_from_an_image(tiny_wan_i2v, cache, tmp_path):
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    cfg = TrainerConfig(mode="full", max_steps=2, batch_size=2, learning_rate=1e-3, save_every=0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_wan_i2v), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    assert summary["family"] == "wan2.1-i2v"
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, WanImageToVideoPipeline) and pipe.image_encoder is not None
    base = WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v)
    assert any(not torch.equal(base.transformer.state_dict()[k], v) for k, v in pipe.transformer.state_dict().items())
    assert not (_generate(pipe) == _generate(base)).all()


def test_lora_export_loads_and_generates(tiny_wan_i2v, cache, tmp_path):
    from diffusers import WanImageToVideoPipeline

    cfg = TrainerConfig(mode="lora", max_steps=2, batch_size=2, learning_rate=1e-2, lora_rank=4, save_every=0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_wan_i2v), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v)
    pipe.load_lora_weights(summary["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert pipe.transformer.peft_config[adapter].r == 4
    assert not (_generate(pipe) == _generate(WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v))).all()
