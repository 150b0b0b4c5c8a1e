"""Every shipped recipe (configs/*.yaml) loads and validates, and the real-model examples say what they promise."""

from pathlib import Path

import pytest

from latentmill.recipe import load_recipe

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_example_recipes_for_real_models():
    names = {p.name for p in CONFIGS}
    assert {
        "demo.yaml",
        "flux-dev-lora.yaml",
        "flux-dev-full.yaml",
        "wan2.1-1.3b.yaml",
        "wan2.1-14b.yaml",
        "z-image-lora.yaml",
        "z-image-full.yaml",
        "demo-z-image.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.output_dir and recipe.model.pretrained
    recipe.trainer.validate()
    recipe.parallel.validate()


@pytest.mark.parametrize(
    ("name", "pretrained", "family", "mode", "strategy"),
    [
        ("flux-dev-lora.yaml", "black-forest-labs/FLUX.1-dev", "flux", "lora", "fsdp2"),
        ("flux-dev-full.yaml", "black-forest-labs/FLUX.1-dev", "flux", "full", "fsdp2"),
        ("wan2.1-1.3b.yaml", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan", "full", "fsdp2"),
        ("wan2.1-14b.yaml", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan", "full", "fsdp2"),
        ("wan2.2-a14b-lora.yaml", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan", "lora", "fsdp2"),
        ("wan2.2-a14b-full.yaml", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan", "full", "fsdp2"),
        ("z-image-lora.yaml", "Tongyi-MAI/Z-Image-Turbo", "z-image", "lora", "fsdp2"),
        ("z-image-full.yaml", "Tongyi-MAI/Z-Image-Turbo", "z-image", "full", "fsdp2"),
        ("flux2-klein-4b-lora.yaml", "black-forest-labs/FLUX.2-klein-base-4B", "flux2-klein", "lora", "fsdp2"),
        ("flux2-klein-4b-full.yaml", "black-forest-labs/FLUX.2-klein-base-4B", "flux2-klein", "full", "fsdp2"),
        ("flux2-klein-9b-lora.yaml", "black-forest-labs/FLUX.2-klein-base-9B", "flux2-klein", "lora", "fsdp2"),
        ("flux2-klein-9b-full.yaml", "black-forest-labs/FLUX.2-klein-base-9B", "flux2-klein", "full", "fsdp2"),
        ("flux2-dev-lora.yaml", "black-forest-labs/FLUX.2-dev", "flux2", "lora", "fsdp2"),
        ("flux2-dev-full.yaml", "black-forest-labs/FLUX.2-dev", "flux2", "full", "fsdp2"),
    ],
)
def test_real_model_recipes(name, pretrained, family, mode, strategy):
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "configs" / name)
    assert (recipe.model.pretrained, recipe.model.family) == (pretrained, family)
    assert (recipe.trainer.mode, recipe.parallel.strategy) == (mode, strategy)
    assert recipe.trainer.activation_checkpointing and recipe.trainer.resume == "latest"
    if family == "wan":
        assert len(recipe.trainer.validation_size) == 3  # width, height, frames
        assert recipe.bucket.frame_step == 4 and recipe.cache.max_sequence_length == 512
    if family == "z-image":  # the pipeline's static shift, its 512 tokens, the real tokens only
        assert (recipe.trainer.shift_mode, recipe.trainer.shift) == ("fixed", 3.0)
        assert recipe.cache.max_sequence_length == 512 and recipe.cache.trim_text == "auto"
    if family.startswith("flux2"):  # as the pipelines encode and sample: 512 tokens, FLUX.2's own shift
        assert recipe.cache.max_sequence_length == 512 and recipe.trainer.shift_mode == "resolution"
        if mode == "lora":
            from latentmill.trainer.flux2 import LORA_TARGETS

            assert tuple(recipe.trainer.lora_target_modules) == LORA_TARGETS


DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_deploy_files_parse():
    import subprocess

    import yaml

    for script in (DEPLOY / "launch.sh", DEPLOY / "slurm" / "train.sbatch"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    job = yaml.safe_load((DEPLOY / "k8s" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    (container,) = specs["Worker"]["template"]["spec"]["containers"]
    assert "deploy/launch.sh" in " ".join(container["args"])
    config = container["args"][0].split()[1]
    load_recipe(Path(__file__).resolve().parents[1] / config)  # the manifest names a shipped recipe


def test_launch_script_refuses_a_single_process_recipe(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "LATENTMILL_LAUNCH_DIR": str(tmp_path),
        "NPROC_PER_NODE": "1",
    }
    done = subprocess.run(
        ["bash", str(DEPLOY / "launch.sh"), "configs/demo.yaml"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "parallel.strategy is 'none'" in done.stderr
