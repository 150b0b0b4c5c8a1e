"""Exports load through the stock Diffusers entry points: a full pipeline folder, or LoRA weights."""

import pytest
import torch
from latentmill.trainer import TrainerConfig, train
from safetensors.torch import load_file

from tests.trainer_helpers import torch_threads, write_fake_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Latents shaped for the tiny Flux pipeline (16 channels; T5 and CLIP widths 32)."""
    root = tmp_path_factory.mktemp("export-cache")
    write_fake_cache(root, {(48, 64, 1): 3, (32, 32, 1): 2}, seq_len=64)
    return root


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def test_full_export_loads_and_generates(tiny_flux, cache, tmp_path):
    from diffusers import DiffusionPipeline, FluxPipeline

    cfg = TrainerConfig(mode="full", max_steps=3, batch_size=2, learning_rate=1e-3, save_every=3)
    summary = train(
        cfg,
        cache_dir=cache,
        pretrained=str(tiny_flux),
        train_dir=tmp_path / "train",
        export_dir=tmp_path / "export",
        progress=False,
    )
    assert summary["export_dir"] == str(tmp_path / "export")
    assert not (tmp_path / "export.tmp").exists()

    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, FluxPipeline)
    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000003" / "model.safetensors")
    # stored in trainer.export_dtype (bfloat16 by default): the trained weights, rounded once
    exported_file = load_file(tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert {v.dtype for v in exported_file.values()} == {torch.bfloat16}
    exported = pipe.transformer.state_dict()
    assert all(torch.equal(exported[k], v.to(torch.bfloat16).to(exported[k].dtype)) for k, v in trained.items())
    base = FluxPipeline.from_pretrained(tiny_flux).transformer.state_dict()
    assert any(not torch.equal(base[k], exported[k]) for k in trained)
    image = pipe(
        "a red square",
        height=64,
        width=48,
        num_inference_steps=2,
        max_sequence_length=64,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (48, 64)


def test_lora_export_loads_into_the_base_pipeline(tiny_flux, cache, tmp_path):
    from diffusers import FluxPipeline

    cfg = TrainerConfig(
        mode="lora", max_steps=3, batch_size=2, learning_rate=1e-2, lora_rank=4, lora_alpha=8.0, save_every=3
    )
    summary = train(
        cfg,
        cache_dir=cache,
        pretrained=str(tiny_flux),
        train_dir=tmp_path / "train",
        export_dir=tmp_path / "lora",
        progress=False,
    )
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(summary["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert pipe.transformer.peft_config[adapter].r == 4
    assert pipe.transformer.peft_config[adapter].lora_alpha == 8  # alpha != rank survives the round trip

    # the loaded LoRA tensors are the trained ones
    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000003" / "model.safetensors")
    loaded = pipe.transformer.state_dict()
    assert trained and all(
        torch.equal(loaded[k.replace(".default.", f".{adapter}.")], v) for k, v in trained.items()
    )
    # and they change the transformer: fused weights differ from the base
    pipe.fuse_lora()
    fused = pipe.transformer.state_dict()
    name = "transformer_blocks.0.attn.to_q"
    assert not torch.equal(fused[f"{name}.base_layer.weight"], before[f"{name}.weight"])
    image = pipe("a red square", height=32, width=32, num_inference_steps=2, max_sequence_length=64).images[0]
    assert image.size == (32, 32)
