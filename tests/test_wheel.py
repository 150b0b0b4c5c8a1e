"""The wheel: one import namespace (``latentmill``) that sits beside PyPI's ``trainer``, with the demo inside.

Built from this checkout, installed with ``--no-deps`` into a fresh folder next to the PyPI package
``trainer`` (Coqui's, also ``--no-deps``); the project's dependencies come from the test's own environment.
From an empty folder, with no checkout on the path, the console script runs the demo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-all


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"], check=True,
                   capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(REPO))
    [wheel] = (root / "dist").glob("latentmill-*.whl")
    target = root / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel))
    # PyPI's trainer (Coqui), and coqpit, the one dependency of it the environment lacks
    _pip("install", "--no-deps", "--target", str(target), "trainer", "coqpit")
    return wheel, target


def test_the_wheel_holds_only_the_latentmill_namespace(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"latentmill"}
    for shipped in ("latentmill/stages/pixels.py", "latentmill/trainer/train.py", "latentmill/pipelines/flows.py",
                    "latentmill/pipelines/prefect.yaml", "latentmill/configs/demo.yaml",
                    "latentmill/data/tiny-flux.yaml", "latentmill/data/demo/images/img_000.png",
                    "latentmill/data/demo/videos/cut_64x48_12fps.mp4"):
        assert shipped in names, shipped
    assert not [n for n in names if n.startswith("latentmill/data/models/")]  # built tiny models stay out


def _env(target: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PREFECT_LOGGING_LEVEL", "LATENTMILL_MODELS", "LATENTMILL_VOLUME")}
    env["PYTHONPATH"] = str(target)  # before the environment's site-packages: the wheel's latentmill wins
    env["XDG_CACHE_HOME"] = str(target.parent / "cache")  # the tiny models an installed package builds
    return env


def test_both_trainers_import_side_by_side(installed, tmp_path):
    _, target = installed
    code = ("import json, latentmill, latentmill.trainer, trainer\n"
            "print(json.dumps([latentmill.__file__, latentmill.trainer.__file__, trainer.__file__,"
            " hasattr(trainer, 'Trainer')]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(target), capture_output=True,
                         text=True, check=True).stdout
    ours, ours_trainer, theirs, theirs_has_trainer = json.loads(out)
    assert ours.startswith(str(target / "latentmill")) and ours_trainer.startswith(str(target / "latentmill"))
    assert theirs.startswith(str(target / "trainer")) and theirs_has_trainer
    for name in ("stages", "pipelines"):
        assert not (target / name).exists()


def test_the_console_script_runs_the_demo_from_an_empty_folder(installed, tmp_path):
    _, target = installed
    work = tmp_path / "anywhere"
    work.mkdir()
    done = subprocess.run([str(target / "bin" / "latentmill"), "demo", "trainer.max_steps=2",
                           "--summary-json", "summary.json"], cwd=work, env=_env(target), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["stages"]["cache"]["out"] == 24 and summary["train"]["steps"] == 2
    assert summary["train"]["export_dir"] == str(Path("outputs/demo/export"))
    assert (work / "outputs" / "demo" / "export" / "model_index.json").is_file()
    assert (work / "outputs" / "demo" / "sample.png").is_file()
    assert (target.parent / "cache" / "latentmill" / "models" / "tiny-flux" / "model_index.json").is_file()
    assert not (target / "latentmill" / "data" / "models").exists()  # never inside the installed package
    # and `init` gives a user the recipes to start from
    assert subprocess.run([str(target / "bin" / "latentmill"), "init", "mine"], cwd=work, env=_env(target),
                          capture_output=True, text=True, check=True).returncode == 0
    assert (work / "mine" / "configs" / "demo.yaml").is_file() and (work / "mine" / "data" / "demo" / "images").is_dir()
    assert (work / "mine" / "recipe.yaml").is_file()


@pytest.mark.served
def test_a_wheel_install_serves_and_runs_the_demo_deployment_without_a_checkout(installed, tmp_path):
    import socket

    import psutil

    _, target = installed
    work = tmp_path / "served"
    work.mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env(target)
    cli = [str(target / "bin" / "latentmill"), "serve"]
    started = subprocess.run([*cli, "start", "--port", str(port), "--home", "home"], cwd=work, env=env,
                             capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        prefect = Path(sys.executable).parent / "prefect"
        run = subprocess.run([str(prefect), "deployment", "run", "prep-then-train/demo", "--params",
                              json.dumps({"overrides": ["trainer.max_steps=2"]}), "--watch", "--watch-timeout", "400"],
                             cwd=tmp_path, env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
                             capture_output=True, text=True, timeout=480)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
        # the flow run worked in the folder `serve start` ran from, on the data shipped in the wheel
        assert (work / "outputs" / "demo" / "export" / "model_index.json").is_file()
        worker = [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get(
            "LATENTMILL_SERVE_HOME", "").startswith(str(work))]
        assert worker  # the server and worker carry their home; none runs from the checkout
    finally:
        stopped = subprocess.run([*cli, "stop", "--home", "home"], cwd=work, env=env, capture_output=True,
                                 text=True, timeout=120)
    assert stopped.returncode == 0 and "server (PID" in stopped.stdout
