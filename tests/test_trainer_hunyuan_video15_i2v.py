"""Training HunyuanVideo 1.5 image-to-video (family ``hunyuanvideo1.5-i2v``): the loop's step is the objective
computed by hand over the image-conditioned call, and the exports (full, LoRA) load into
HunyuanVideo15ImageToVideoPipeline and generate from an image."""

from __future__ import annotations

import pytest
import torch
from latentmill.stages.families import family_streams
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.hunyuan_video15 import hunyuan_video15_forward
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.objective import flow_matching_loss, interpolate, sample_sigmas
from latentmill.trainer.train import derive_seed

from tests.trainer_helpers import read_metrics, torch_threads, write_fake_cache

pytestmark = pytest.mark.slow
STREAMS = [s.to_json() for s in family_streams("hunyuanvideo1.5-i2v")]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """48 x 32 px, 9 frames: latents [16, 3, 2, 3], image_latents [16, 1, 2, 3], image_embeds [16, 16]; up to 8
    Qwen tokens and 0-3 glyph tokens."""
    root = tmp_path_factory.mktemp("hunyuan-i2v-cache")
    write_fake_cache(root, {(48, 32, 9): 3}, family="hunyuanvideo1.5-i2v", channels=16, seq_len=8,
                     dtype=torch.float32, trimmed=True, streams=STREAMS)
    return root


def test_first_step_loss_is_the_objective_by_hand(tiny_hunyuan_video15_i2v, cache, tmp_path):
    """Step 1's logged loss, recomputed from the run's own draws with the pipeline's image-conditioned call (text
    padded to the manifest's lengths with masks); without the image the same draws predict otherwise."""
    cfg = TrainerConfig(mode="full", max_steps=1, batch_size=1, save_every=0, export=False, shift=5.0)
    train(cfg, cache_dir=cache, pretrained=str(tiny_hunyuan_video15_i2v), train_dir=tmp_path, progress=False, seed=3)
    (record,) = read_metrics(tmp_path)

    batch = next(iter(LatentLoader(cache, 1, 3)))
    assert batch["image_latents"].shape == (1, 16, 1, 2, 3) and batch["image_embeds"].shape == (1, 16, 16)
    x0 = batch["latents"]
    # the sample's own generator: keyed by (seed, epoch, its epoch ordinal), as the run drew it
    gen = torch.Generator().manual_seed(derive_seed(3, f"sample:{batch['epoch']}:{batch['ordinals'][0]}"))
    sigma = sample_sigmas(1, cfg, gen, shift=5.0)
    noise = torch.randn(x0.shape[1:], generator=gen)[None]
    from diffusers import HunyuanVideo15Transformer3DModel

    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(tiny_hunyuan_video15_i2v, subfolder="transformer")
    text = (batch["prompt_embeds"], batch["prompt_embeds_mask"], batch["prompt_embeds_2"], batch["prompt_embeds_2_mask"])
    with torch.no_grad():
        pred = hunyuan_video15_forward(transformer, interpolate(x0, noise, sigma), sigma, *text,
                                       image_latents_BC1HW=batch["image_latents"], image_embeds_BSE=batch["image_embeds"])
        unconditioned = hunyuan_video15_forward(transformer, interpolate(x0, noise, sigma), sigma, *text)
    assert record["loss"] == pytest.approx(float(flow_matching_loss(pred, noise - x0)), rel=1e-5)
    assert float((pred - unconditioned).abs().max()) > 1e-2, float((pred - unconditioned).abs().max())


def _generate(pipe):
    """A 9-frame clip from a 48 x 32 image (the pipeline samples at its target-size bucket for the image)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    image = Image.fromarray((torch.rand(32, 48, 3, generator=gen) * 255).byte().numpy())
    video = pipe(image=image, prompt='a sign that reads "OPEN"', num_frames=9, num_inference_steps=2,
                 output_type="np", generator=torch.Generator().manual_seed(0)).frames
    assert video.shape[:2] == (1, 9) and video.std() > 0
    return video


def test_full_export_generates_from_an_image(tiny_hunyuan_video15_i2v, cache, tmp_path):
    from diffusers import DiffusionPipeline, HunyuanVideo15ImageToVideoPipeline

    cfg = TrainerConfig(mode="full", max_steps=2, batch_size=2, learning_rate=1e-3, save_every=0, shift=5.0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_hunyuan_video15_i2v), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    assert summary["family"] == "hunyuanvideo1.5-i2v"
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, HunyuanVideo15ImageToVideoPipeline) and pipe.image_encoder is not None
    base = HunyuanVideo15ImageToVideoPipeline.from_pretrained(tiny_hunyuan_video15_i2v)
    changed = [k for k, v in pipe.transformer.state_dict().items()
               if not torch.equal(base.transformer.state_dict()[k].bfloat16(), v.bfloat16())]
    assert any(k.startswith("image_embedder.") for k in changed)  # the image tokens' projection trained
    assert not (_generate(pipe) == _generate(base)).all()


@pytest.mark.heavy  # the LoRA path of this family runs in make test under FSDP2 (test_trainer_hunyuan_video15_i2v_parallel)
def test_lora_export_loads_into_the_transformer(tiny_hunyuan_video15_i2v, cache, tmp_path):
    """As text-to-video's: no LoRA loader for this pipeline in diffusers 0.42, the transformer's
    load_lora_adapter loads the file save_lora_weights would write."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    cfg = TrainerConfig(mode="lora", max_steps=2, batch_size=2, learning_rate=1e-2, lora_rank=4, save_every=0)
    summary = train(cfg, cache_dir=cache, pretrained=str(tiny_hunyuan_video15_i2v), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(tiny_hunyuan_video15_i2v)
    before = _generate(pipe)
    pipe.transformer.load_lora_adapter(summary["export_dir"], use_safetensors=True)
    (name,) = pipe.transformer.active_adapters()
    assert pipe.transformer.peft_config[name].r == 4
    assert not (_generate(pipe) == before).all()
