"""The Qwen-Image-Edit adapter: calls the transformer as QwenImageEditPipeline does (the source's latents
appended after the noisy ones, both grids in img_shapes, the prediction cut to the target's tokens), trains
(full and LoRA, Qwen-Image's targets) on a cache with a reference stream, and exports for
QwenImageEditPipeline (full: DiffusionPipeline.from_pretrained; LoRA: load_lora_weights), which generate
given an image."""

from __future__ import annotations

import statistics

import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageTransformer2DModel
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.qwen_image import QWEN_IMAGE_LORA_TARGETS, QwenImageEditAdapter
from PIL import Image

from tests.helpers import qwen2vl_processor
from tests.trainer_helpers import read_metrics, torch_threads, write_fake_cache

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
            num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def test_adapter_calls_the_transformer_as_the_edit_pipeline_does():
    """QwenImageEditPipeline.__call__: cat([latents, image_latents]) packed, timestep t / 1000, img_shapes
    [[(1, h, w), (1, h, w)]] * B (the reference at the target's size, as the bucket gives it), the masked
    text, noise_pred[:, : latents.size(1)]: the adapter's prediction is that, so the loss sees the target only."""
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**TINY).eval()
    gen = torch.Generator().manual_seed(1)
    B, C, H, W = 2, 16, 8, 6
    noisy, reference = torch.randn(B, C, H, W, generator=gen), torch.randn(B, C, H, W, generator=gen)
    sigmas, embeds = torch.rand(B, generator=gen), torch.randn(B, 7, 32, generator=gen)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    adapter = get_adapter("qwen-image-edit")
    assert isinstance(adapter, QwenImageEditAdapter) and adapter.pipeline_class == "QwenImageEditPipeline"
    assert adapter.streams == ("latents", "prompt_embeds", "reference_latents")
    assert adapter.lora_targets == QWEN_IMAGE_LORA_TARGETS and adapter.seq_len(noisy) == 12  # the target's tokens
    batch = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "reference_latents": reference, "latents": noisy}
    adapter.check_batch(model, batch)
    with torch.no_grad():
        pred = adapter.forward(model, noisy, sigmas, batch, None)
        latents = QwenImageEditPipeline._pack_latents(noisy[:, None], B, C, H, W)
        image_latents = QwenImageEditPipeline._pack_latents(reference[:, None], B, C, H, W)
        t = sigmas * 1000
        noise_pred = model(hidden_states=torch.cat([latents, image_latents], dim=1), timestep=t / 1000, guidance=None,
                           encoder_hidden_states_mask=mask, encoder_hidden_states=embeds,
                           img_shapes=[[(1, H // 2, W // 2), (1, H // 2, W // 2)]] * B, return_dict=False)[0]
        noise_pred = noise_pred[:, : latents.size(1)]
        plain = get_adapter("qwen-image").forward(model, noisy, sigmas, batch, None)
    torch.testing.assert_close(pred, QwenImageEditPipeline._unpack_latents(noise_pred, H * 8, W * 8, 8)[:, :, 0])
    assert (pred - plain).abs().max() > 1e-3  # the source's tokens take part


def test_a_reference_of_another_shape_is_refused():
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**TINY)
    batch = {"latents": torch.zeros(1, 16, 4, 4), "prompt_embeds": torch.ones(1, 3, 32),
             "reference_latents": torch.zeros(1, 4, 4, 4)}
    with pytest.raises(ValueError, match=r"reference_latents have shape \(1, 4, 4, 4\), latents \(1, 16, 4, 4\)"):
        QwenImageEditAdapter().check_batch(model, batch)



@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory):
    """8 smooth image latents with their sources' latents in two buckets, trimmed (masked) text."""
    from latentmill.stages.families import family_streams

    root = tmp_path_factory.mktemp("qwen-edit-cache")
    write_fake_cache(root, {(32, 32, 1): 4, (48, 32, 1): 4}, family="qwen-image-edit", smooth=True, trimmed=True,
                     seq_len=8, latents="distribution", reference=True,
                     streams=[s.to_json() for s in family_streams("qwen-image-edit")])
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "max_ratio"), [("full", 0.75), ("lora", 0.9)])
def test_trains_on_cached_pairs(tiny_qwen_image_edit, fake_cache, tmp_path, mode, max_ratio):
    cfg = TrainerConfig(mode=mode, max_steps=30, batch_size=4, learning_rate=3e-3 if mode == "full" else 1e-2,
                        lora_rank=4, save_every=0, export=False)
    summary = train(cfg, cache_dir=fake_cache, pretrained=str(tiny_qwen_image_edit), train_dir=tmp_path, progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert summary["family"] == "qwen-image-edit" and len(losses) == 30
    ratio = statistics.mean(losses[-5:]) / statistics.mean(losses[:5])
    assert ratio < max_ratio, f"loss fell only to {ratio:.3f} of its start"


SOURCE = Image.new("RGB", (48, 32), (200, 40, 40))
# the pipeline encodes the source at calculate_dimensions(1024 * 1024, 1.5) = 1248 x 832 whatever height/width
GENERATE = dict(prompt="make it blue", image=SOURCE, height=32, width=48, num_inference_steps=2, output_type="np")


@pytest.mark.slow
def test_full_export_loads_and_generates_from_an_image(tiny_qwen_image_edit, fake_cache, tmp_path):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    cfg = TrainerConfig(mode="full", max_steps=3, batch_size=2, learning_rate=1e-3, save_every=3)
    summary = train(cfg, cache_dir=fake_cache, pretrained=str(tiny_qwen_image_edit), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    export = summary["export_dir"]
    pipe = DiffusionPipeline.from_pretrained(export, processor=qwen2vl_processor(export))
    assert isinstance(pipe, QwenImageEditPipeline) and (tmp_path / "export" / "processor").is_dir()
    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000003" / "model.safetensors")
    exported = pipe.transformer.state_dict()
    # the export's bf16 weights (trainer.export_dtype), loaded back in float32
    assert all(torch.equal(exported[k].float(), v.to(torch.bfloat16).float()) for k, v in trained.items())
    images = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).images
    assert images.shape == (1, 32, 48, 3)


@pytest.mark.slow
def test_lora_export_loads_into_the_base_pipeline(tiny_qwen_image_edit, fake_cache, tmp_path):
    cfg = TrainerConfig(mode="lora", max_steps=3, batch_size=2, learning_rate=1e-2, lora_rank=4, save_every=0)
    summary = train(cfg, cache_dir=fake_cache, pretrained=str(tiny_qwen_image_edit), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    pipe = QwenImageEditPipeline.from_pretrained(tiny_qwen_image_edit, processor=qwen2vl_processor(tiny_qwen_image_edit))
    gen = torch.Generator().manual_seed(0)
    # one transformer call on the pipeline's inputs (a full generation encodes the source at ~1 MP: the full
    # export's test does it once)
    inputs = dict(hidden_states=torch.randn(1, 12, 64, generator=gen), timestep=torch.tensor([0.5]),
                  encoder_hidden_states=torch.randn(1, 5, 32, generator=gen), img_shapes=[[(1, 2, 3), (1, 2, 3)]],
                  return_dict=False)  # 6 noisy tokens, then 6 of the source
    with torch.no_grad():
        before = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(summary["export_dir"])
        after = pipe.transformer(**inputs)[0]
    (adapter,) = pipe.get_active_adapters()
    assert set(pipe.transformer.peft_config[adapter].target_modules) == set(QWEN_IMAGE_LORA_TARGETS)
    assert (after - before).abs().max() > 1e-4  # the trained LoRA changes the prediction


def test_validation_prompts_are_refused_for_an_edit_family():
    with pytest.raises(ValueError, match="trainer.validate_every: the qwen-image-edit family samples from a source"):
        QwenImageEditAdapter().validation_images(None, {"prompt": ["x"]}, {}, size=[32, 32], steps=1, generator=None,
                                                 max_sequence_length=8, guidance_scale=1.0)
