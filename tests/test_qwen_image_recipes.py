"""Qwen-Image recipes: the shipped real-size and demo recipes, `latentmill plan` from the published configs,
the demo end to end (prep -> train -> export that QwenImagePipeline loads), and a recipe mixing families
refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from latentmill.trainer.qwen_image import QWEN_IMAGE_LORA_TARGETS

from latentmill.cli import main
from latentmill.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
QWEN_IMAGE_PARAMS = 20_430_401_088  # "20B MMDiT" (Qwen-Image technical report; 40.9 GB of bf16 weights on the hub)
SCHEDULER = json.loads((REPO / "configs/models/Qwen-Image/scheduler/scheduler_config.json").read_text())


@pytest.mark.parametrize(("name", "mode", "strategy"), [("qwen-image-lora.yaml", "lora", "fsdp2"),
                                                        ("qwen-image-full.yaml", "full", "fsdp2")])
def test_real_size_recipes(name, mode, strategy):
    recipe = load_recipe(REPO / "configs" / name)
    recipe.trainer.validate()
    recipe.parallel.validate()
    assert (recipe.model.pretrained, recipe.model.family) == ("Qwen/Qwen-Image", "qwen-image")
    assert (recipe.trainer.mode, recipe.parallel.strategy) == (mode, strategy)
    assert recipe.trainer.activation_checkpointing and recipe.trainer.resume == "latest"
    assert recipe.bucket.resolution == 1328 and recipe.cache.max_sequence_length == 512
    t = recipe.trainer
    # the shift the pipeline samples with: its scheduler's dynamic shifting values
    assert (t.shift_mode, t.base_shift, t.max_shift, t.base_image_seq_len, t.max_image_seq_len) == (
        "resolution", SCHEDULER["base_shift"], SCHEDULER["max_shift"], SCHEDULER["base_image_seq_len"],
        SCHEDULER["max_image_seq_len"])
    if mode == "lora":
        assert tuple(t.lora_target_modules) == QWEN_IMAGE_LORA_TARGETS


def test_demo_recipe_uses_the_tiny_set_and_the_family_shift():
    recipe = load_recipe(REPO / "configs" / "demo-qwen-image.yaml")
    assert recipe.model.family == "qwen-image" and recipe.model.tiny_recipe.endswith("data/tiny-qwen-image.yaml")
    assert (recipe.trainer.shift_mode, recipe.trainer.max_shift, recipe.trainer.max_image_seq_len) == (
        "resolution", 0.9, 8192)
    import yaml

    tiny = yaml.safe_load((REPO / "data/tiny-qwen-image.yaml").read_text())["components"]["scheduler"]
    assert {k: tiny[k] for k in ("base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len",
                                 "shift_terminal", "time_shift_type", "use_dynamic_shifting")} == {
        k: SCHEDULER[k] for k in ("base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len",
                                  "shift_terminal", "time_shift_type", "use_dynamic_shifting")}


@pytest.mark.slow
@pytest.mark.heavy  # the meta-device plan path make test runs for FLUX.1, Wan and Z-Image (make test-all)
def test_plan_builds_the_published_20b_transformer():
    from latentmill.plan import plan_config

    result = plan_config("configs/qwen-image-full.yaml", [], nproc=8, nnodes=4)
    assert result["total_params"] == QWEN_IMAGE_PARAMS
    # the last block's to_add_out and txt_mlp (84,953,088) are frozen: their output never reaches the prediction
    assert result["trainable_params"] == QWEN_IMAGE_PARAMS - 84_953_088
    assert (result["world_size"], result["mesh"]) == (32, [2, 16])
    assert result["config"]["family"] == "qwen-image"
    # float32 masters: rank 0 holds the ceil-chunked dim-0 rows of every parameter over 16 shards
    import math

    import diffusers

    cls = diffusers.QwenImageTransformer2DModel
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(REPO / "configs/models/Qwen-Image"), subfolder="transformer"))
    rank0 = sum(math.ceil(p.shape[0] / 16) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert result["per_rank"]["params_bytes"] == rank0 * 4
    lora = plan_config("configs/qwen-image-lora.yaml", [], nproc=8, nnodes=1)
    # rank 16 on the 14 Linear layers of each of 60 blocks (147,456,000), less the last block's to_add_out and
    # txt_mlp (589,824: frozen, their output never reaches the prediction)
    assert lora["trainable_params"] == 147_456_000 - 589_824
    assert lora["total_params"] == QWEN_IMAGE_PARAMS + 147_456_000


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from latentmill.tiny import build_tiny_flux
    from latentmill.tiny_qwen_image import build_tiny_qwen_image

    root = tmp_path_factory.mktemp("models")
    return build_tiny_qwen_image(root / "tiny-qwen-image"), build_tiny_flux(root / "tiny-flux")


@pytest.mark.slow
@pytest.mark.parametrize("override", ["model.vae={flux}", "model.vae={flux}/vae", "model.text_encoder={flux}",
                                      "model.family=qwen-image"])
def test_a_recipe_mixing_families_fails_before_any_work(tiny_models, tmp_path, capsys, override):
    qwen, flux = tiny_models
    out = tmp_path / "never"
    pretrained = flux if override == "model.family=qwen-image" else qwen
    args = ["prep", str(REPO / "configs/demo-qwen-image.yaml"), f"output_dir={out}", f"model.pretrained={pretrained}",
            override.format(flux=flux)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    if override == "model.family=qwen-image":
        assert "model.family: 'qwen-image', but" in err[0] and "is a FluxPipeline (the 'flux' family)" in err[0]
    elif "text_encoder" in override:
        assert err[0].startswith("latentmill: error: model.text_encoder:") and "is a CLIPTextModel; the " \
            "QwenImagePipeline" in err[0] and "takes a Qwen2_5_VLForConditionalGeneration" in err[0]
    else:
        assert err[0].startswith("latentmill: error: model.vae:") and "is a AutoencoderKL; the QwenImagePipeline" \
            in err[0] and "takes a AutoencoderKLQwenImage" in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_demo_runs_end_to_end_and_the_export_generates(tiny_models, tmp_path):
    from diffusers import DiffusionPipeline, QwenImagePipeline

    qwen, _ = tiny_models
    summary_path = tmp_path / "summary.json"
    assert main(["run", str(REPO / "configs/demo-qwen-image.yaml"), f"output_dir={tmp_path / 'out'}",
                 f"model.pretrained={qwen}", f"ingest.source={REPO / 'data/demo/images'}", "trainer.max_steps=40",
                 "trainer.save_every=20", "--summary-json", str(summary_path)]) == 0
    manifest = json.loads(next((tmp_path / "out").rglob("cache/manifest.json")).read_text())
    assert manifest["family"] == "qwen-image" and manifest["counts"]["out"] == 24
    metrics = [json.loads(line) for line in next((tmp_path / "out").rglob("metrics.jsonl")).read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 40 and sum(losses[-10:]) < 0.8 * sum(losses[:10])  # measured: ~0.6 of the start
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "out" / "export")
    assert isinstance(pipe, QwenImagePipeline)
    base = QwenImagePipeline.from_pretrained(qwen).transformer.state_dict()
    assert any(not torch.equal(v, pipe.transformer.state_dict()[k].to(v.dtype)) for k, v in base.items())
    image = pipe("a red circle on a blue background", height=96, width=64, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0), max_sequence_length=32).images[0]
    assert image.size == (64, 96)
