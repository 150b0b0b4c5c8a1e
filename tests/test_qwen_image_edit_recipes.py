"""Qwen-Image-Edit recipes: the shipped real-size and demo recipes, the demo edit pairs, `latentmill plan` from
the published configs, the demo end to end (prep -> train -> export that QwenImageEditPipeline loads and
samples from an image), and bad input refused in one line: an edit recipe without pairs, a cache of the other
Qwen-Image family."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from latentmill.trainer.qwen_image import QWEN_IMAGE_LORA_TARGETS

from latentmill.cli import main
from latentmill.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
SCHEDULER = json.loads((REPO / "configs/models/Qwen-Image-Edit/scheduler/scheduler_config.json").read_text())
QWEN_IMAGE_PARAMS = 20_430_401_088  # Qwen-Image's transformer, which Qwen-Image-Edit fine-tunes


@pytest.mark.parametrize(("name", "mode", "strategy"), [("qwen-image-edit-lora.yaml", "lora", "fsdp2"),
                                                        ("qwen-image-edit-full.yaml", "full", "fsdp2")])
def test_real_size_recipes(name, mode, strategy):
    recipe = load_recipe(REPO / "configs" / name)
    recipe.trainer.validate()
    recipe.parallel.validate()
    assert (recipe.model.pretrained, recipe.model.family) == ("Qwen/Qwen-Image-Edit", "qwen-image-edit")
    assert (recipe.trainer.mode, recipe.parallel.strategy) == (mode, strategy)
    assert recipe.ingest.edit and recipe.trainer.validate_every == 0 and recipe.trainer.caption_dropout == 0
    assert recipe.bucket.resolution == 1024 and recipe.cache.max_sequence_length == 2048
    t = recipe.trainer
    assert (t.shift_mode, t.base_shift, t.max_shift, t.base_image_seq_len, t.max_image_seq_len) == (
        "resolution", SCHEDULER["base_shift"], SCHEDULER["max_shift"], SCHEDULER["base_image_seq_len"],
        SCHEDULER["max_image_seq_len"])
    if mode == "lora":
        assert tuple(t.lora_target_modules) == QWEN_IMAGE_LORA_TARGETS
    if strategy == "fsdp2":  # the full recipe is HSDP over 2 nodes; the LoRA shards its base over one node
        assert recipe.parallel.hsdp_replicate == (2 if mode == "full" else 1) and recipe.parallel.mixed_precision


def test_demo_edits_are_what_make_demo_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_demo", REPO / "data" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate_edits(tmp_path)

    def digests(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    committed = REPO / "data" / "demo" / "edits"
    assert digests(tmp_path) == digests(committed) and len(digests(committed)) == 36  # 12 x (target, source, text)
    recipe = load_recipe(REPO / "configs" / "demo-qwen-image-edit.yaml")
    assert recipe.model.family == "qwen-image-edit" and recipe.ingest.edit
    assert recipe.model.tiny_recipe.endswith("data/tiny-qwen-image-edit.yaml")


@pytest.mark.slow
@pytest.mark.heavy  # the meta-device plan path make test runs for FLUX.1, Wan and Z-Image (make test-all)
def test_plan_builds_the_published_20b_transformer():
    from latentmill.plan import plan_config

    result = plan_config("configs/qwen-image-edit-full.yaml", [], nproc=8, nnodes=4)
    assert result["total_params"] == QWEN_IMAGE_PARAMS and result["config"]["family"] == "qwen-image-edit"
    assert result["trainable_params"] == QWEN_IMAGE_PARAMS - 84_953_088  # the last block's unused text output
    assert (result["world_size"], result["mesh"]) == (32, [2, 16])
    lora = plan_config("configs/qwen-image-edit-lora.yaml", [], nproc=8, nnodes=1)
    assert lora["trainable_params"] == 147_456_000 - 589_824


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo at 64 px for 40 steps on a model folder of its own."""
    from latentmill.tiny_qwen_image import build_tiny_qwen_image_edit

    root = tmp_path_factory.mktemp("edit-demo")
    pretrained = build_tiny_qwen_image_edit(root / "tiny-qwen-image-edit")
    summary = root / "summary.json"
    assert main(["run", str(REPO / "configs/demo-qwen-image-edit.yaml"), f"output_dir={root / 'out'}",
                 f"model.pretrained={pretrained}", f"ingest.source={REPO / 'data/demo/edits'}",
                 "bucket.resolution=64", "trainer.max_steps=40", "trainer.save_every=20",
                 "--summary-json", str(summary)]) == 0
    return pretrained, root / "out", json.loads(summary.read_text())


@pytest.mark.slow
@pytest.mark.heavy  # make test-all: the demo path make test runs for Qwen-Image; edit prep, training and the
# export are each in make test (test_qwen_image_edit_cache.py, test_trainer_qwen_image_edit.py)
def test_demo_runs_end_to_end_and_the_export_edits_an_image(demo_run):
    from diffusers import DiffusionPipeline, QwenImageEditPipeline
    from PIL import Image

    from tests.helpers import qwen2vl_processor

    pretrained, out, summary = demo_run
    assert summary["stages"]["cache"]["out"] == 12 and summary["train"]["steps"] == 40
    manifest = json.loads(next(out.rglob("cache/manifest.json")).read_text())
    assert manifest["family"] == "qwen-image-edit" and manifest["counts"]["out"] == 12
    losses = [json.loads(line)["loss"] for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 40 and sum(losses[-10:]) < 0.8 * sum(losses[:10])
    pipe = DiffusionPipeline.from_pretrained(out / "export", processor=qwen2vl_processor(out / "export"))
    assert isinstance(pipe, QwenImageEditPipeline)
    base = QwenImageEditPipeline.from_pretrained(pretrained, processor=None).transformer.state_dict()
    assert any(not torch.equal(v, pipe.transformer.state_dict()[k].to(v.dtype)) for k, v in base.items())
    source = Image.open(REPO / "data/demo/edits/edit_000.src.png")
    image = pipe(image=source, prompt="make the circle orange", height=64, width=64, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)


@pytest.mark.slow
@pytest.mark.heavy  # on the demo run's cache (make test-all); tests/test_trainer_loader.py checks the rule itself
def test_a_cache_of_the_other_qwen_family_is_refused_in_one_line(demo_run, tmp_path, capsys):
    from latentmill.tiny_qwen_image import build_tiny_qwen_image

    _, out, _ = demo_run
    qwen = build_tiny_qwen_image(tmp_path / "tiny-qwen-image")
    assert main(["train", str(REPO / "configs/demo-qwen-image.yaml"), f"output_dir={out}",
                 f"model.pretrained={qwen}", "trainer.max_steps=1"]) == 2
    # latentmill's own line (Prefect logs the task's failure above it)
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("latentmill:")]
    assert err.startswith("latentmill: error: the latent cache was made for the 'qwen-image-edit' family, the "
                          "recipe's model") and "is 'qwen-image': run `latentmill prep` with this recipe" in err


def test_an_edit_recipe_without_pairs_fails_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    demo = REPO / "configs/demo-qwen-image-edit.yaml"
    assert main(["prep", str(demo), f"output_dir={out}", f"ingest.source={REPO / 'data/demo/images'}"]) == 2
    assert main(["prep", str(demo), f"output_dir={out}", "ingest.edit=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("latentmill: error: ingest.edit: ") and "holds no edit pairs" in err[0]
    assert err[1] == ("latentmill: error: ingest.edit: the qwen-image-edit family trains on edit pairs; set "
                      "ingest.edit: true over a source of pairs (docs/prep.md, \"Edit datasets\")")
    assert not out.exists()



def test_validation_during_training_is_refused_before_any_work(tmp_path, capsys):
    # the Edit pipeline samples from a source image, which trainer.validation_prompts do not give
    out = tmp_path / "never"
    demo = REPO / "configs/demo-qwen-image-edit.yaml"
    assert main(["run", str(demo), f"output_dir={out}", "trainer.validate_every=5",
                 "trainer.validation_prompts=[make it red]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["latentmill: error: trainer.validate_every: 5, but the qwen-image-edit family samples from a "
                   "source image, which validation prompts do not give; set trainer.validate_every: 0 (sample the "
                   "export with its pipeline and an image instead)"]
    assert not out.exists()

def test_init_copies_the_recipes_the_tiny_recipe_and_the_demo_pairs(tmp_path):
    from latentmill.resources import init_folder

    copied = {str(p.relative_to(tmp_path)) for p in init_folder(tmp_path)}
    assert {"configs/demo-qwen-image-edit.yaml", "configs/qwen-image-edit-lora.yaml",
            "configs/qwen-image-edit-full.yaml", "data/tiny-qwen-image-edit.yaml",
            "data/demo/edits/edit_000.src.png", "data/demo/edits/edit_011.txt"} <= copied
