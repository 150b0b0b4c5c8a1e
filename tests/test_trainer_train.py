"""The training loop end to end on a tiny transformer and a fake latent cache (CPU, single process)."""

import json
import shutil
import statistics

import pytest
import torch
from latentmill.trainer import ParallelConfig, TrainerConfig, train
from latentmill.trainer.checkpoint import list_checkpoints
from safetensors.torch import load_file

from latentmill.core.config import ConfigError, from_dict, to_dict
from tests.trainer_helpers import (
    build_tiny_transformer,
    read_metrics,
    run_train,
    torch_threads,
    write_fake_cache,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(pretrained folder, cache folder): 8 smooth samples in two buckets."""
    root = tmp_path_factory.mktemp("train")
    pretrained = build_tiny_transformer(root / "pretrained")
    cache = root / "cache"
    write_fake_cache(cache, {(48, 64, 1): 4, (64, 32, 1): 4}, smooth=True)
    return str(pretrained), cache


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _run(setup, train_dir, **overrides):
    return run_train(setup, train_dir, **{"max_steps": 10, "batch_size": 3, **overrides})


@pytest.mark.parametrize(
    ("mode", "max_ratio"),
    # Measured here (100 steps, seeds 0-4): full 0.436-0.455, lora (rank 4, attention only) 0.796-0.819.
    [("full", 0.55), ("lora", 0.9)],
)
def test_overfits_a_few_samples(setup, tmp_path, mode, max_ratio):
    summary = _run(setup, tmp_path, mode=mode, max_steps=100, batch_size=4, lora_rank=4)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 100
    ratio = statistics.mean(losses[-5:]) / statistics.mean(losses[:5])
    assert ratio < max_ratio, f"loss fell only to {ratio:.3f} of its start"
    assert summary["steps"] == 100 and summary["final_loss"] == losses[-1]
    assert summary["samples_per_s"] > 0 and 0 <= summary["data_wait_fraction"] < 1
    assert summary["peak_rss_mb"] > 50 and summary["resumed_from"] is None


def test_metrics_have_one_line_per_step(setup, tmp_path):
    _run(setup, tmp_path, max_steps=6, warmup_steps=4, learning_rate=1e-3)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "samples_per_s", "data_wait_s"} <= set(r)
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["data_wait_s"] >= 0
    assert [r["lr"] for r in records] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert {tuple(r["bucket"]) for r in records} == {(48, 64, 1), (64, 32, 1)}


def _weights(checkpoint):
    return load_file(checkpoint / "model.safetensors")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_resume_reproduces_the_uninterrupted_run_bitwise(setup, tmp_path, mode):
    kw = dict(mode=mode, max_steps=12, warmup_steps=3, lora_rank=4, keep_latest_k=0)
    # uninterrupted: 12 steps, checkpoints at 5, 10, 12
    _run(setup, tmp_path / "a", save_every=5, **kw)
    full_run = [r["loss"] for r in read_metrics(tmp_path / "a")]
    assert [s for s, _ in list_checkpoints(tmp_path / "a" / "checkpoints")] == [5, 10, 12]

    # interrupted after step 5 (mid-epoch: 3 batches per epoch), then resumed from latest
    _run(setup, tmp_path / "b", save_every=5, **{**kw, "max_steps": 5})
    summary = _run(setup, tmp_path / "b", save_every=5, resume="latest", **kw)
    assert summary["resumed_from"].endswith("step-000005") and summary["steps_this_run"] == 7
    resumed = read_metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == list(range(1, 13))
    assert [r["loss"] for r in resumed] == full_run  # bitwise, steps 6..12 included
    a, b = (_weights(tmp_path / d / "checkpoints" / "step-000012") for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if mode == "lora":
        assert all("lora_" in k for k in a)

    # resume from an explicit folder, into a fresh train_dir
    summary = _run(setup, tmp_path / "c", resume=str(tmp_path / "a" / "checkpoints" / "step-000010"), **kw)
    assert [r["loss"] for r in read_metrics(tmp_path / "c")] == full_run[10:]


def test_resume_rewinds_metrics_written_after_the_checkpoint(setup, tmp_path):
    _run(setup, tmp_path, max_steps=7, save_every=4, keep_latest_k=0)
    shutil.rmtree(tmp_path / "checkpoints" / "step-000007")  # as if killed before the step-7 save...
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 8, "lo')  # ...while writing a metrics line
    _run(setup, tmp_path, max_steps=7, save_every=4, resume="latest")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6, 7]


def test_resume_at_max_steps_does_no_work(setup, tmp_path):
    first = _run(setup, tmp_path, max_steps=3, save_every=3)
    again = _run(setup, tmp_path, max_steps=3, save_every=3, resume="latest")
    assert again["steps"] == 3 and again["steps_this_run"] == 0
    assert again["final_loss"] == first["final_loss"]


def test_fresh_run_sets_the_previous_run_aside(setup, tmp_path):
    first = _run(setup, tmp_path, max_steps=4, save_every=2)
    second = _run(setup, tmp_path, max_steps=2, save_every=2)  # resume: null in a used train_dir
    assert second["resumed_from"] is None and second["steps"] == 2
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2]  # not the old step 4
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints.previous-1")] == [2, 4]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    previous = (tmp_path / "metrics.previous-1.jsonl").read_text().splitlines()
    assert json.loads(previous[-1])["loss"] == first["final_loss"]
    third = _run(setup, tmp_path, max_steps=1, save_every=1)  # every earlier run is kept, none replaced
    assert third["steps"] == 1
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints.previous-1")] == [2, 4]
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints.previous-2")] == [2]
    assert len((tmp_path / "metrics.previous-2.jsonl").read_text().splitlines()) == 2
    summary = _run(setup, tmp_path / "new", max_steps=1, resume="latest")  # nothing to resume: fresh start
    assert summary["resumed_from"] is None and summary["steps"] == 1


def test_lora_mode_changes_only_lora_weights(setup, tmp_path):
    _run(setup, tmp_path, mode="lora", max_steps=4, save_every=4, lora_rank=4, learning_rate=1e-2)
    saved = _weights(tmp_path / "checkpoints" / "step-000004")
    assert saved and all("lora_B" in k or "lora_A" in k for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # B starts at zero; it moved


def test_cache_check_and_shape_mismatch_are_reported(setup, tmp_path):
    pretrained, cache = setup

    def refuse(manifest):
        raise RuntimeError(f"cache made by vae {manifest['models']['vae']['fingerprint'][:4]}")

    with pytest.raises(RuntimeError, match="cache made by vae 0000"):
        train(
            TrainerConfig(max_steps=1, export=False),
            cache_dir=cache,
            pretrained=pretrained,
            train_dir=tmp_path / "x",
            progress=False,
            check_cache=refuse,
        )
    other = tmp_path / "cache24"
    write_fake_cache(other, {(16, 16, 1): 2}, text_dim=24)
    with pytest.raises(ValueError, match="prompt_embeds width is 24, transformer joint_attention_dim is 32"):
        train(
            TrainerConfig(max_steps=1, export=False),
            cache_dir=other,
            pretrained=pretrained,
            train_dir=tmp_path / "y",
            progress=False,
        )


def test_config_from_recipe_dict_and_errors():
    cfg = from_dict(
        TrainerConfig,
        {"mode": "lora", "max_steps": 5, "adam_betas": [0.9, 0.99], "learning_rate": 1, "resume": "latest"},
        prefix="trainer",
    )
    assert cfg.adam_betas == (0.9, 0.99) and cfg.learning_rate == 1.0 and cfg.resume == "latest"
    with pytest.raises(ConfigError, match="trainer.mode: 'ful' is not one of 'full', 'lora'"):
        from_dict(TrainerConfig, {"mode": "ful"}, prefix="trainer")
    with pytest.raises(ConfigError, match="trainer.max_steps: must be >= 1"):
        from_dict(TrainerConfig, {"max_steps": 0}, prefix="trainer")
    with pytest.raises(ConfigError, match="trainer.timestep_sampling"):
        from_dict(TrainerConfig, {"timestep_sampling": "cosine"}, prefix="trainer")
    assert from_dict(ParallelConfig, {}).strategy == "none"
    assert from_dict(ParallelConfig, {"strategy": "ddp"}).strategy == "ddp"
    assert from_dict(ParallelConfig, {"strategy": "fsdp2", "hsdp_replicate": 2}).hsdp_replicate == 2
    with pytest.raises(ConfigError, match="parallel.hsdp_replicate: 2 needs parallel.strategy 'fsdp2'"):
        from_dict(ParallelConfig, {"strategy": "ddp", "hsdp_replicate": 2}, prefix="parallel")
    with pytest.raises(ConfigError, match="trainer.validation_prompts"):
        from_dict(TrainerConfig, {"validate_every": 5}, prefix="trainer")
    with pytest.raises(ConfigError, match="trainer.caption_dropout: must be in"):
        from_dict(TrainerConfig, {"caption_dropout": 1.5}, prefix="trainer")
    with pytest.raises(ConfigError, match="trainer.lr_schedule: 'step' is not one of"):
        from_dict(TrainerConfig, {"lr_schedule": "step"}, prefix="trainer")
    assert json.loads(json.dumps(to_dict(cfg)))["lora_target_modules"] == cfg.lora_target_modules


def test_strategy_none_refuses_a_multi_process_launch(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="'none' but 2 processes were launched"):
        _run(setup, tmp_path)


def test_peak_rss_of_a_child_is_its_own_not_its_parents():
    """``ru_maxrss`` survives ``execve``: a child of a large process (a flow run, the benchmark driver)
    reported at least the parent's resident set. ``peak_rss_mb`` reads the child's own peak."""
    import subprocess
    import sys
    from pathlib import Path

    from latentmill.trainer.train import peak_rss_mb

    ballast = b"\x01" * (1536 << 20)  # 1.5 GiB, every page touched
    assert peak_rss_mb() > 1536
    code = ("import resource; from trainer.train import peak_rss_mb; "
            "print(peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    own, maxrss = map(float, out.stdout.split())
    del ballast
    assert maxrss > 1536  # what ru_maxrss says (the parent's size at fork)
    assert 20 < own < 1024  # python + torch + the trainer module: a few hundred MiB
