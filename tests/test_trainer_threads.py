"""CPU training's intra-op threads (issue 30, item 8): the choice, doctor's line about it, the run's summary."""

from __future__ import annotations

import pytest
import torch
from latentmill.trainer import threads as threads_mod
from latentmill.trainer.threads import cgroup_cpu_limit, choose_cpu_threads

from latentmill.doctor import OK, WARNING, check_cpu_threads
from tests.trainer_helpers import build_tiny_transformer, run_train, write_fake_cache


def test_cores_are_shared_among_ranks_less_one_for_the_read_ahead_thread():
    assert choose_cpu_threads(env={}, cores=(2, "CPU affinity")).threads == 1  # not torch's 2
    assert choose_cpu_threads(env={}, cores=(16, "CPU affinity")).threads == 15
    assert choose_cpu_threads(env={"LOCAL_WORLD_SIZE": "2"}, cores=(16, "CPU affinity")).threads == 7
    assert choose_cpu_threads(env={"LOCAL_WORLD_SIZE": "2"}, cores=(2, "CPU affinity")).threads == 1
    assert choose_cpu_threads(env={"LOCAL_WORLD_SIZE": "4"}, cores=(2, "CPU affinity")).threads == 1
    assert choose_cpu_threads(env={}, cores=(1, "CPU affinity")).threads == 1
    assert choose_cpu_threads(env={}, cores=(8, "CPU affinity"), read_ahead=False).threads == 8
    assert "one left to the loader's read-ahead thread" in choose_cpu_threads(env={}, cores=(4, "x")).reason


def test_the_users_setting_wins():
    assert choose_cpu_threads(3, env={"OMP_NUM_THREADS": "5"}, cores=(2, "x")) == threads_mod.ThreadChoice(
        3, "trainer.cpu_threads=3")
    assert choose_cpu_threads(env={"OMP_NUM_THREADS": "5"}, cores=(2, "x")).threads == 5
    assert choose_cpu_threads(env={"OMP_NUM_THREADS": "bogus"}, cores=(4, "x")).threads == 3


def test_torchruns_own_omp_default_does_not_count_as_the_users(monkeypatch):
    env = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "r", "LOCAL_WORLD_SIZE": "2"}
    monkeypatch.setattr(threads_mod, "launcher_environ", lambda: [b"PATH=/bin", b""])  # torchrun set it
    assert choose_cpu_threads(env=env, cores=(16, "x")).threads == 7
    monkeypatch.setattr(threads_mod, "launcher_environ", lambda: [b"OMP_NUM_THREADS=1"])  # the user did
    assert choose_cpu_threads(env=env, cores=(16, "x")).threads == 1
    monkeypatch.setattr(threads_mod, "launcher_environ", lambda: None)  # cannot tell: it stands
    assert choose_cpu_threads(env=env, cores=(16, "x")).threads == 1


def test_cgroup_quota(tmp_path):
    path = tmp_path / "cpu.max"
    path.write_text("150000 100000\n")
    assert cgroup_cpu_limit(path) == 1.5
    path.write_text("max 100000\n")
    assert cgroup_cpu_limit(path) is None
    assert cgroup_cpu_limit(tmp_path / "missing") is None


def test_doctor_says_what_training_uses_and_warns_on_oversubscription():
    ok = check_cpu_threads(1, "2 usable cores (CPU affinity), one left to the loader's read-ahead thread", 2, 1,
                           cuda=False)
    assert ok.status == OK and "1 intra-op thread per rank" in ok.message and "2 usable cores" in ok.message
    over = check_cpu_threads(4, "OMP_NUM_THREADS=4", 2, 1, cuda=False)
    assert over.status == WARNING and "more than the 2 usable cores" in over.message
    assert check_cpu_threads(1, "OMP_NUM_THREADS=1", 2, 2, cuda=False).status == OK
    assert check_cpu_threads(2, "x", 4, 4, cuda=False).status == WARNING
    assert check_cpu_threads(32, "cuda", 16, 1, cuda=True).status == OK


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    cache = root / "cache"
    write_fake_cache(cache, {(32, 32, 1): 4})
    return str(build_tiny_transformer(root / "pretrained")), cache


def test_the_run_records_its_threads_and_gives_the_callers_back(setup, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: (3, "CPU affinity"))
    seen = []
    monkeypatch.setattr(torch.optim.AdamW, "step", _recording_step(seen, torch.optim.AdamW.step))
    before = torch.get_num_threads()
    summary = run_train(setup, tmp_path / "auto", max_steps=2, batch_size=2)
    assert summary["cpu_threads"] == 2 and seen == [2, 2]  # during the steps, not only in the summary
    assert "3 usable cores" in summary["cpu_threads_reason"]
    assert torch.get_num_threads() == before
    seen.clear()
    summary = run_train(setup, tmp_path / "set", max_steps=2, batch_size=2, cpu_threads=1)
    assert (summary["cpu_threads"], summary["cpu_threads_reason"], seen) == (1, "trainer.cpu_threads=1", [1, 1])
    assert torch.get_num_threads() == before


def _recording_step(seen: list[int], step):
    def recording(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(self, *args, **kwargs)

    return recording


def test_the_thread_count_is_not_part_of_what_a_run_learns():
    """A finished run is not trained again because its thread count changed (``pipelines.runs.run_key``)."""
    from latentmill.pipelines.runs import run_key

    from latentmill.recipe import load_recipe

    def key(*overrides: str) -> str:
        return run_key(load_recipe("demo", list(overrides)), "0001-abc", world_size=1)

    assert key() == key("trainer.cpu_threads=3") == key("trainer.resume=latest")
    assert key() != key("trainer.learning_rate=2e-3")
