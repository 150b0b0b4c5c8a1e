"""``trainer.compile: true`` (both real-size recipes set it) under FSDP2 with activation checkpointing: two gloo
ranks train the tiny Flux for 2 steps with each block compiled by inductor (CPU) and again eagerly; the losses
agree within float32 reassociation (relative 1e-4: inductor fuses and reorders the same float32 arithmetic)."""

import pytest

from tests.trainer_helpers import launch_jobs, read_metrics, write_fake_cache


@pytest.mark.heavy  # inductor compiles each block's forward and backward on both ranks (minutes on 2 cores)
def test_compiled_fsdp2_with_activation_checkpointing_matches_eager(tiny_flux, tmp_path):
    write_fake_cache(tmp_path / "cache", {(48, 64, 1): 4, (64, 32, 1): 4}, smooth=True, shards_per_bucket=2)
    jobs = [{"cfg": {"mode": "full", "max_steps": 2, "batch_size": 2, "learning_rate": 3e-3, "save_every": 0,
                     "export": False, "activation_checkpointing": True, "compile": compiled},
             "cache": str(tmp_path / "cache"), "pretrained": str(tiny_flux), "train_dir": str(tmp_path / name),
             "parallel": {"strategy": "fsdp2"}}
            for name, compiled in (("eager", False), ("compiled", True))]
    _, summaries = launch_jobs(tmp_path, jobs, timeout=1800)
    eager = [r["loss"] for r in read_metrics(tmp_path / "eager")]
    compiled = [r["loss"] for r in read_metrics(tmp_path / "compiled")]
    assert len(eager) == len(compiled) == 2 and all(0 < x < 1e3 for x in eager)
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"] == compiled[-1]
