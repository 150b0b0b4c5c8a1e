"""The Qwen-Image adapter: calls the transformer like QwenImagePipeline (packing, timestep, img_shapes, text mask),
padded-and-masked captions predict what each caption alone does, trains (full and LoRA) on cached latents, and
exports for QwenImagePipeline (full: DiffusionPipeline.from_pretrained; LoRA: load_lora_weights)."""

from __future__ import annotations

import statistics

import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.qwen_image import (
    QWEN_IMAGE_LORA_TARGETS,
    QwenImageAdapter,
    check_qwen_batch_fits,
    qwen_image_forward,
    trim_to_longest,
)

from tests.trainer_helpers import add_validation_prompts, read_metrics, torch_threads, write_fake_cache

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
            num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _model(seed=0):
    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(**TINY).eval()


def _inputs(B=2, H=8, W=6, L=7):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(B, 16, H, W, generator=gen), torch.rand(B, generator=gen), torch.randn(B, L, 32, generator=gen)


def test_registry_picks_the_adapter():
    adapter = get_adapter("qwen-image")
    assert isinstance(adapter, QwenImageAdapter) and adapter.pipeline_class == "QwenImagePipeline"
    assert adapter.seq_len(torch.zeros(1, 16, 8, 6)) == 12
    assert len(adapter.blocks(_model())) == 2


def test_forward_calls_transformer_like_the_pipeline():
    """QwenImagePipeline.__call__: latents packed by _pack_latents, timestep t / 1000 (t = 1000 sigma),
    img_shapes [[(1, H/2, W/2)]] * B, no guidance, the mask None when every token is real."""
    model = _model()
    noisy, sigmas, prompt = _inputs()
    B, C, H, W = noisy.shape
    with torch.no_grad():
        pred = qwen_image_forward(model, noisy, sigmas, prompt, torch.ones(B, prompt.shape[1], dtype=torch.bool))
        packed = QwenImagePipeline._pack_latents(noisy[:, None], B, C, H, W)  # prepare_latents' [B, 1, C, H, W]
        timesteps = sigmas * 1000  # FlowMatchEulerDiscreteScheduler timesteps
        reference = model(hidden_states=packed, timestep=timesteps / 1000, guidance=None,
                          encoder_hidden_states_mask=None, encoder_hidden_states=prompt,
                          img_shapes=[[(1, H // 2, W // 2)]] * B, return_dict=False)[0]
        unpacked = QwenImagePipeline._unpack_latents(reference, H * 8, W * 8, 8)[:, :, 0]
    assert pred.shape == noisy.shape
    torch.testing.assert_close(pred, unpacked)


def test_reference_latents_are_appended_as_the_edit_pipeline_does():
    """For the Qwen-Image-Edit family to come: QwenImageEditPipeline.__call__ concatenates the packed reference
    latents after the noisy ones, gives img_shapes both grids and keeps the first (H/2)*(W/2) predicted tokens."""
    model = _model()
    noisy, sigmas, prompt = _inputs()
    reference = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(3))  # another size than noisy
    B, C, H, W = noisy.shape
    with torch.no_grad():
        pred = qwen_image_forward(model, noisy, sigmas, prompt, reference_BCHW=reference)
        tokens = torch.cat([QwenImagePipeline._pack_latents(noisy, B, C, H, W),
                            QwenImagePipeline._pack_latents(reference, B, C, 6, 4)], dim=1)
        reference_pred = model(hidden_states=tokens, timestep=sigmas, encoder_hidden_states=prompt,
                               encoder_hidden_states_mask=None, img_shapes=[[(1, H // 2, W // 2), (1, 3, 2)]] * B,
                               return_dict=False)[0][:, : (H // 2) * (W // 2)]
        plain = qwen_image_forward(model, noisy, sigmas, prompt)
    torch.testing.assert_close(pred, QwenImagePipeline._unpack_latents(reference_pred, H * 8, W * 8, 8)[:, :, 0])
    assert (pred - plain).abs().max() > 1e-3  # the reference tokens take part in the attention


def test_padded_masked_batch_predicts_each_caption_alone():
    """Two captions of 3 and 7 tokens, zero-padded to 10 with the mask, predict per sample what each caption at
    its own length predicts in a batch of one (as the pipeline calls it), within float tolerance: the
    transformer's text RoPE does not depend on the padding and the mask keys the joint attention."""
    model = _model()
    noisy, sigmas, _ = _inputs()
    gen = torch.Generator().manual_seed(2)
    captions = [torch.randn(3, 32, generator=gen), torch.randn(7, 32, generator=gen)]
    padded = torch.zeros(2, 10, 32)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    for i, c in enumerate(captions):
        padded[i, : len(c)], mask[i, : len(c)] = c, True
    B, C, H, W = noisy.shape
    with torch.no_grad():
        batched = qwen_image_forward(model, noisy, sigmas, padded, mask)
        # the transformer itself on the full padded length (no trimming): the same within tolerance
        untrimmed = model(hidden_states=QwenImagePipeline._pack_latents(noisy, B, C, H, W), timestep=sigmas,
                          encoder_hidden_states_mask=mask, encoder_hidden_states=padded,
                          img_shapes=[[(1, H // 2, W // 2)]] * B, return_dict=False)[0]
        for i, c in enumerate(captions):
            alone = qwen_image_forward(model, noisy[i : i + 1], sigmas[i : i + 1], c[None])
            torch.testing.assert_close(batched[i : i + 1], alone, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(QwenImagePipeline._unpack_latents(untrimmed[i : i + 1], H * 8, W * 8, 8)[:, :, 0],
                                       alone, atol=1e-5, rtol=1e-5)
        # without the mask, the zero padding would change the shorter caption's prediction
        unmasked = qwen_image_forward(model, noisy, sigmas, padded, None)
        alone0 = qwen_image_forward(model, noisy[:1], sigmas[:1], captions[0][None])
        assert (unmasked[:1] - alone0).abs().max() > 1e-3


def test_unused_modules_are_exactly_those_without_a_gradient(tmp_path):
    """The last block's text output (to_add_out, txt_mlp) never reaches the prediction: no gradient. The
    adapter's load freezes them (DDP refuses parameters unused in the loss)."""
    from latentmill.trainer.qwen_image import unused_modules

    model = _model().train()
    noisy, sigmas, prompt = _inputs()
    qwen_image_forward(model, noisy, sigmas, prompt).square().mean().backward()
    no_grad = {n for n, p in model.named_parameters() if p.grad is None}
    frozen = {f"{prefix}.{n}" for m in unused_modules(model) for prefix in [
        next(k for k, v in model.named_modules() if v is m)] for n, _ in m.named_parameters()}
    assert no_grad == frozen == {f"transformer_blocks.1.{n}" for n in (
        "attn.to_add_out.weight", "attn.to_add_out.bias", "txt_mlp.net.0.proj.weight", "txt_mlp.net.0.proj.bias",
        "txt_mlp.net.2.weight", "txt_mlp.net.2.bias")}
    model.save_pretrained(tmp_path / "transformer")
    loaded = QwenImageAdapter().load(str(tmp_path), mode="full")
    assert {n for n, p in loaded.named_parameters() if not p.requires_grad} == frozen


def test_trim_to_longest():
    embeds = torch.randn(2, 6, 4)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    trimmed, m = trim_to_longest(embeds, mask)
    assert trimmed.shape == (2, 4, 4) and m.tolist() == mask[:, :4].tolist()
    full, none = trim_to_longest(embeds, torch.tensor([[1, 1, 1, 0, 0, 0]] * 2, dtype=torch.bool))
    assert full.shape == (2, 3, 4) and none is None  # captions of equal length: no mask, as the pipeline


def test_mismatched_cache_is_refused_with_the_difference():
    model = _model()
    noisy, _, prompt = _inputs()
    check_qwen_batch_fits(model, noisy, prompt)
    with pytest.raises(ValueError, match="prompt_embeds width is 24, transformer joint_attention_dim is 32"):
        check_qwen_batch_fits(model, noisy, torch.zeros(2, 5, 24))
    with pytest.raises(ValueError, match="expected \\[B, C, H, W\\]"):
        check_qwen_batch_fits(model, torch.zeros(2, 16, 1, 4, 6), prompt)
    with pytest.raises(ValueError, match="in_channels is 64"):
        check_qwen_batch_fits(model, torch.zeros(2, 4, 4, 6), prompt)
    # a cache stored padded (cache.trim_text: never): the mask from the stored length covers zero rows
    padded = prompt.clone()
    padded[1, 5:] = 0
    check_qwen_batch_fits(model, noisy, padded, torch.tensor([[True] * 7, [True] * 5 + [False] * 2]))
    with pytest.raises(ValueError, match="stored padded \\(zeros inside the mask\\)"):
        check_qwen_batch_fits(model, noisy, padded, torch.ones(2, 7, dtype=torch.bool))


def test_lora_targets_are_every_block_linear():
    """The community Qwen-Image LoRA layout (ai-toolkit, musubi-tuner): every Linear of every block."""
    from latentmill.trainer.adapter import make_trainable

    block_linears = {n for n, m in _model().named_modules() if isinstance(m, torch.nn.Linear)
                     and n.startswith("transformer_blocks.")}
    model = make_trainable(_model(), mode="lora", lora_rank=4, lora_target_modules=list(QWEN_IMAGE_LORA_TARGETS))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert wrapped == block_linears
    assert len(wrapped) == 2 * 14  # 14 Linear layers in each of the 2 blocks
    assert not any(n.startswith(("img_in", "txt_in", "proj_out", "norm_out")) for n in wrapped)



@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory):
    """8 smooth image latents in two buckets, trimmed (masked) text of 2..8 tokens."""
    root = tmp_path_factory.mktemp("qwen-cache")
    write_fake_cache(root, {(32, 32, 1): 4, (48, 32, 1): 4}, family="qwen-image", smooth=True, trimmed=True,
                     seq_len=8, latents="distribution")
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "max_ratio"), [("full", 0.75), ("lora", 0.9)])
def test_trains_on_cached_latents(tiny_qwen_image, fake_cache, tmp_path, mode, max_ratio):
    cfg = TrainerConfig(mode=mode, max_steps=30, batch_size=4, learning_rate=3e-3 if mode == "full" else 1e-2,
                        lora_rank=4, lora_target_modules=list(QWEN_IMAGE_LORA_TARGETS), save_every=0, export=False)
    summary = train(cfg, cache_dir=fake_cache, pretrained=str(tiny_qwen_image), train_dir=tmp_path, progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert summary["family"] == "qwen-image" and len(losses) == 30
    ratio = statistics.mean(losses[-5:]) / statistics.mean(losses[:5])
    assert ratio < max_ratio, f"loss fell only to {ratio:.3f} of its start"


GENERATE = dict(prompt="a red ball", height=32, width=48, num_inference_steps=2, output_type="np",
                max_sequence_length=16)


@pytest.mark.slow
def test_full_export_loads_and_generates(tiny_qwen_image, fake_cache, tmp_path):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    cfg = TrainerConfig(mode="full", max_steps=3, batch_size=2, learning_rate=1e-3, save_every=3, caption_dropout=0.5)
    summary = train(cfg, cache_dir=fake_cache, pretrained=str(tiny_qwen_image), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, QwenImagePipeline)
    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000003" / "model.safetensors")
    exported = pipe.transformer.state_dict()
    assert all(torch.equal(exported[k].float(), v.to(exported[k].dtype).float()) or
               torch.equal(exported[k].float(), v.to(torch.bfloat16).float()) for k, v in trained.items())
    base = QwenImagePipeline.from_pretrained(tiny_qwen_image).transformer.state_dict()
    assert any(not torch.equal(base[k], exported[k]) for k in trained)
    images = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).images
    assert images.shape == (1, 32, 48, 3)


@pytest.mark.slow
def test_lora_export_loads_into_the_base_pipeline(tiny_qwen_image, fake_cache, tmp_path):
    add_validation_prompts(fake_cache, str(tiny_qwen_image), ["a red ball"], max_sequence_length=8)  # as a prep does
    cfg = TrainerConfig(mode="lora", max_steps=3, batch_size=2, learning_rate=1e-2, lora_rank=4,
                        lora_target_modules=list(QWEN_IMAGE_LORA_TARGETS), save_every=0, validate_every=3,
                        validation_prompts=["a red ball"], validation_steps=2, validation_size=[48, 32])
    summary = train(cfg, cache_dir=fake_cache, pretrained=str(tiny_qwen_image), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    (grid,) = summary["validation"]
    from PIL import Image

    assert Image.open(grid).size == (48, 32)
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image)
    before = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).images
    pipe.load_lora_weights(summary["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert pipe.transformer.peft_config[adapter].r == 4
    assert set(pipe.transformer.peft_config[adapter].target_modules) == set(QWEN_IMAGE_LORA_TARGETS)
    after = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).images
    assert after.shape == (1, 32, 48, 3) and abs(after - before).max() > 0  # the trained LoRA changes the image


def test_resolution_shift_is_the_pipelines():
    """With the recipes' values, the trainer's shift of a bucket is the one QwenImagePipeline samples it with:
    mu = calculate_shift(tokens, scheduler config), and shift_sigmas(sigma, exp(mu)) is the scheduler's
    exponential time shift (before its shift_terminal stretch, a sampling-only detail)."""
    import json
    import math
    from pathlib import Path

    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    from latentmill.trainer.objective import shift_for, shift_sigmas

    from latentmill.recipe import load_recipe

    repo = Path(__file__).resolve().parents[1]
    config = json.loads((repo / "configs/models/Qwen-Image/scheduler/scheduler_config.json").read_text())
    cfg = load_recipe(repo / "configs/qwen-image-lora.yaml").trainer
    adapter = QwenImageAdapter()
    sigmas = torch.linspace(0.05, 0.95, 7)
    for width, height in ((1328, 1328), (1664, 928), (512, 512)):
        tokens = adapter.seq_len(torch.zeros(1, 16, height // 8, width // 8))
        mu = calculate_shift(tokens, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"],
                             config["max_shift"])
        shift = shift_for(cfg, tokens, adapter.resolution_mu)
        assert shift == pytest.approx(math.exp(mu), rel=1e-12)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config({**config, "shift_terminal": None})
        torch.testing.assert_close(shift_sigmas(sigmas, shift), scheduler.time_shift(mu, 1.0, sigmas))
    assert shift_for(cfg, 6889, adapter.resolution_mu) == pytest.approx(2.30, abs=0.01)  # 1328 x 1328
