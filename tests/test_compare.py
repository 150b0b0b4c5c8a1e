"""``latentmill compare``: two runs' settings, snapshots and losses side by side, and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from latentmill.pipelines.runs import plan_run
from latentmill.pipelines.snapshot import publish

from latentmill.cli import main
from latentmill.compare import compare_runs, format_comparison, plot_comparison
from latentmill.recipe import recipe_from_dict
from tests.trainer_helpers import write_fake_cache


def _run(out: Path, snapshot: str, metrics: list[dict], **trainer) -> Path:
    """A run folder as ``latentmill train`` starts it (``plan_run``), with the metrics lines it would write."""
    recipe = recipe_from_dict({"output_dir": str(out), "model": {"pretrained": "unused"}, "trainer": trainer})
    folder = plan_run(recipe, snapshot).folder
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return folder


@pytest.fixture()
def two_runs(tmp_path):
    """Run A on a snapshot of 12 samples; run B, another learning rate, on one of 16 (4 more, 4 held out), each
    in an output_dir of its own."""
    names = []
    for side, samples, fraction in (("a", 12, 0.0), ("b", 16, 0.2)):
        out = tmp_path / side
        write_fake_cache(out / "prep" / "cache", {(32, 32, 1): samples}, seq_len=8)  # keys s00000, s00001, ...
        names.append(publish(out, out / "prep" / "cache", fraction, 4)["name"])
    run_a = _run(tmp_path / "a", names[0], [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9, "eval": {"loss": 0.95}},
                                            {"step": 3, "loss": 0.8}], learning_rate=1e-4)
    run_b = _run(tmp_path / "b", names[1], [{"step": 1, "loss": 1.1}, {"step": 2, "loss": 0.7, "eval": {"loss": 0.75}}],
                 learning_rate=2e-4)
    return run_a, run_b, *names


def test_compare_prints_settings_snapshots_and_losses_at_equal_steps(two_runs, tmp_path):
    run_a, run_b, first, second = two_runs
    result = compare_runs(run_a, run_b)
    assert result["settings"] == {"trainer.learning_rate": [1e-4, 2e-4]}
    snaps = result["snapshots"]
    assert (snaps["a"]["name"], snaps["a"]["samples"], snaps["a"]["held_out"]) == (first, 12, 0)
    assert (snaps["b"]["name"], snaps["b"]["samples"], snaps["b"]["held_out"]) == (second, 16, 4)
    assert snaps["only_a"] == [] and snaps["only_b"] == [f"s{i:05d}" for i in range(12, 16)]
    assert result["steps"] == {1: {"loss": [1.0, 1.1], "eval": [None, None]},
                               2: {"loss": [0.9, 0.7], "eval": [0.95, 0.75]}}
    text = format_comparison(result)
    assert "  trainer.learning_rate: 0.0001 -> 0.0002" in text
    assert "samples only in B: 4 (s00012, s00013, s00014, s00015)" in text
    rows = text.split("losses at equal steps:")[1].strip().splitlines()
    assert rows[1].split() == ["2", "0.90000", "0.70000", "0.95000", "0.75000"] and len(rows) == 2  # eval steps
    png = plot_comparison(result, tmp_path / "plots" / "ab.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_compares_and_refuses_a_folder_that_is_not_a_run(two_runs, tmp_path, capsys):
    run_a, run_b, _, _ = two_runs
    assert main(["compare", str(run_a), str(run_b), "--plot", str(tmp_path / "c.png")]) == 0
    printed = capsys.readouterr().out
    assert "trainer.learning_rate" in printed and f"plot: {tmp_path / 'c.png'}" in printed
    assert (tmp_path / "c.png").stat().st_size > 1000
    # an output_dir stands for its run started last (B)
    assert compare_runs(run_a, run_b.parent.parent.parent)["runs"][1] == str(run_b)
    assert main(["compare", str(run_a), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{tmp_path} is not a training run" in err
