"""What a newcomer meets first (issue 30): the demo recipe with a real model, an empty input folder, the CLI's
help, version, pipes and `inspect`, where the tiny models are built, `init`'s starter recipe, and how fast a
recipe error comes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from latentmill.core.config import ConfigError
from latentmill.preflight import check_recipe, tiny_build_target
from latentmill.recipe import load_recipe
from tests.conftest import REPO_ROOT


def _cli(*args: str, cwd: Path = REPO_ROOT, env: dict[str, str] | None = None,
         **kwargs) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("LATENTMILL_MODELS", "LATENTMILL_VOLUME")},
           "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    env.pop("PREFECT_LOGGING_LEVEL", None)  # as in a user's shell: the CLI chooses it (conftest sets one)
    return subprocess.run([sys.executable, "-m", "latentmill.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, **kwargs)


def _error(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a CLI that failed on its input (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("latentmill: error: "), proc.stderr
    return lines[0].removeprefix("latentmill: error: ")


# --------------------------------------------------------------------------------------------------------
# Item 3: the demo recipe with a hub id or an existing folder takes the normal from_pretrained path


def test_the_demo_recipe_takes_a_hub_id(tmp_path):
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'o'}", "model.pretrained=black-forest-labs/FLUX.1-dev"])
    check_recipe(recipe, "prep")  # raised "does not exist; ... or to a hub id" before
    assert tiny_build_target(recipe.model) is None  # nothing is built: from_pretrained gets the hub id


def test_the_demo_recipe_takes_an_existing_pipeline_folder(tmp_path):
    folder = tmp_path / "my-pipeline"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'o'}", f"model.pretrained={folder}"])
    check_recipe(recipe, "prep")
    assert tiny_build_target(recipe.model) is None


def test_the_tiny_recipe_builds_only_into_its_own_folder():
    recipe = load_recipe("demo")
    assert tiny_build_target(recipe.model) == Path(recipe.model.pretrained)


def test_a_hub_id_in_the_demo_recipe_builds_nothing(tmp_path, monkeypatch):
    from latentmill.pipelines.prep import ensure_models

    recipe = load_recipe("demo", ["model.pretrained=black-forest-labs/FLUX.1-dev"])
    monkeypatch.chdir(tmp_path)
    ensure_models(recipe)  # built random tiny weights into ./black-forest-labs/FLUX.1-dev before
    assert list(tmp_path.iterdir()) == []


def test_a_folder_of_images_is_not_a_pipeline(tmp_path):
    images = tmp_path / "photos"
    images.mkdir()
    (images / "a.jpg").write_bytes(b"")
    message = _error(_cli("prep", "demo", f"output_dir={tmp_path / 'o'}", f"model.pretrained={images}"))
    assert message.startswith(f"model.pretrained: {images} is not a Diffusers pipeline folder (no "
                              "model_index.json)")
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------------
# Item 9: an input folder without media fails before any work, naming the folder and what it skipped


def test_an_empty_input_folder_fails_at_once(tmp_path):
    empty = tmp_path / "in"
    empty.mkdir()
    message = _error(_cli("prep", "demo", f"output_dir={tmp_path / 'o'}", f"ingest.source={empty}"))
    assert message == f"ingest.source: no images or videos in {empty} (the folder is empty)"
    assert not (tmp_path / "o").exists()


def test_an_input_folder_without_media_names_what_it_skipped(tmp_path):
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.pdf", "sub/c.json", "sub/d.md"):
        (folder / name).write_text("x")
    (folder / ".hidden.jpg").write_text("x")  # hidden: ingest skips it too
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'o'}", f"ingest.source={folder}"])
    with pytest.raises(ConfigError) as err:
        check_recipe(recipe, "prep")
    assert str(err.value) == (f"ingest.source: no images or videos in {folder} (skipped 4 files: a.txt, b.pdf, "
                              "sub/c.json, ... (1 more); the types accepted are ingest.extensions)")
    (folder / "sub" / "e.PNG").write_bytes(b"")  # one image is enough (ingest judges its bytes)
    check_recipe(recipe, "prep")


# --------------------------------------------------------------------------------------------------------
# Item 11: --version, a help that lists every command in plain text, a closed pipe, `inspect` as `run`


def test_version():
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.strip() == f"latentmill {_version()}"


def _version() -> str:
    import re

    return re.search(r'^version = "([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_the_help_lists_every_command_in_plain_text():
    import re

    from latentmill.cli import _parser

    commands = list(_parser()._subparsers._group_actions[0].choices)
    assert len(commands) == 17
    proc = _cli("--help")
    assert proc.returncode == 0
    listed = re.findall(r"^    (\S+)", proc.stdout, re.M)  # deeper lines continue a command's help
    assert listed == commands
    assert "``" not in proc.stdout and "`" not in proc.stdout


def test_a_closed_stdout_ends_quietly():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "latentmill.cli", "inspect", "demo"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # as `| head -3` once it has its lines: every write of the command fails
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 1
    assert stderr == ""  # was: Exception ignored ... BrokenPipeError


def test_inspect_takes_shipped_recipe_names_and_overrides():
    proc = _cli("inspect", "demo", "trainer.max_steps=7", "seed=3")
    assert proc.returncode == 0, proc.stderr
    assert "\n  max_steps: 7\n" in proc.stdout and "\nseed: 3\n" in proc.stdout
    assert f"pretrained: {REPO_ROOT / 'data' / 'models' / 'tiny-flux'}\n" in proc.stdout


def test_inspect_refuses_overrides_of_an_output_dir(tmp_path):
    assert _error(_cli("inspect", str(tmp_path), "seed=3")) == (
        f"seed=3: overrides apply to a recipe; {tmp_path} is not one")


# --------------------------------------------------------------------------------------------------------
# Item 12: an installed package is never written into; its tiny models build in the user's cache folder


def test_shipped_tiny_models_follow_latentmill_models(tmp_path, monkeypatch):
    from latentmill.volume import apply_volume

    monkeypatch.setenv("LATENTMILL_MODELS", str(tmp_path / "models"))
    recipe = load_recipe("demo")
    assert recipe.model.pretrained == str(tmp_path / "models" / "tiny-flux")
    assert tiny_build_target(recipe.model) == tmp_path / "models" / "tiny-flux"  # the build goes there too
    env = {"LATENTMILL_VOLUME": str(tmp_path / "v")}
    apply_volume(None, env)  # a pod's volume keeps them across restarts
    assert env["LATENTMILL_MODELS"] == str(tmp_path / "v" / "latentmill" / "models")


def _installed_copy(site: Path) -> Path:
    """The package as a wheel lays it out (pyproject's package-dir), without data/models."""
    import shutil

    package = site / "latentmill"
    shutil.copytree(REPO_ROOT / "latentmill", package, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("stages", "trainer", "pipelines", "configs", "data"):
        shutil.copytree(REPO_ROOT / folder, package / folder,
                        ignore=lambda where, names: [n for n in names if n == "__pycache__"
                                                     or (n == "models" and Path(where).name == "data")])
    return package


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.slow
def test_an_installed_package_builds_the_demo_models_in_the_cache_folder(tmp_path):
    package = _installed_copy(tmp_path / "site")
    before = _files(package)
    script = ("from diffusers import DiffusionPipeline\n"
              "from latentmill.pipelines.prep import ensure_models\n"
              "from latentmill.recipe import load_recipe\n"
              "recipe = load_recipe('demo')\n"
              "ensure_models(recipe)\n"
              "print(recipe.model.pretrained)\n"
              "print(type(DiffusionPipeline.from_pretrained(recipe.model.pretrained)).__name__)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LATENTMILL_MODELS", "LATENTMILL_VOLUME")}
    env.update(PYTHONPATH=str(tmp_path / "site"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONDONTWRITEBYTECODE="1")
    (tmp_path / "run").mkdir()
    for path in [package, *package.rglob("*")]:  # read-only, as a system install (root ignores it: see below)
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "run", env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        for path in [package, *package.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert proc.returncode == 0, proc.stderr
    built = tmp_path / "cache" / "latentmill" / "models" / "tiny-flux"
    tiny_recipe = package / "data" / "tiny-flux.yaml"
    assert proc.stdout.splitlines() == [f"building tiny models from {tiny_recipe} into {built}", str(built),
                                        "FluxPipeline"]
    assert _files(package) == before  # nothing written inside the package, whatever the mode bits allowed


# --------------------------------------------------------------------------------------------------------
# Item 6: `init` writes a starter recipe for the user's own images (not the demo's shard sizes and threshold)


def test_init_writes_a_starter_recipe_for_an_empty_images_folder(tmp_path):
    proc = _cli("init", str(tmp_path / "mine"))
    assert proc.returncode == 0, proc.stderr
    recipe = (tmp_path / "mine" / "recipe.yaml").read_text()
    assert f"  source: {tmp_path / 'mine' / 'images'}   #" in recipe and (tmp_path / "mine" / "images").is_dir()
    assert "\n  # pretrained: black-forest-labs/FLUX.1-dev\n" in recipe
    live = [line for line in recipe.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in live if "shard_bytes" in line or "max_exposure" in line]  # the defaults
    assert (tmp_path / "mine" / "configs" / "demo.yaml").is_file()  # the examples, as before
    assert proc.stdout.splitlines()[-1] == (f"next: latentmill prep {tmp_path / 'mine' / 'recipe.yaml'}  (after "
                                            f"putting images in {tmp_path / 'mine' / 'images'})")
    assert _error(_cli("init", str(tmp_path / "mine"))) == (
        f"{tmp_path / 'mine' / 'recipe.yaml'} exists; remove it or choose another folder (init never overwrites)")


@pytest.mark.slow
def test_init_then_prep_of_a_few_images_makes_one_shard_per_stage(tmp_path, tiny_flux):
    import json
    import shutil

    images = tmp_path / "photos"
    images.mkdir()
    for name in ("img_000.png", "img_001.jpg", "img_002.jpg"):  # the first without a caption
        shutil.copy(REPO_ROOT / "data" / "demo" / "images" / name, images / name)
    shutil.copy(REPO_ROOT / "data" / "demo" / "images" / "img_001.txt", images / "img_001.txt")
    env = {"LATENTMILL_MODELS": str(tiny_flux.parent)}  # the session's tiny models, not a new build
    assert _cli("init", str(tmp_path / "mine"), "--images", str(images), env=env).returncode == 0
    proc = _cli("prep", str(tmp_path / "mine" / "recipe.yaml"), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    prep = tmp_path / "mine" / "outputs" / "prep"
    for stage in ("ingest", "caption", "curate", "bucket", "cache"):
        manifest = json.loads((prep / stage / "manifest.json").read_text())
        assert (stage, len(manifest["shards"]), manifest["counts"]["out"]) == (stage, 1, 3)


# --------------------------------------------------------------------------------------------------------
# Item 10: a recipe loads without torch, diffusers, transformers or Prefect; a config error comes at once


def test_a_recipe_loads_without_the_heavy_libraries():
    code = ("import latentmill.recipe, sys\n"
            "latentmill.recipe.load_recipe('demo', ['trainer.max_steps=5'])\n"
            "print(sorted(m for m in ('torch', 'prefect', 'diffusers', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_an_unknown_key_suggests_the_nearest_one():
    message = _error(_cli("run", "demo", "trainer.max_stepz=3"))
    assert message.startswith("unknown key trainer.max_stepz; did you mean trainer.max_steps? allowed keys under "
                              "trainer: activation_checkpointing, ")


def test_a_config_error_comes_before_torch_and_prefect_load(tmp_path):
    # The recipe fails in the CLI before the flows' imports: nothing of torch or Prefect was loaded.
    code = ("import sys\n"
            "sys.argv = ['latentmill', 'prep', 'demo', 'trainer.max_stepz=3']\n"
            "try:\n"
            "    from latentmill.cli import main\n"
            "    code = main()\n"
            "finally:\n"
            "    print(sorted(m for m in ('torch', 'prefect', 'diffusers', 'transformers') if m in sys.modules))\n"
            "sys.exit(code)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("PREFECT_LOGGING_LEVEL", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 2 and "did you mean trainer.max_steps?" in proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_trainer_package_keeps_its_names():
    code = ("import importlib, sys\n"
            "import latentmill.trainer.config\n"
            "assert 'torch' not in sys.modules\n"
            "importlib.import_module('latentmill.trainer.train')  # the submodule first: `train` stays the function\n"
            "from latentmill.trainer import TrainerConfig, train\n"
            "from latentmill.trainer.config import TrainerConfig as Same\n"
            "import latentmill.trainer as package\n"
            "print(train.__module__, TrainerConfig is Same, package.checkpoint.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["latentmill.trainer.train", "True", "latentmill.trainer.checkpoint"]


def test_inspect_of_a_folder_named_like_a_shipped_recipe_reads_the_folder(tmp_path):
    (tmp_path / "demo").mkdir()  # e.g. an output_dir called demo: not the shipped recipe
    assert _error(_cli("inspect", "demo", cwd=tmp_path)) == "no stage manifest under demo; run `latentmill prep` first"
