"""Resume on another number of ranks (issue 35, item 3): a checkpoint written by N ranks continues on M with the
same global batch, its model and optimizer resharded, the rest of the epoch's samples each read once, in the
order and with the per-sample draws of an uninterrupted run. On gloo, in one 2-rank launch beside in-process
runs of one rank: 2 -> 1 (DDP checkpoint), 1 -> 2 (FSDP2, DCP resharded), a global batch 2 ranks cannot split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from latentmill.trainer import ParallelConfig, TrainerConfig, train
from latentmill.trainer.checkpoint import read_trainer_state, step_dir_name
from latentmill.trainer.loader import resume_batch_size

from latentmill.core.config import ConfigError
from tests.trainer_helpers import (
    build_tiny_transformer,
    launch_jobs,
    read_metrics,
    torch_threads,
    write_fake_cache,
)

CACHE = {(48, 64, 1): 8, (64, 32, 1): 4}  # 12 samples: 3 global batches of 4 per epoch
KEYS = sorted(f"s{i:05d}" for i in range(12))
STEPS, HALF = 4, 2  # the resumes start inside the first epoch and run into the second
BASE = {"max_steps": STEPS, "learning_rate": 3e-3, "save_every": HALF, "keep_latest_k": 0, "export": False,
        "tensorboard": False, "record_samples": True, "mode": "full"}


def _in_process(root: Path, train_dir: Path, strategy: str, **cfg) -> dict:
    with torch_threads(1):
        return train(TrainerConfig(**{**BASE, **cfg}), cache_dir=root / "cache", pretrained=str(root / "pretrained"),
                     train_dir=train_dir, seed=0, progress=False, parallel=ParallelConfig(strategy))


def _job(root: Path, name: str, strategy: str, **cfg) -> dict:
    return {"cfg": {**BASE, **cfg}, "cache": str(root / "cache"), "pretrained": str(root / "pretrained"),
            "train_dir": str(root / name), "parallel": {"strategy": strategy}}


def _samples(train_dir: Path, ranks: int) -> dict[int, list[str]]:
    """Per step, the sample keys every rank read (``trainer.record_samples``), rank 0's first."""
    steps: dict[int, list[str]] = {}
    for rank in range(ranks):
        for line in (train_dir / f"samples-rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(k for b in record["batches"] for k in b["keys"])
    return steps


def _ordinals(train_dir: Path, ranks: int) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for rank in range(ranks):
        for line in (train_dir / f"samples-rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(o for b in record["batches"] for o in b["ordinals"])
    return steps


def _losses(train_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(train_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One rank (FSDP2, a group of one: DCP checkpoints) and two ranks (DDP: full checkpoints), each uninterrupted,
    and each resumed from step 2 on the other number of ranks; a checkpoint of 3-sample global batches resumed on 2."""
    root = tmp_path_factory.mktemp("reshard")
    build_tiny_transformer(root / "pretrained")
    write_fake_cache(root / "cache", CACHE, smooth=True)
    one = _in_process(root, root / "one", "fsdp2", batch_size=4)
    three = _in_process(root, root / "three", "none", batch_size=3, max_steps=1, save_every=1, record_samples=False)
    half = step_dir_name(HALF)
    two, one_on_two, three_on_two = launch_jobs(root / "launch", [
        _job(root, "two", "ddp", batch_size=2),
        _job(root, "one-on-two", "fsdp2", batch_size=4, resume=str(root / "one" / "checkpoints" / half)),
        _job(root, "three-on-two", "ddp", batch_size=3, resume=str(root / "three" / "checkpoints" / step_dir_name(1))),
    ])
    two_on_one = _in_process(root, root / "two-on-one", "none", batch_size=2,
                             resume=str(root / "two" / "checkpoints" / half))
    return root, {"one": [one], "three": [three], "two": two, "one-on-two": one_on_two,
                  "three-on-two": three_on_two, "two-on-one": [two_on_one]}


@pytest.mark.slow
def test_two_ranks_resume_on_one_with_the_same_samples_and_draws(runs):
    root, summaries = runs
    (resumed,) = summaries["two-on-one"]
    assert resumed["world_size"] == 1 and resumed["steps"] == STEPS and resumed["steps_this_run"] == STEPS - HALF
    assert resumed["resumed_from"] == str(root / "two" / "checkpoints" / step_dir_name(HALF))
    # the global batch kept: 4 samples on one rank (the recipe's 2 per rank were for 2 ranks)
    state = read_trainer_state(root / "two-on-one" / "checkpoints" / step_dir_name(STEPS))
    assert (state["loader"]["batch_size"], state["loader"]["world_size"], state["world_size"]) == (4, 1, 1)
    assert state["config"]["batch_size"] == 4
    whole, after = _samples(root / "two", 2), _samples(root / "two-on-one", 1)
    assert sorted(after) == list(range(HALF + 1, STEPS + 1))
    for step in after:  # the very samples of the uninterrupted run, rank 0's slice then rank 1's
        assert after[step] == whole[step]
    assert _ordinals(root / "two-on-one", 1) == {s: o for s, o in _ordinals(root / "two", 2).items() if s > HALF}
    # over the epoch, every sample once: steps 1-2 on two ranks, step 3 on one
    seen = {**{s: k for s, k in whole.items() if s <= HALF}, **after}
    assert sorted(k for s in (1, 2, 3) for k in seen[s]) == KEYS
    # the same per-sample draws on the same samples: the global batch's loss at every step, to float tolerance
    # (measured: 2e-7 relative)
    assert [r["step"] for r in read_metrics(root / "two-on-one")] == list(range(HALF + 1, STEPS + 1))
    assert _losses(root / "two-on-one") == pytest.approx(_losses(root / "two")[HALF:], rel=1e-5)


@pytest.mark.slow
def test_one_rank_fsdp2_resumes_on_two_resharded(runs):
    root, summaries = runs
    rank0, rank1 = summaries["one-on-two"]
    assert rank0["world_size"] == rank1["world_size"] == 2 and rank0["steps"] == rank1["steps"] == STEPS
    # DCP resharded the model and optimizer: one shard file saved on one rank, two on two
    assert len(list((root / "one" / "checkpoints" / step_dir_name(HALF) / "dcp").glob("*.distcp"))) == 1
    assert len(list((root / "one-on-two" / "checkpoints" / step_dir_name(STEPS) / "dcp").glob("*.distcp"))) == 2
    whole, after = _samples(root / "one", 1), _samples(root / "one-on-two", 2)
    assert {s: k for s, k in whole.items() if s > HALF} == after
    assert _losses(root / "one-on-two") == pytest.approx(_losses(root / "one")[HALF:], rel=1e-5)
    # one global batch size, one sequence: 4 samples per rank on one rank and 2 per rank on two read the same
    # samples at every step, with the same draws (FSDP2 on one rank and DDP on two: the same losses)
    assert _samples(root / "two", 2) == whole
    assert _losses(root / "two") == pytest.approx(_losses(root / "one"), rel=1e-5)


@pytest.mark.slow
def test_a_global_batch_the_ranks_cannot_split_is_refused_before_any_work(runs):
    root, summaries = runs
    where = root / "three" / "checkpoints" / step_dir_name(1)
    want = (f"trainer.resume: {where} trains global batches of 3 samples (3 per rank x 1 ranks), which 2 ranks "
            "cannot split evenly; resume it on 1 (3 per rank) or 3 (1 per rank) data-parallel ranks, or set another "
            "trainer.batch_size to start a new epoch with a new global batch")
    assert [s["config_error"] for s in summaries["three-on-two"]] == [want, want]
    assert not (root / "three-on-two" / "metrics.jsonl").exists() and not (root / "three-on-two" / "checkpoints").exists()


@pytest.mark.slow
def test_the_command_line_refuses_it_before_torchrun_starts(runs):
    from latentmill.pipelines.runs import check_resume_batch

    from latentmill.recipe import load_recipe
    from tests.conftest import DEMO_CONFIG

    root, _ = runs
    where = root / "three" / "checkpoints" / step_dir_name(1)
    recipe = load_recipe(DEMO_CONFIG, ["trainer.batch_size=3", f"trainer.resume={where}", "parallel.strategy=ddp"])
    with pytest.raises(ConfigError, match=r"^trainer.resume: .* which 2 ranks cannot split evenly; resume it on "
                                          r"1 \(3 per rank\) or 3 \(1 per rank\) data-parallel ranks"):
        check_resume_batch(recipe, root / "run", 2)
    check_resume_batch(recipe, root / "run", 3)  # 1 per rank: launched


def test_resume_batch_size_keeps_the_global_batch():
    saved = {"batch_size": 3, "world_size": 2, "epoch": 0, "batch_index": 1}
    assert [resume_batch_size(saved, 3, m, "ckpt") for m in (1, 2, 3, 6)] == [6, 3, 2, 1]
    assert resume_batch_size(saved, 5, 4, "ckpt") == 5  # another batch size on purpose: a new global batch
    with pytest.raises(ConfigError) as err:
        resume_batch_size(saved, 3, 4, "ckpt")
    assert str(err.value) == (
        "trainer.resume: ckpt trains global batches of 6 samples (3 per rank x 2 ranks), which 4 ranks cannot split "
        "evenly; resume it on 1 (6 per rank), 2 (3 per rank), 3 (2 per rank) or 6 (1 per rank) data-parallel ranks, "
        "or set another trainer.batch_size to start a new epoch with a new global batch")


@pytest.mark.slow
@pytest.mark.heavy  # two more launches, one of 4 ranks; make test: 1 -> 2 (test_one_rank_fsdp2_resumes_on_two...)
def test_four_ranks_fsdp2_resume_on_two(runs):
    root, _ = runs
    (four,) = launch_jobs(root / "launch-4", [_job(root, "four", "fsdp2", batch_size=1)], nproc=4)
    (resumed,) = launch_jobs(root / "launch-2", [
        _job(root, "four-on-two", "fsdp2", batch_size=1, resume=str(root / "four" / "checkpoints" / step_dir_name(HALF))),
    ])
    assert [s["world_size"] for s in four] == [4] * 4 and [s["world_size"] for s in resumed] == [2, 2]
    assert len(list((root / "four" / "checkpoints" / step_dir_name(HALF) / "dcp").glob("*.distcp"))) == 4
    assert len(list((root / "four-on-two" / "checkpoints" / step_dir_name(STEPS) / "dcp").glob("*.distcp"))) == 2
    state = read_trainer_state(root / "four-on-two" / "checkpoints" / step_dir_name(STEPS))
    assert (state["loader"]["batch_size"], state["loader"]["world_size"]) == (2, 2)
    whole = _samples(root / "four", 4)
    assert whole == _samples(root / "two", 2)  # the global batch of 4, one sequence on 4 ranks as on 2
    assert _samples(root / "four-on-two", 2) == {s: k for s, k in whole.items() if s > HALF}
    assert _losses(root / "four") == pytest.approx(_losses(root / "two"), rel=1e-5)
    assert _losses(root / "four-on-two") == pytest.approx(_losses(root / "four")[HALF:], rel=1e-5)
