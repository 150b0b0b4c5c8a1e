"""A large plan leaves no memory behind for the rest of the prep (issue 17, figure 15: prep peak RSS at 10x
the inputs).

The ingest plan makes a few small Python objects per input file. CPython keeps small objects in 1 MiB
arenas and returns an arena to the system only once every object in it is gone, so the plan's objects are
harmless only if nothing long-lived lands among them. Two things did:

- the units the plan returns (their ids) were allocated among the plan's per-file objects and kept most of
  its arenas alive through the ingest stage, where Prefect's task runs and the records filled the holes and
  pinned them for good (at 100,000 files, ~100 MB of the prep's resident set). ``ingest.plan`` now rebuilds
  its units (from a JSON text) once the per-file objects are freed;
- the flow's loop over a stage's task runs kept its last future and that future's records after the stage.

The arena counts come from ``sys._debugmallocstats`` (CPython's small-object allocator); the test is skipped
where that allocator is not in use.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FILES = 20_000


def _arenas() -> int | None:
    """CPython's small-object arenas allocated now (None without pymalloc, e.g. PYTHONMALLOC=malloc)."""
    read, write = os.pipe()
    saved = os.dup(2)
    try:
        os.dup2(write, 2)
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    match = re.search(rb"# arenas allocated current\s*=\s*([\d,]+)", b"".join(chunks))
    return int(match.group(1).replace(b",", b"")) if match else None


def _held_by(make) -> tuple[list, int]:
    """What ``make()`` returns, and the arenas it holds beyond those allocated before it ran."""
    gc.collect()
    before = _arenas()
    result = make()
    gc.collect()
    return result, _arenas() - before


CHILD = """
import gc, json, sys
from latentmill.stages import ingest
from tests.test_plan_memory import _held_by

cfg = ingest.IngestConfig(source=sys.argv[1], shard_size=1000)
cfg.validate()
as_planned, held_as_planned = _held_by(lambda: ingest._plan(cfg, None))
planned = [(u.unit_id, list(u.inputs), u.payload) for u in as_planned]
del as_planned
rebuilt, held_rebuilt = _held_by(lambda: ingest.plan(cfg, None))
print(json.dumps({"held_as_planned": held_as_planned, "held_rebuilt": held_rebuilt,
                  "same": [(u.unit_id, list(u.inputs), u.payload) for u in rebuilt] == planned,
                  "samples": sum(u.samples_in for u in rebuilt), "units": len(rebuilt)}))
"""


def test_the_ingest_plan_keeps_only_its_units_arenas(tmp_path):
    """Measured in a fresh interpreter: in a process that already has free room in its arenas (the test
    session's), a plan fits into them without growing any, and there is nothing to see."""
    if _arenas() is None:
        pytest.skip("CPython's small-object allocator (pymalloc) is not in use")
    source = tmp_path / "images"
    source.mkdir()
    for n in range(FILES):  # planning lists and hashes files; it does not decode them
        (source / f"img{n:06d}.jpg").write_bytes(n.to_bytes(4, "little") * 4)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(source)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["samples"] == FILES and got["units"] >= FILES // 1000 and got["same"]  # the same plan
    # The units themselves take a few arenas (20,000 ids of 64 hex characters, the payloads); planned in
    # place they held several times that, the plan's per-file objects' arenas (measured: 1 against 16).
    assert got["held_rebuilt"] * 2 < got["held_as_planned"], got


def test_the_ingest_plan_collects_only_its_own_objects(tmp_path):
    """The collection ``ingest.plan`` runs between its per-file objects and its rebuilt units walks only the
    objects the plan made: the process's older ones (~800,000 in a prep process, 0.45 s a walk, paid by every
    refresh) are frozen meanwhile, and unfrozen after. A cycle the plan made is still collected."""
    import weakref

    from latentmill.stages import ingest, memory

    source = tmp_path / "images"
    source.mkdir()
    for n in range(20):
        (source / f"img{n:03d}.jpg").write_bytes(n.to_bytes(4, "little") * 4)
    cfg = ingest.IngestConfig(source=str(source), shard_size=8)
    cfg.validate()
    old = [[] for _ in range(1000)]  # objects older than the plan
    frozen_during: list[int] = []
    made_in_plan: list[weakref.ref] = []
    real_plan = ingest._plan

    class Cycle:
        pass

    def planning(*args):
        cycle = Cycle()
        cycle.me = cycle  # garbage that only the cyclic collector frees
        made_in_plan.append(weakref.ref(cycle))
        return real_plan(*args)

    def watch(phase, info):
        if phase == "start" and info["generation"] == 2:
            frozen_during.append(gc.get_freeze_count())

    gc.callbacks.append(watch)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ingest, "_plan", planning)
            units = ingest.plan(cfg, None)
    finally:
        gc.callbacks.remove(watch)
    assert sum(u.samples_in for u in units) == 20 and len(units) == 3
    assert frozen_during and frozen_during[-1] >= len(old)  # the plan's collection ran with the old ones frozen
    assert gc.get_freeze_count() == 0  # and they are back
    assert made_in_plan[0]() is None  # the plan's own cyclic garbage was collected

    gc.freeze()  # a process that froze objects itself keeps its own freeze
    try:
        count = gc.get_freeze_count()
        with memory.burst():
            made = [[] for _ in range(10_000)]
            assert gc.get_freeze_count() < count + len(made)  # nothing new frozen
        # not unfrozen (other threads' objects freed by reference counting only lower the count)
        assert 0 < gc.get_freeze_count() <= count
    finally:
        gc.unfreeze()


def test_signals_arriving_during_a_collection_are_delivered_after_it(tmp_path):
    """``memory.signals_deferred`` (around ``gc.collect`` in ``rebuilt``): a SIGTERM handler that raises would
    otherwise run inside a weakref callback of the collection, where its exception is lost and a stopped
    run goes on (``tests/test_processes.py``: the CLI kept training after SIGTERM)."""
    import signal

    from latentmill.stages.memory import signals_deferred

    class Stopped(Exception):
        pass

    def handler(number, frame):
        raise Stopped(number)

    previous = signal.signal(signal.SIGTERM, handler)
    ran_on = []
    try:
        with pytest.raises(Stopped):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                for n in range(1000):  # bytecode: where the handler would run
                    ran_on.append(n)
        assert len(ran_on) == 1000  # the whole block ran; the signal came after it
        assert signal.getsignal(signal.SIGTERM) is handler  # the real handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_flow_holds_no_records_of_a_finished_stage(tmp_path, tiny_flux, demo_images, monkeypatch):
    """While a stage plans, no unit record of an earlier stage is alive in the flow's process (their
    contents are in the stage manifests; the flow's loop used to keep its last task run's records)."""
    from latentmill.pipelines import prep
    from latentmill.stages.shardio import UnitRecord

    from latentmill.recipe import load_recipe
    from tests.conftest import DEMO_CONFIG

    alive: dict[str, int] = {}
    real_plan = prep.plan_stage

    def counting_plan(stage, recipe):
        gc.collect()
        alive[stage] = sum(type(o) is UnitRecord for o in gc.get_objects())
        return real_plan(stage, recipe)

    monkeypatch.setattr(prep, "plan_stage", counting_plan)
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path / 'out'}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={demo_images}", "runner.units_per_task=1",
                                       "ingest.shard_size=8", "compaction.auto_after=0"])
    result = prep.run_prep(recipe)
    assert result["stages"]["ingest"]["units"] > 1
    assert alive == {"ingest": 0, "caption": 0, "curate": 0, "bucket": 0, "cache": 0}


@pytest.mark.slow
def test_slim_curate_records_give_the_same_scores_table_and_near_duplicate_index(tmp_path, tiny_flux):
    """The flow keeps curate records without their per-sample scores and embeddings; the scores table and
    the near-duplicate index read them back from the record files, and come out the same as from the full
    records (without the stage folder, slim records would enter nothing)."""
    import copy
    import shutil

    import pyarrow.parquet as pq
    from latentmill.pipelines.prep import _near_dups, slim_records
    from latentmill.stages import curate, neardup

    from latentmill.recipe import load_recipe
    from tests.conftest import DEMO_CONFIG
    from tests.helpers import prep_in_process
    from tests.test_neardup import _add, _demo, _folder, half

    images = _folder(tmp_path / "images")
    _add(images, "zz_img_003_half.png", half(_demo()["img_003.png"]))  # a near duplicate
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path / 'out'}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={images}",
                                       f"curate.dedup_threshold={neardup.DEFAULT_THRESHOLD}"])
    stage_dir, _, records = prep_in_process(recipe)["curate"]
    names = recipe.curate.active_scorers()
    table = recipe.prep_dir / curate.SCORES_FILE
    full_table = pq.read_table(table).to_pydict()
    assert len(full_table["key"]) == 7 and names and all(full_table[n] for n in names)

    slim = slim_records("curate", copy.deepcopy(records))
    assert all(not set(neardup.PER_SAMPLE_EXTRA) & set(r.extra) for r in slim)
    table.unlink()
    assert curate.write_scores_table(slim, recipe.prep_dir, names, stage_dir) == table
    assert pq.read_table(table).to_pydict() == full_table

    spec = _near_dups(recipe)
    index_root = neardup.index_folder(stage_dir.root, spec["embedder"])

    def fresh_update(recs, where):
        shutil.rmtree(index_root)
        summary = neardup.update(stage_dir.root, recs, spec["embedder"], spec["threshold"], stage_dir=where)
        return {k: summary[k] for k in ("entered", "units_read", "indexed", "near_duplicates")}

    from_full = fresh_update(records, None)
    assert from_full["entered"] == 7 and from_full["near_duplicates"] == 1
    assert fresh_update(slim, stage_dir) == from_full
    assert fresh_update(slim, None)["entered"] == 0  # what the records alone hold: nothing per sample


def test_a_near_duplicate_update_with_nothing_new_keeps_the_index_width(tmp_path):
    """``neardup.update`` reads only records not entered before; with none (an unchanged re-run) it opens the
    index with the width it holds, not the thumbnail embedder's (a CLIP embedder's index is 512 wide)."""
    import numpy as np
    from latentmill.stages import neardup
    from latentmill.stages.shardio import UnitRecord

    fingerprint = {"embedder": "a 8-wide test embedder"}
    folder = neardup.index_folder(tmp_path, fingerprint)
    index = neardup.NearDupIndex(folder, 8)
    rng = np.random.default_rng(0)
    index.enter(["a", "b"], rng.standard_normal((2, 8)).astype(np.float32), [None, None], ["u1"])
    index.close()
    assert neardup.NearDupIndex.stored_dim(folder) == 8
    entered = UnitRecord("u1", "curate", [], [], [], 2, 0.0, {})  # slim: its detail is on disk
    summary = neardup.update(tmp_path, [entered], fingerprint, 0.9, stage_dir=None)
    assert summary["entered"] == 0 and summary["indexed"] == 2


@pytest.mark.heavy  # a real flow over 8 units per task run, counting live records: ~45 s
def test_a_task_run_holds_no_per_sample_detail_of_its_committed_units(tmp_path, tiny_flux, demo_images,
                                                                      monkeypatch):
    """While a task run works on its next unit, the records of the units it committed before hold no per-sample
    detail (curate's scores and embeddings, the cache's components): ``run_units`` slims each record as its
    unit commits. Kept until the task run returned, the detail of 16 units lived among the next units'
    short-lived objects and pinned their arenas (figure 15: ~40 MB more resident at 100,000 inputs)."""
    from latentmill.pipelines import prep
    from latentmill.stages.shardio import UnitRecord

    from latentmill.recipe import load_recipe
    from tests.conftest import DEMO_CONFIG

    detail_alive: dict[str, list[int]] = {"curate": [], "cache": []}
    real_processor = prep.stage_processor

    def watching_processor(stage, recipe):
        process = real_processor(stage, recipe)

        def run(unit, out):
            if stage in detail_alive:
                gc.collect()
                detail_alive[stage].append(sum(
                    type(o) is UnitRecord and bool(set(prep.PER_SAMPLE_EXTRA[stage]) & set(o.extra))
                    for o in gc.get_objects()))
            return process(unit, out)

        return run

    monkeypatch.setattr(prep, "stage_processor", watching_processor)
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path / 'out'}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={demo_images}", "runner.workers=1",
                                       "runner.units_per_task=8", "ingest.shard_size=4",
                                       "caption.shard_bytes=4096", "curate.shard_bytes=4096",
                                       "bucket.shard_bytes=4096", "cache.shard_bytes=4096",
                                       "compaction.auto_after=0"])
    result = prep.run_prep(recipe)
    assert result["stages"]["curate"]["units"] > 2 and result["stages"]["cache"]["units"] > 2
    # every unit after a task run's first found the earlier ones' records slim
    assert detail_alive == {stage: [0] * result["stages"][stage]["units"] for stage in detail_alive}
