"""Checkpoints: atomic step folders, latest/prune rules, and a full state round trip."""

import json
import os

import pytest
import torch
from latentmill.trainer.checkpoint import (
    MODEL_FILE,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from safetensors.torch import load_file


def _parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # frozen params are not saved
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _train_step(model, opt, sched):
    loss = model(torch.randn(5, 4)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def _save(ckpt_dir, step, parts, k=0):
    model, opt, sched = parts
    return save_checkpoint(
        ckpt_dir,
        step,
        model=model,
        optimizer=opt,
        scheduler=sched,
        trainer_state={"loader": {"epoch": 1, "batch_index": step}},
        keep_latest_k=k,
    )


def test_round_trip_restores_every_state(tmp_path):
    reference = _parts(0)
    for _ in range(3):
        _train_step(*reference)
    path = _save(tmp_path, 3, reference)
    assert path.name == "step-000003" and sorted(p.name for p in path.iterdir()) == [
        "model.safetensors",
        "optimizer.pt",
        "rng-rank0.safetensors",
        "trainer_state.json",
    ]
    assert set(load_file(path / "model.safetensors")) == {"1.weight", "1.bias"}  # trainable only
    # what the reference does after the save: a step whose input comes from the global RNG
    _train_step(*reference)

    model, opt, sched = _parts(1)  # other init, other RNG states
    model[0].load_state_dict(reference[0][0].state_dict())  # the frozen part comes from the pretrained model
    state = load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    assert state["step"] == 3 and state["loader"] == {"epoch": 1, "batch_index": 3}
    _train_step(model, opt, sched)
    for want, have in zip(reference[0].parameters(), model.parameters()):
        assert torch.equal(want, have)
    assert sched.get_last_lr() == reference[2].get_last_lr()
    assert opt.state_dict()["state"][0]["step"] == 4


def test_optimizer_file_loads_with_weights_only(tmp_path):
    parts = _parts()
    _train_step(*parts)
    path = _save(tmp_path, 1, parts)
    data = torch.load(path / "optimizer.pt", weights_only=True)
    assert set(data) == {"optimizer", "scheduler"}


def test_tmp_folder_is_never_latest(tmp_path):
    parts = _parts()
    _save(tmp_path, 10, parts)
    leftover = tmp_path / "step-000020.tmp"
    leftover.mkdir()
    (leftover / "trainer_state.json").write_text(json.dumps({"step": 20}))
    (tmp_path / "step-000030").mkdir()  # no trainer_state.json: incomplete, ignored too
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"
    assert resolve_resume("latest", tmp_path) == tmp_path / "step-000010"
    _save(tmp_path, 20, parts)  # a new save of that step replaces the leftover
    assert not leftover.exists() and latest_checkpoint(tmp_path) == tmp_path / "step-000020"


def test_a_save_killed_before_rename_leaves_previous_latest(tmp_path, monkeypatch):
    parts = _parts()
    _save(tmp_path, 10, parts)

    def killed(src, dst):
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 20, parts)
    assert (tmp_path / "step-000020.tmp").is_dir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"


def test_keep_latest_k_prunes_oldest(tmp_path):
    parts = _parts()
    for step in (5, 10, 15, 20):
        _save(tmp_path, step, parts, k=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [15, 20]
    _save(tmp_path, 25, parts, k=0)  # 0 keeps all
    assert [s for s, _ in list_checkpoints(tmp_path)] == [15, 20, 25]


def test_resolve_resume(tmp_path):
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("latest", tmp_path / "nothing-yet") is None
    path = _save(tmp_path, 3, _parts())
    assert resolve_resume(str(path), tmp_path / "elsewhere") == path
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / "step-000099"), tmp_path)


def test_loading_into_another_mode_is_refused(tmp_path):
    path = _save(tmp_path, 1, _parts())
    model, opt, sched = _parts()
    model.requires_grad_(True)
    with pytest.raises(ValueError, match="another trainer.mode"):
        load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)


def test_sharded_checkpoint_resumes_in_another_strategy(tmp_path):
    """FSDP2 in one process (a group of one) writes DCP shards; a plain run resumes from them."""
    from latentmill.trainer import ParallelConfig, TrainerConfig, train

    from tests.trainer_helpers import build_tiny_transformer, read_metrics, torch_threads, write_fake_cache

    pretrained = build_tiny_transformer(tmp_path / "pretrained")
    write_fake_cache(tmp_path / "cache", {(32, 32, 1): 4}, smooth=True)
    cfg = dict(max_steps=4, batch_size=2, learning_rate=3e-3, save_every=2, keep_latest_k=0, export=False)

    def run(train_dir, parallel, **kw):
        with torch_threads(1):
            return train(
                TrainerConfig(**{**cfg, **kw}),
                cache_dir=tmp_path / "cache",
                pretrained=str(pretrained),
                train_dir=train_dir,
                parallel=ParallelConfig(parallel),
                progress=False,
            )

    run(tmp_path / "fsdp", "fsdp2")
    step2 = tmp_path / "fsdp" / "checkpoints" / "step-000002"
    assert (step2 / "dcp").is_dir() and not (step2 / MODEL_FILE).exists()
    run(tmp_path / "plain", "none", resume=str(step2))
    sharded, plain = (read_metrics(tmp_path / d) for d in ("fsdp", "plain"))
    assert [r["step"] for r in plain] == [3, 4]
    assert [r["loss"] for r in plain] == pytest.approx([r["loss"] for r in sharded[2:]], rel=1e-5)
    # and the other way round is refused with a reason, not a shape error
    with pytest.raises(ValueError, match="saved unsharded"):
        run(tmp_path / "back", "fsdp2", resume=str(tmp_path / "plain" / "checkpoints" / "step-000004"))
