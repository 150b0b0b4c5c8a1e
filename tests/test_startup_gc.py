"""A command's start-up objects stay out of its garbage collections (``latentmill.stages.memory.StartupFrozen``).

A prep process imports ~800,000 long-lived objects (torch, diffusers, transformers, Prefect). CPython's collector
walked them all again each time they grew by a quarter, and once more in every full collection of the run:
a CLI prep of 512 tiny images took 12.2 s, 11.3 s with the start-up frozen (medians of 3, interleaved; an
unchanged re-run 10.2 against 9.3 s; the same peak RSS).
"""

from __future__ import annotations

import gc
import weakref

import pytest


class _Cycle:
    pass


def _garbage_cycle() -> weakref.ref:
    cycle = _Cycle()
    cycle.me = cycle  # freed by the cyclic collector only
    return weakref.ref(cycle)


def test_start_up_runs_without_collections_and_settles_into_frozen_objects():
    from latentmill.stages.memory import StartupFrozen

    assert gc.isenabled() and gc.get_freeze_count() == 0
    with StartupFrozen() as startup:
        assert not gc.isenabled()  # the imports run without collections
        lost = _garbage_cycle()
        alive = [_Cycle() for _ in range(100)]
        startup.settle()
        assert lost() is None  # the start-up's garbage is collected before the freeze
        assert gc.isenabled() and gc.get_freeze_count() >= len(alive)  # what lives on is out of the collections
        later = _garbage_cycle()
        gc.collect()
        assert later() is None  # the run's own garbage is collected as usual
        startup.settle()  # once only
    assert gc.isenabled() and gc.get_freeze_count() == 0  # everything is collected as before afterwards


def test_a_process_that_froze_objects_or_turned_the_collector_off_is_left_as_it_is():
    from latentmill.stages.memory import StartupFrozen

    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with StartupFrozen() as startup:
            assert gc.isenabled()
            made = [[] for _ in range(10_000)]
            startup.settle()
            assert gc.get_freeze_count() < count + len(made)  # nothing new frozen
        # not unfrozen (other threads' objects freed by reference counting only lower the count)
        assert 0 < gc.get_freeze_count() <= count and gc.isenabled()
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with StartupFrozen() as startup:
            startup.settle()
            assert not gc.isenabled() and gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_command_line_prep_runs_its_stages_with_the_start_up_frozen(tiny_flux, demo_images, tmp_path,
                                                                       monkeypatch):
    from latentmill.pipelines import prep

    from latentmill.cli import main
    from tests.conftest import DEMO_CONFIG

    seen: dict[str, tuple[bool, int]] = {}
    real_plan = prep.plan_stage

    def watching_plan(stage, recipe):
        seen[stage] = (gc.isenabled(), gc.get_freeze_count())
        return real_plan(stage, recipe)

    monkeypatch.setattr(prep, "plan_stage", watching_plan)
    assert main(["prep", str(DEMO_CONFIG), f"output_dir={tmp_path / 'out'}", f"model.pretrained={tiny_flux}",
                 f"ingest.source={demo_images}"]) == 0
    assert set(seen) == set(prep.STAGES)
    # every stage collects (the collector is on) and leaves the start-up's objects out (tens of thousands)
    assert all(enabled and frozen > 10_000 for enabled, frozen in seen.values()), seen
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the test process is left as it was


@pytest.fixture(autouse=True)
def _collector_as_found():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()
