"""The Z-Image adapter: calls the transformer exactly like ZImagePipeline (lists of per-sample latents and
real-length captions, t = 1 - sigma, the output negated), trains full and LoRA on cached latents, and exports
artefacts that ZImagePipeline loads."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import ZImageTransformer2DModel
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.objective import shift_sigmas
from latentmill.trainer.zimage import (
    LORA_REGEX,
    LORA_TARGETS,
    ZImageAdapter,
    caption_list,
    check_zimage_batch_fits,
    zimage_forward,
)

from tests.conftest import REPO_ROOT
from tests.trainer_helpers import add_validation_prompts, read_metrics, torch_threads, write_fake_cache

TINY = yaml.safe_load((REPO_ROOT / "data" / "tiny-z-image.yaml").read_text())["components"]["transformer"]


def fake_cache(cache_dir: Path, buckets: dict, **kwargs) -> dict:
    """``write_fake_cache`` for z-image, its manifest recording the family's streams as the cache stage does
    (``prompt_embeds`` a ``mask`` stream: the loader adds ``prompt_embeds_mask``)."""
    from latentmill.stages.families import family_streams

    return write_fake_cache(cache_dir, buckets, family="z-image", trimmed=True,
                            streams=[s.to_json() for s in family_streams("z-image")], **kwargs)


def tiny_transformer(seed: int = 0) -> ZImageTransformer2DModel:
    torch.manual_seed(seed)
    return ZImageTransformer2DModel(**{**TINY, "all_patch_size": (2,), "all_f_patch_size": (1,)}).eval()


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _padded(caps: list[torch.Tensor], pad_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the loader gives for a trimmed mask stream: zero-padded embeds and the bool mask."""
    embeds = torch.zeros(len(caps), pad_to, caps[0].shape[1])
    mask = torch.zeros(len(caps), pad_to, dtype=torch.bool)
    for i, cap in enumerate(caps):
        embeds[i, : len(cap)], mask[i, : len(cap)] = cap, True
    return embeds, mask


def test_registry_and_blocks():
    adapter = get_adapter("z-image")
    assert isinstance(adapter, ZImageAdapter) and adapter.streams == ("latents", "prompt_embeds")
    model = tiny_transformer()
    blocks = adapter.blocks(model)
    assert len(blocks) == 1 + 1 + 2  # noise refiner, context refiner, main layers: every repeated block
    assert blocks[0] is model.noise_refiner[0] and blocks[-1] is model.layers[-1]
    assert adapter.seq_len(torch.zeros(2, 16, 8, 6)) == 12


def test_forward_equals_the_pipeline_transformer_call():
    """Two samples with 7 and 12 real caption tokens, padded to 20 (and to 40: the padding never matters)."""
    model = tiny_transformer()
    gen = torch.Generator().manual_seed(1)
    noisy = torch.randn(2, 16, 8, 6, generator=gen)
    caps = [torch.randn(7, 32, generator=gen), torch.randn(12, 32, generator=gen)]
    sigmas = torch.tensor([0.25, 0.8])
    with torch.no_grad():
        # ZImagePipeline.__call__, one step: t is the scheduler's timestep 1000 * sigma
        timestep = (1000 - sigmas * 1000) / 1000
        out = model(list(noisy.unsqueeze(2).unbind(dim=0)), timestep, caps, return_dict=False)[0]
        reference = -torch.stack([o.float() for o in out], dim=0).squeeze(2)
        embeds, mask = _padded(caps, 20)
        pred = zimage_forward(model, noisy, sigmas, embeds, mask)
        embeds40, mask40 = _padded(caps, 40)
        pred40 = ZImageAdapter().forward(model, noisy, sigmas, {"prompt_embeds": embeds40,
                                                                "prompt_embeds_mask": mask40}, None)
        alone = zimage_forward(model, noisy[1:], sigmas[1:], embeds[1:], mask[1:])
    assert pred.shape == noisy.shape
    torch.testing.assert_close(pred, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pred40, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(alone[0], reference[1], atol=1e-5, rtol=1e-5)  # a batch-mate changes nothing
    assert [c.shape[0] for c in caption_list(embeds, mask)] == [7, 12]


def test_mismatched_cache_is_refused_with_the_difference():
    model = tiny_transformer()
    embeds, mask = _padded([torch.randn(5, 32), torch.randn(9, 32)], 16)
    latents = torch.zeros(2, 16, 8, 6)
    check_zimage_batch_fits(model, latents, embeds, mask)
    with pytest.raises(ValueError, match="prompt_embeds width is 24, transformer cap_feat_dim is 32"):
        check_zimage_batch_fits(model, latents, torch.zeros(2, 16, 24), mask)
    with pytest.raises(ValueError, match="latents have 4 channels, transformer in_channels is 16"):
        check_zimage_batch_fits(model, torch.zeros(2, 4, 8, 6), embeds, mask)
    with pytest.raises(ValueError, match="not a multiple of the 2x2 patches"):
        check_zimage_batch_fits(model, torch.zeros(2, 16, 7, 6), embeds, mask)
    with pytest.raises(ValueError, match="no prompt_embeds_mask column"):
        check_zimage_batch_fits(model, latents, embeds, None)
    with pytest.raises(ValueError, match="cache.trim_text: auto"):  # an untrimmed cache: the mask covers zeros
        check_zimage_batch_fits(model, latents, embeds, torch.ones(2, 16, dtype=torch.bool))


def test_lora_targets_attention_and_feed_forward_of_the_main_layers(tmp_path):
    """As musubi-tuner / ai-toolkit Z-Image LoRAs: the main layers' attention and SwiGLU, not the refiners."""
    tiny_transformer().save_pretrained(tmp_path / "transformer")
    lora = ZImageAdapter().load(str(tmp_path), mode="lora", lora_rank=4, lora_alpha=4,
                                lora_target_modules=list(LORA_TARGETS))
    trainable = {n.split(".lora_")[0] for n, p in lora.named_parameters() if p.requires_grad}
    assert all(".lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    per_block = {"attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}
    assert trainable == {f"layers.{i}.{m}" for i in (0, 1) for m in per_block}
    # the plain suffix form still works (and reaches the refiners too)
    suffixes = ZImageAdapter().load(str(tmp_path), mode="lora", lora_rank=4, lora_target_modules=["to_q"])
    assert {n.split(".lora_")[0] for n, p in suffixes.named_parameters() if p.requires_grad} == {
        f"{b}.attention.to_q" for b in ("noise_refiner.0", "context_refiner.0", "layers.0", "layers.1")}


def test_regex_targets_are_checked_by_the_recipe():
    from latentmill.core.config import ConfigError

    TrainerConfig(mode="lora", lora_target_modules=list(LORA_TARGETS)).validate()
    with pytest.raises(ConfigError, match="'re:<regex>' entry must be the only one"):
        TrainerConfig(mode="lora", lora_target_modules=[*LORA_TARGETS, "to_q"]).validate()
    with pytest.raises(ConfigError, match="is not a regex"):
        TrainerConfig(mode="lora", lora_target_modules=["re:layers\\.(("]).validate()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(transformer-only pretrained folder, cache): 8 smooth latents in two buckets, trimmed masked text."""
    root = tmp_path_factory.mktemp("zimage")
    torch.manual_seed(0)
    tiny_transformer().save_pretrained(root / "pretrained" / "transformer")
    cache = root / "cache"
    fake_cache(cache, {(64, 64, 1): 4, (48, 64, 1): 4}, smooth=True, seq_len=8)
    return str(root / "pretrained"), cache


@pytest.mark.slow
# measured (last 5 / first 5 steps' mean loss): full 0.56; lora (rank 8, the main layers' 7 projections) 0.81
@pytest.mark.parametrize(("mode", "max_ratio"), [("full", 0.75), ("lora", 0.9)])
def test_trains_on_cached_latents(setup, tmp_path, mode, max_ratio):
    pretrained, cache = setup
    cfg = TrainerConfig(mode=mode, max_steps=30, batch_size=4, learning_rate=3e-3 if mode == "full" else 1e-2,
                        lora_rank=8, lora_target_modules=list(LORA_TARGETS), shift=3.0, save_every=0, export=False)
    summary = train(cfg, cache_dir=cache, pretrained=pretrained, train_dir=tmp_path, progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert summary["family"] == "z-image" and len(losses) == 30
    ratio = statistics.mean(losses[-5:]) / statistics.mean(losses[:5])
    assert ratio < max_ratio, f"loss fell only to {ratio:.3f} of its start"
    assert {tuple(r["bucket"]) for r in read_metrics(tmp_path)} == {(64, 64, 1), (48, 64, 1)}


def _capture_pipeline_step(pipe, prompts, **kwargs):
    """Run ZImagePipeline and record each transformer call's inputs and output."""
    calls = []

    def hook(module, args, kwargs_, output):
        calls.append(([x.clone() for x in args[0]], args[1].clone(), [c.clone() for c in args[2]],
                      [o.clone() for o in output[0]]))

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(prompts, output_type="latent", **kwargs)
    finally:
        handle.remove()
    return calls


@pytest.mark.slow
def test_the_pipeline_own_call_and_schedule(tiny_zimage):
    """Inside ZImagePipeline.__call__ (2 prompts, 3 steps, shift 3): the transformer's t is 1 - sigma of our
    shifted sigmas, and the adapter on the same latents and (padded) captions returns the velocity the
    pipeline steps with (= -output)."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    calls = _capture_pipeline_step(pipe, ["a red square", "two dogs running through a green field at sunset"],
                                   height=64, width=48, num_inference_steps=3, guidance_scale=0.0,
                                   max_sequence_length=64, generator=torch.Generator().manual_seed(0))
    assert len(calls) == 3
    base = torch.linspace(1.0, 1 / 3, 3)  # get_default_z_image_sigmas
    adapter = ZImageAdapter()
    for i, (x, t, caps, out) in enumerate(calls):
        sigma = 1.0 - t
        torch.testing.assert_close(sigma, shift_sigmas(base[i:i + 1], 3.0).expand(2), atol=1e-6, rtol=1e-6)
        embeds, mask = _padded(caps, 64)
        noisy = torch.stack(x).squeeze(2)
        with torch.no_grad():
            pred = adapter.forward(pipe.transformer, noisy, sigma, {"prompt_embeds": embeds,
                                                                    "prompt_embeds_mask": mask}, None)
        torch.testing.assert_close(pred, -torch.stack(out).squeeze(2), atol=1e-5, rtol=1e-5)
    assert [c.shape[0] for c in calls[0][2]] == [len(c) for c in pipe.encode_prompt(
        ["a red square", "two dogs running through a green field at sunset"], do_classifier_free_guidance=False,
        max_sequence_length=64)[0]]


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("zimage-export-cache")
    fake_cache(root, {(48, 64, 1): 3}, seq_len=16)
    return root


GENERATE = dict(prompt="a red ball", height=64, width=48, num_inference_steps=2, guidance_scale=0.0,
                max_sequence_length=32, output_type="np")


@pytest.mark.slow
def test_full_export_loads_and_generates(tiny_zimage, export_cache, tmp_path):
    from diffusers import DiffusionPipeline, ZImagePipeline
    from safetensors.torch import load_file

    cfg = TrainerConfig(mode="full", max_steps=3, batch_size=2, learning_rate=1e-3, save_every=3, shift=3.0,
                        export_dtype="float32")
    summary = train(cfg, cache_dir=export_cache, pretrained=str(tiny_zimage), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, ZImagePipeline)
    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000003" / "model.safetensors")
    exported = pipe.transformer.state_dict()
    assert all(torch.equal(exported[k], v) for k, v in trained.items())
    base = ZImagePipeline.from_pretrained(tiny_zimage).transformer.state_dict()
    assert sum(not torch.equal(base[k], exported[k]) for k in trained) > len(trained) // 2
    images = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).images
    assert images.shape == (1, 64, 48, 3)


@pytest.mark.slow
def test_lora_export_loads_into_the_base_pipeline(tiny_zimage, export_cache, tmp_path):
    from diffusers import ZImagePipeline

    add_validation_prompts(export_cache, str(tiny_zimage), ["a red ball"], max_sequence_length=16)  # as a prep does
    cfg = TrainerConfig(mode="lora", max_steps=3, batch_size=2, learning_rate=1e-2, lora_rank=4,
                        lora_target_modules=list(LORA_TARGETS), save_every=0, shift=3.0,
                        validate_every=3, validation_prompts=["a red ball"], validation_steps=1,
                        validation_size=[48, 64], guidance_scale=0.0)
    summary = train(cfg, cache_dir=export_cache, pretrained=str(tiny_zimage), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    (grid,) = summary["validation"]
    from PIL import Image

    assert Image.open(grid).size == (48, 64)
    base = ZImagePipeline.from_pretrained(tiny_zimage)
    before = base(generator=torch.Generator().manual_seed(0), **GENERATE).images
    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    pipe.load_lora_weights(summary["export_dir"])
    (name,) = pipe.get_active_adapters()
    config = pipe.transformer.peft_config[name]
    assert config.r == 4 and config.target_modules == LORA_REGEX
    lora_keys = [k for k in pipe.transformer.state_dict() if "lora_B" in k]
    assert len(lora_keys) == 2 * 7 and all(k.startswith("layers.") for k in lora_keys)  # 2 layers x 7
    after = pipe(generator=torch.Generator().manual_seed(0), **GENERATE).images
    assert after.shape == (1, 64, 48, 3) and not torch.allclose(torch.tensor(before), torch.tensor(after))
