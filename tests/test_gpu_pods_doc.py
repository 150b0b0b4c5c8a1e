"""docs/gpu-pods.md cannot rot: every command in it runs here or in `make gpu-check`'s plan.

The doc's fenced ``bash`` blocks are read line by line. Unmarked commands run here on the CPU, in one shell
from the repository root, with ``LATENTMILL_VOLUME`` pointing at a temporary folder (``/workspace`` in the
doc is replaced by it) and none of the variables the volume sets; the test then checks where the files
landed. Commands marked ``# gpu-check`` must be in ``bench.gpu_check.DOC_COMMANDS`` with a phase the check
runs; those marked ``# pod-setup`` (downloads) are checked for their form only.

The one stand-in: the doc samples from the demo's export (``make demo`` on the GPU makes it); here that
folder is the tiny Flux pipeline built from config, the same kind of Diffusers pipeline folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

pytestmark = pytest.mark.slow  # doctor, a plan on the meta device and a CPU sample (~30 s on 2 cores)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu-pods.md"
GPU, SETUP = "# gpu-check", "# pod-setup"


def doc_commands() -> list[tuple[str, str]]:
    """(command, mark) of every line of the doc's ``bash`` blocks; mark is ``gpu``, ``setup`` or ``run``."""
    commands, inside = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash" if not inside else False
            continue
        if inside and line.strip():
            for marker, mark in ((GPU, "gpu"), (SETUP, "setup")):
                if line.rstrip().endswith(marker):
                    commands.append((line.rstrip()[: -len(marker)].rstrip(), mark))
                    break
            else:
                assert "#" not in line, f"unknown marker in {line!r}"
                commands.append((line.strip(), "run"))
    return commands


def test_every_gpu_only_command_is_in_the_gpu_check_plan():
    gpu = [c for c, mark in doc_commands() if mark == "gpu"]
    assert len(gpu) == 6  # nvidia-smi, doctor --device cuda, make demo, sample twice, make gpu-check
    assert set(gpu) == set(gpu_check.DOC_COMMANDS), set(gpu) ^ set(gpu_check.DOC_COMMANDS)
    for command in gpu:
        assert gpu_check.DOC_COMMANDS[command] in (*gpu_check.PHASES, "all"), command
    # the sample phase runs the doc's options (its export, sizes and device in place of the doc's values)
    for command in gpu:
        if command.startswith("latentmill sample"):
            options = {a for a in shlex.split(command) if a.startswith("--")}
            assert options <= {"--prompt", "--batch", "--steps", "--size", "--repeat", "--device",
                               "--max-sequence-length", "--compile", "--out"}, options
            size = gpu_check.SIZES["full"]
            assert f"--batch {size['batch']} --steps {size['denoise']} --size {size['image']}x{size['image']} " \
                   f"--repeat {size['repeat']}" in command


def test_pod_setup_commands_name_the_pinned_torch_and_a_cuda_index():
    setup = [c for c, mark in doc_commands() if mark == "setup"]
    pins = re.search(r"TORCH_SPEC \?= (torch==\S+)", (REPO / "Makefile").read_text()).group(1)
    (install,) = [c for c in setup if "pip install" in c]
    assert pins in install  # the same torch version `make` pins for the CPU
    assert re.search(r"--index-url https://download\.pytorch\.org/whl/cu1\d\d\b", install)
    assert any(c.startswith("cd /workspace") for c in setup)  # the repository on the volume


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The doc's CPU commands in one shell: (volume, [(command, exit status, output)])."""
    root = tmp_path_factory.mktemp("pod")
    volume = root / "workspace"
    from latentmill.tiny import build_tiny_flux

    build_tiny_flux(volume / "outputs" / "demo" / "export", seed=0)  # stands in for the demo's export
    commands = [c.replace("/workspace", str(volume)) for c, mark in doc_commands() if mark == "run"]
    script, out_dir = [], root / "out"
    out_dir.mkdir()
    for i, command in enumerate(commands):
        script.append(f"{command} > {out_dir}/{i}.txt 2>&1; echo $? > {out_dir}/{i}.rc")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HOME", "PREFECT_HOME", "LATENTMILL_HASH_STORE", "LATENTMILL_VOLUME", "VIRTUAL_ENV",
                        "PREFECT_API_URL")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    with open(root / "stderr.txt", "w") as err:
        subprocess.run(["bash", "-c", "\n".join(script)], cwd=REPO, env=env, stdout=err, stderr=err, timeout=600)
    results = [(c, int((out_dir / f"{i}.rc").read_text()), (out_dir / f"{i}.txt").read_text())
               for i, c in enumerate(commands)]
    return volume, results


@pytest.mark.heavy  # runs the page's commands (doctor, plan, sample), each tested in make test on its own
def test_cpu_commands_run(ran):
    volume, results = ran
    assert [" ".join(c.split()[:2]) for c, _, _ in results] == [
        "source .venv/bin/activate", "python -c", "export LATENTMILL_VOLUME=" + str(volume), "latentmill doctor",
        "latentmill sample", "latentmill plan"]
    for command, code, output in results:
        allowed = (0, 2) if command.startswith("latentmill doctor") else (0,)  # 2: warnings only (a small disk)
        assert code in allowed, f"{command} exited {code}:\n{output[-2000:]}"
    python = next(o for c, _, o in results if c.startswith("python -c"))
    assert python.split()[0].startswith("2.") and python.split()[-1] in ("True", "False")


@pytest.mark.heavy  # the page's commands run above
def test_files_land_on_the_volume(ran):
    volume, results = ran
    report = json.loads((volume / "doctor.json").read_text())
    (check,) = [c for c in report["checks"] if c["name"] == "volume"]
    assert check["status"] == "ok" and check["details"]["volume"] == str(volume)
    assert check["details"]["source"] == "env"
    assert check["details"]["places"] == {
        "HF_HOME": str(volume / "hf"),
        "weight-hash store": str(volume / "latentmill" / "weight-hashes.sqlite"),
        "PREFECT_HOME": str(volume / "prefect"),
        "output_dir": str(volume / "outputs" / "demo"),  # the demo recipe's relative output_dir
    }
    (hf,) = [c for c in report["checks"] if c["name"] == "volume hf cache"]
    assert hf["status"] == "ok" and hf["details"]["path"] == str(volume / "hf" / "hub")
    timing = json.loads((volume / "samples" / "cpu" / "timing.json").read_text())
    assert (timing["device"], timing["repeats"], timing["steps"], timing["size"]) == ("cpu", 2, 2, [64, 64])
    assert timing["first_call_s"] > 0 and timing["median_s"] > 0 and len(timing["images"]) == 3
    assert (volume / "samples" / "cpu" / "grid.png").is_file() or any((volume / "samples" / "cpu").glob("*grid*"))
    plan = json.loads((volume / "plan-1gpu.json").read_text())
    assert plan and isinstance(plan, dict)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_honours_the_volume(tmp_path):
    volume = tmp_path / "workspace"
    env = {**os.environ, "LATENTMILL_VOLUME": str(volume)}
    env.pop("PREFECT_HOME", None)
    plan = subprocess.run(["make", "-n", "demo", "serve", f"VENV={tmp_path / 'venv'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True).stdout
    assert f"latentmill demo --summary-json {volume}/outputs/demo/summary.json" in plan
    assert f"serve start --home {volume}/prefect" in plan
    env["PREFECT_HOME"] = str(tmp_path / "mine")  # an explicit Prefect home wins
    plan = subprocess.run(["make", "-n", "serve", f"VENV={tmp_path / 'venv'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True).stdout
    assert f"serve start --home {tmp_path / 'mine'}" in plan
    env.pop("LATENTMILL_VOLUME")
    plan = subprocess.run(["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True).stdout
    assert "latentmill demo --summary-json outputs/demo/summary.json" in plan  # no volume: as before


def test_recipe_key_and_env_place_the_output_dir_and_are_validated(tmp_path, monkeypatch):
    from latentmill.core.config import ConfigError
    from latentmill.recipe import load_recipe
    from latentmill.volume import apply_volume

    monkeypatch.delenv("LATENTMILL_VOLUME", raising=False)
    assert load_recipe("demo").output_dir == "outputs/demo"  # no volume: unchanged
    monkeypatch.setenv("LATENTMILL_VOLUME", str(tmp_path / "env-vol"))
    assert load_recipe("demo").output_dir == str(tmp_path / "env-vol" / "outputs" / "demo")
    recipe = load_recipe("demo", [f"volume={tmp_path / 'key-vol'}"])  # the recipe key wins over the variable
    assert recipe.output_dir == str(tmp_path / "key-vol" / "outputs" / "demo")
    assert load_recipe("demo", [f"output_dir={tmp_path / 'abs'}"]).output_dir == str(tmp_path / "abs")
    with pytest.raises(ConfigError, match="^volume: must be an absolute path"):
        load_recipe("demo", ["volume=relative/dir"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="^volume: .* is not a folder"):
        load_recipe("demo", [f"volume={tmp_path / 'file'}"])
    env = {"LATENTMILL_VOLUME": str(tmp_path / "v"), "HF_HOME": "/mine/hf"}
    layout = apply_volume(None, env)
    assert env["HF_HOME"] == "/mine/hf" and layout.kept == {"HF_HOME": "/mine/hf"}  # explicit wins
    assert env["PREFECT_HOME"] == str(tmp_path / "v" / "prefect")
    assert env["LATENTMILL_HASH_STORE"] == str(tmp_path / "v" / "latentmill" / "weight-hashes.sqlite")


def test_cli_refuses_a_bad_volume_naming_the_variable(tmp_path):
    env = {**os.environ, "LATENTMILL_VOLUME": "relative", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "latentmill.cli", "doctor"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "LATENTMILL_VOLUME: must be an absolute path" in done.stderr
