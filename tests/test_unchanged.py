"""An unchanged ``latentmill prep`` reports the last run's outcome without Prefect, torch or a model
(``pipelines/unchanged.py``); any change it can see runs the prep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from latentmill.pipelines import unchanged

from tests.conftest import REPO_ROOT

# The CLI in a child process that says, at exit, whether it imported Prefect or torch.
_CHILD = """
import json, sys
from latentmill.cli import main
rc = main(sys.argv[2:])
open(sys.argv[1], "w").write(json.dumps({"rc": rc, "prefect": "prefect" in sys.modules,
                                         "torch": "torch" in sys.modules}))
"""


def _prep(recipe: Path, work: Path, tag: str) -> tuple[dict, dict]:
    """``latentmill prep RECIPE`` in a fresh process: its summary and what it imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("PREFECT_LOGGING_LEVEL", None)
    facts, summary = work / f"{tag}.facts", work / f"{tag}.json"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(facts), "prep", str(recipe), "--summary-json",
                           str(summary)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(summary.read_text()), {**json.loads(facts.read_text()), "stdout": done.stdout}


@pytest.mark.slow
def test_an_unchanged_prep_returns_without_prefect_and_a_change_runs_again(tmp_path, tiny_flux, demo_images):
    """The first prep and the preps after a change run in this process (``latentmill.api.prep``, the flow the
    command runs); the unchanged one is the command itself, in a fresh process."""
    import yaml
    from latentmill.pipelines.prep import run_prep

    from latentmill.api import prep
    from latentmill.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "model": {"pretrained": str(tiny_flux)},
                                    "ingest": {"source": str(demo_images)}}))
    recipe = load_recipe(path)
    for file in demo_images.iterdir():  # older than the racy window: the folder's stat signature is kept
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns - 10**10))
    first = prep(recipe)
    assert first["stages"]["cache"]["processed"] == 24 and "unchanged_since" not in first
    last = json.loads((tmp_path / "out" / "prep" / unchanged.LAST_RUN).read_text())
    assert last["source"] == unchanged.source_signature(recipe) and len(last["ingest_units"]) >= 1

    again, facts = _prep(path, tmp_path, "again")
    assert facts["rc"] == 0 and not facts["prefect"] and not facts["torch"]
    assert again["unchanged_since"] and "nothing changed since the prep" in facts["stdout"]
    assert again["snapshot"] == {**first["snapshot"], "new": False}
    for name, counts in again["stages"].items():
        before = first["stages"][name]
        assert (counts["in"], counts["out"], counts["quarantined"]) == (before["in"], before["out"],
                                                                       before["quarantined"])
        assert (counts["processed"], counts["reused"]) == (0, before["in"])
    assert again["stages"]["cache"]["components"]["vae"] == {"processed": 0, "reused": 24}
    assert again["stages"]["curate"]["scored"] == 0

    snapshot = Path(first["snapshot"]["path"])
    shard = snapshot / json.loads((snapshot / "manifest.json").read_text())["shards"][0]["path"]
    shard.rename(shard.with_name("gone"))  # a shard deleted by hand: the prep runs and writes it again
    summary, signature = unchanged.check(recipe)  # what the command checks before it starts Prefect
    assert summary is None and signature == unchanged.source_signature(recipe)
    rewritten = run_prep(recipe, source="taken-by-the-check")  # the command's prep records its check's signature
    assert shard.is_file() and rewritten["stages"]["cache"]["processed"] > 0
    assert json.loads((tmp_path / "out" / "prep" / unchanged.LAST_RUN).read_text())["source"] == "taken-by-the-check"

    (demo_images / "img_000.png").rename(demo_images / "img_000_moved.png")  # a changed input
    assert unchanged.unchanged_summary(recipe) is None
    assert prep(recipe)["stages"]["ingest"]["processed"] > 0

    assert unchanged.unchanged_summary(recipe) is not None  # nothing changed since that prep
    os.utime(demo_images / "img_001.jpg")  # the same bytes, modified just now (a file being copied in): racy
    assert unchanged.unchanged_summary(recipe) is None  # a change, as a touch is: the prep runs, no plan here


def test_a_folder_sources_stat_signature_sees_a_touch_an_addition_and_a_racy_file(tmp_path):
    from latentmill.recipe import load_recipe

    source = tmp_path / "images"
    (source / "sub").mkdir(parents=True)
    for name in ("a.jpg", "a.txt", "sub/b.png"):
        (source / name).write_bytes(name.encode())
        old = (source / name).stat().st_mtime_ns - 10**10
        os.utime(source / name, ns=(old, old))
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'o'}", f"ingest.source={source}"])
    first = unchanged.source_signature(recipe)
    assert first is not None and first.startswith("3:") and unchanged.source_signature(recipe) == first
    st = (source / "a.txt").stat()
    os.utime(source / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched, same bytes
    touched = unchanged.source_signature(recipe)
    assert touched not in (None, first)
    (source / "sub" / "c.png").write_bytes(b"c")  # new, and modified just now: racy
    assert unchanged.source_signature(recipe) is None
    os.utime(source / "sub" / "c.png", ns=(st.st_mtime_ns, st.st_mtime_ns))
    assert unchanged.source_signature(recipe) not in (None, first, touched)
    assert unchanged.source_signature(load_recipe("demo", [f"output_dir={tmp_path / 'o'}",
                                                           f"ingest.source={source / 'a.jpg'}"])) is None


def test_the_key_sees_the_recipe_the_model_files_and_the_code_but_not_the_runner(tmp_path):
    import shutil

    from latentmill.recipe import load_recipe
    from tests.conftest import REPO_ROOT

    model = tmp_path / "model"
    shutil.copytree(REPO_ROOT / "data" / "demo" / "images", model / "vae")  # any files will do
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'o'}", f"model.pretrained={model}"])
    base = unchanged.key_base(recipe)
    assert unchanged.key_base(load_recipe("demo", [f"output_dir={tmp_path / 'o'}", f"model.pretrained={model}",
                                                   "runner.workers=7"])) == base
    assert unchanged.key_base(load_recipe("demo", [f"output_dir={tmp_path / 'o'}", f"model.pretrained={model}",
                                                   "cache.batch_size=3"])) != base
    touched = next(p for p in sorted((model / "vae").iterdir()))
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 1))
    assert unchanged.key_base(recipe)["files"] != base["files"]


def test_a_hub_id_or_a_missing_last_run_always_runs_the_prep(tmp_path):
    from latentmill.recipe import load_recipe

    hub = load_recipe("demo", [f"output_dir={tmp_path / 'o'}", "model.pretrained=black-forest-labs/FLUX.1-dev"])
    assert unchanged.key_base(hub) is None  # its files are where this cannot stat them
    local = load_recipe("demo", [f"output_dir={tmp_path / 'o'}"])
    base = unchanged.key_base(local)
    assert base is not None and "runner" not in base["recipe"] and base["code"]
    assert unchanged.run_key(base, ["a"]) != unchanged.run_key(base, ["b"])
    assert unchanged.unchanged_summary(local) is None  # no prep yet
    assert unchanged.check(local) == (None, unchanged.source_signature(local))  # the signature the prep records


def test_only_the_inputs_a_recipe_names_are_in_the_key(tmp_path, monkeypatch):
    """A bare name is a path only where the key names a model or file: trainer.tracker_project "latentmill" is not
    the folder of that name in the working directory (its __pycache__, written by other processes, changed the
    key between two unchanged preps); the stream cache is written, not read."""
    monkeypatch.chdir(tmp_path)
    for name in ("latentmill", "tiny-flux", "cache"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.bin").write_bytes(b"x")
    rows = unchanged._files_named({"trainer": {"tracker_project": "latentmill"}, "model": {"pretrained": "tiny-flux"},
                                   "loader": {"cache_dir": str(tmp_path / "cache")},
                                   "caption": {"prompt": "latentmill"}})
    assert [key for key, _ in rows] == ["model.pretrained"]
