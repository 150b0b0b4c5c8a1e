"""End to end on the embedded default: `latentmill run` (prep-then-train), then the export generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from latentmill.cli import main
from tests.conftest import DEMO_CONFIG, DEMO_IMAGES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tiny_flux, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-run")
    summary_path = out / "summary.json"
    args = ["run", str(DEMO_CONFIG), f"output_dir={out}", f"model.pretrained={tiny_flux}",
            f"ingest.source={DEMO_IMAGES}", "trainer.max_steps=8", "trainer.save_every=4",
            "--summary-json", str(summary_path)]
    assert main(args) == 0
    return out, json.loads(summary_path.read_text()), args


def test_summary_counts_conserve(demo_run):
    _, summary, _ = demo_run
    stages = summary["stages"]
    assert list(stages) == ["ingest", "caption", "curate", "bucket", "cache"]
    assert (stages["ingest"]["in"], stages["ingest"]["out"], stages["ingest"]["quarantined"]) == (28, 27, 1)
    # the demo recipe's curate.max_exposure drops the two over-exposed pictures, with their scores, and
    # truncated.jpg, which curate is the first stage to decode, goes with its decode error
    assert (stages["curate"]["in"], stages["curate"]["out"], stages["curate"]["quarantined"]) == (27, 24, 3)
    reasons = stages["curate"]["quarantined_by_reason"]
    assert reasons.pop("exposure beyond curate.max_exposure=0.5") == 2
    ((reason, count),) = reasons.items()
    assert reason.startswith("cannot decode pixels: OSError: image file is truncated") and count == 1
    assert (stages["curate"]["scored"], stages["curate"]["unscored"]) == (26, 1) and stages["curate"]["scores_table"]
    assert (stages["cache"]["in"], stages["cache"]["out"], stages["cache"]["quarantined"]) == (24, 24, 0)
    for s in stages.values():
        assert s["in"] == s["out"] + s["quarantined"] == s["processed"] + s["reused"]
        assert s["seconds"] >= 0
    assert stages["cache"]["components"] == {"vae": {"processed": 24, "reused": 0},
                                             "text": {"processed": 24, "reused": 0}}
    assert sum(stages["bucket"]["buckets"].values()) == 24
    train = summary["train"]
    assert train["steps"] == 8
    assert train["final_loss"] > 0 and train["samples_per_s"] > 0 and train["peak_rss_mb"] > 0
    assert 0 <= train["data_wait_fraction"] < 1


def test_outputs_on_disk(demo_run):
    out, summary, _ = demo_run
    metrics = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert metrics[-1]["loss"] == pytest.approx(summary["train"]["final_loss"])
    run = out / "train" / "runs" / (out / "train" / "LATEST").read_text().strip()
    assert summary["train"]["run_dir"] == str(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    assert (out / "train" / "metrics.jsonl").resolve() == (run / "metrics.jsonl").resolve()
    assert (out / "export").resolve() == (run / "export").resolve()
    for stage in ("ingest", "caption", "curate", "bucket", "cache"):
        assert (out / "prep" / stage / "manifest.json").is_file()
    assert (out / "prep" / "scores.parquet").is_file()


def test_every_model_traces_back_to_its_snapshot(demo_run):
    out, summary, _ = demo_run
    snapshot = (out / "snapshots" / "LATEST").read_text().strip()
    assert summary["train"]["snapshot"] == snapshot == summary["snapshot"]["name"]
    run = Path(summary["train"]["run_dir"])
    state = json.loads((run / "checkpoints" / "step-000008" / "trainer_state.json").read_text())
    assert state["provenance"]["snapshot"] == snapshot
    info = json.loads((out / "export" / "latentmill.json").read_text())
    assert (info["snapshot"], info["steps"], info["mode"]) == (snapshot, 8, "full")
    assert info["final_loss"] == pytest.approx(summary["train"]["final_loss"])
    assert (out / "export" / "model_index.json").is_file()
    # the model card: the snapshot and what its prep did (sidecar captions, the demo's exposure threshold)
    manifest = json.loads((out / "snapshots" / snapshot / "manifest.json").read_text())["snapshot"]
    assert manifest["prep"]["stages"]["ingest"] == {"in": 28, "out": 27, "quarantined": 1}
    # held out by default: 2% of 24 raised to the minimum of 8, cut to a quarter (6); training reads the other 18
    assert manifest["eval"] == {"fraction": 0.02, "min_count": 8, "samples": 6}
    card = (out / "export" / "README.md").read_text()
    for expected in (f"dataset snapshot | {snapshot}", "| samples | 24 (6 held out for evaluation, never trained on) |",
                     "| captioner | sidecar |",
                     "| steps | 8 |", "| training | full fine-tune |", "| ingest | 28 | 27 | 1 |",
                     "| curation thresholds | max_exposure 0.5 |"):
        assert expected in card, expected
    assert str(out) not in card and info["pretrained"] not in card  # local paths: the last name only


def test_checkpoints_and_exports_are_written_with_the_usual_modes(demo_run):
    import os
    import stat

    out, summary, _ = demo_run
    umask = os.umask(0)
    os.umask(umask)
    run = Path(summary["train"]["run_dir"])
    files = [*(run / "checkpoints" / "step-000008").iterdir(), *(out / "export").resolve().rglob("*.safetensors")]
    assert any(f.suffix == ".safetensors" for f in files)
    for path in files:  # safetensors writes 0600; a shared cluster's readers need the umask's modes
        assert stat.S_IMODE(path.stat().st_mode) == (0o777 if path.is_dir() else 0o666) & ~umask, path


def test_the_same_recipe_on_the_same_snapshot_is_not_trained_again(demo_run, capsys):
    out, first, args = demo_run
    runs = sorted(p.name for p in (out / "train" / "runs").iterdir())
    metrics = (out / "train" / "metrics.jsonl").read_text()
    summary_path = out / "again.json"
    again = [*args[: args.index("--summary-json")], "--summary-json", str(summary_path)]
    assert main(again) == 0
    train = json.loads(summary_path.read_text())["train"]
    assert train["already_trained"] is True and train["steps"] == 8
    assert train["final_loss"] == first["train"]["final_loss"]
    assert "nothing redone" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "train" / "runs").iterdir()) == runs
    assert (out / "train" / "metrics.jsonl").read_text() == metrics


def test_export_loads_and_generates_requested_size(demo_run):
    from diffusers import DiffusionPipeline, FluxPipeline

    out, _, _ = demo_run
    pipe = DiffusionPipeline.from_pretrained(out / "export")
    assert isinstance(pipe, FluxPipeline)
    image = pipe("a red circle on a blue background", height=96, width=64, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0), max_sequence_length=32).images[0]
    assert image.size == (64, 96)


def test_rerun_reuses_everything_and_resume_continues(demo_run):
    out, first, args = demo_run
    rerun = [a if not a.startswith("trainer.max_steps") else "trainer.max_steps=10" for a in args]
    rerun += ["trainer.resume=latest"]
    summary_path = out / "summary2.json"
    rerun[rerun.index("--summary-json") + 1] = str(summary_path)
    assert main(rerun) == 0
    summary = json.loads(summary_path.read_text())
    for name, s in summary["stages"].items():
        assert s["processed"] == 0 and s["reused"] == first["stages"][name]["in"], name
    assert summary["stages"]["cache"]["components"]["vae"] == {"processed": 0, "reused": 24}
    steps = [json.loads(line)["step"] for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [9, 10]
    assert summary["train"]["steps"] == 10


def test_bad_config_fails_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["run", str(DEMO_CONFIG), f"output_dir={out}", "trainer.mode=ful"]) == 2
    assert "trainer.mode: 'ful' is not one of 'full', 'lora'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.heavy  # make test launches torchrun from the CLI in test_interrupt.py and test_trainer_fsdp.py
def test_nproc_launches_torchrun_ddp(demo_run, tmp_path):
    out, _, args = demo_run
    base = [a for a in args if not a.startswith(("trainer.", "--summary-json")) and a != str(out / "summary.json")]
    base[0] = "train"
    summary_path = tmp_path / "ddp.json"
    assert main([*base, "trainer.max_steps=4", "trainer.save_every=2", "trainer.batch_size=2",
                 "parallel.strategy=ddp", "--nproc", "2", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())["train"]
    assert summary["world_size"] == 2 and summary["steps"] == 4
    steps = [json.loads(line)["step"] for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (out / "export" / "model_index.json").is_file()


def test_nproc_without_ddp_fails_before_training(demo_run, capsys):
    out, _, args = demo_run
    before = (out / "train" / "metrics.jsonl").read_text()
    assert main(["train", *args[1:5], "--nproc", "2"]) == 2
    assert "2 processes need parallel.strategy 'ddp' or 'fsdp2'" in capsys.readouterr().err
    assert (out / "train" / "metrics.jsonl").read_text() == before


def test_demo_command_runs_the_embedded_default_and_samples(tiny_flux, tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.chdir(tmp_path)  # `demo` moves to the repository root itself; undone after the test
    out = tmp_path / "demo"
    summary_path = tmp_path / "demo.json"
    assert main(["demo", f"output_dir={out}", f"model.pretrained={tiny_flux}", "trainer.max_steps=3",
                 "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["stages"]["cache"]["out"] == 24 and summary["train"]["steps"] == 3
    with Image.open(summary["sample"]) as image:
        assert image.size == (128, 128)
    assert summary["sample"] == str(out / "sample.png")


def test_lora_and_full_exports_never_overwrite_each_other(demo_run, tmp_path):
    out, _, args = demo_run
    full_export = (out / "export").resolve()
    base = [a for a in args if not a.startswith(("trainer.", "--summary-json")) and a != str(out / "summary.json")]
    summary_path = tmp_path / "lora.json"
    assert main(["train", *base[1:], "trainer.mode=lora", "trainer.max_steps=2", "trainer.save_every=0",
                 "--summary-json", str(summary_path)]) == 0
    lora = json.loads(summary_path.read_text())["train"]
    assert lora["export_dir"] == str(out / "export-lora")
    assert (out / "export").resolve() == full_export and (full_export / "model_index.json").is_file()
    assert not (out / "export-lora" / "model_index.json").exists()
    assert list((out / "export-lora").glob("*.safetensors"))
    info = json.loads((out / "export-lora" / "latentmill.json").read_text())
    assert info["mode"] == "lora" and info["snapshot"] == lora["snapshot"]
    assert Path(lora["run_dir"]) != full_export.parent


def test_a_prep_whose_inputs_all_fail_publishes_no_snapshot(tiny_flux, tmp_path, capsys):
    src = tmp_path / "bad"
    src.mkdir()
    (src / "a.jpg").write_bytes(b"not an image")
    (src / "b.png").write_bytes(b"")
    out = tmp_path / "out"
    assert main(["prep", str(DEMO_CONFIG), f"output_dir={out}", f"model.pretrained={tiny_flux}",
                 f"ingest.source={src}"]) == 2
    err = capsys.readouterr().err
    assert "latentmill: error: every input ended in quarantine (ingest: 1× empty file, 1× not a readable image)" in err
    assert f"latentmill inspect {out}" in err
    assert not (out / "snapshots" / "LATEST").exists()


def test_the_python_api_runs_a_recipe_as_the_readme_shows(tiny_flux, tmp_path, monkeypatch):
    import re

    readme = (DEMO_CONFIG.parents[1] / "README.md").read_text()
    snippet = re.search(r"```python\n(from latentmill.api import run\n.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(DEMO_CONFIG.parents[1])
    namespace: dict = {}
    # The README's snippet, on this test's output folder and tiny models.
    snippet = snippet.replace('["trainer.max_steps=50"]', f'["trainer.max_steps=2", "output_dir={tmp_path}", '
                              f'"model.pretrained={tiny_flux}"]')
    exec(compile(snippet, "README.md", "exec"), namespace)
    summary = namespace["summary"]
    assert summary["train"]["steps"] == 2 and summary["stages"]["cache"]["out"] == 24
    assert summary["train"]["export_dir"] == str(tmp_path / "export")
    assert (tmp_path / "export" / "model_index.json").is_file()


# make test runs launch.sh's node step (the training lock, the plan, a Ctrl-C to the ranks) in test_writer_lock.py
# and torchrun launches from the CLI in test_interrupt.py and test_trainer_fsdp.py
@pytest.mark.heavy
def test_the_cluster_launch_script_plans_finishes_and_does_not_redo_a_run(demo_run, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    out, _, args = demo_run
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHON": sys.executable, "LATENTMILL_LAUNCH_DIR": str(tmp_path), "NPROC_PER_NODE": "2",
           "NNODES": "1", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": "launch-test"}
    overrides = [a for a in args[2:] if not a.startswith(("trainer.", "--summary-json")) and a != str(out / "summary.json")]
    command = ["bash", "deploy/launch.sh", str(DEMO_CONFIG), *overrides, "parallel.strategy=ddp",
               "trainer.max_steps=2", "trainer.batch_size=2", "trainer.save_every=0"]
    repo = DEMO_CONFIG.parents[1]
    first = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    run = Path(summary["run_dir"])
    assert json.loads((run / "run.json").read_text())["finished"] is True
    assert summary["export_dir"] == str(out / "export") and (out / "export").resolve() == (run / "export").resolve()
    again = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "train: already trained on snapshot " in again.stdout
    assert "torchrun" not in again.stderr
