"""The prep flow: map each stage's work units over a task runner, then commit the stage manifest.

Stages are plain functions (``stages/``); this module only plans units, hands them to Prefect tasks, shows
progress and gathers counts. Stage outputs are content-addressed, so Prefect's own result caching is off:
a unit whose record exists on disk is reused without a task run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from latentmill.pipelines import objectstore, unchanged
from latentmill.pipelines.report import (
    PLOTS_DIR,
    RunLog,
    StageProgress,
    current_run_id,
    publish_prep_artifacts,
    publish_prep_plots,
    publish_tracker_links,
    stage_line,
)
from latentmill.pipelines.retention import OutputBusyError, writer_lock  # noqa: F401 (re-exported)
from latentmill.pipelines.snapshot import STAGES
from latentmill.pipelines.snapshot import publish as publish_snapshot
from latentmill.stages import bucket, cache, caption, curate, curate_clips, ingest, neardup, remotetars
from latentmill.stages.compact import compact_stage
from latentmill.stages.shardio import StageDir, StageRecords, UnitOutput, UnitRecord, WorkUnit, stage_report
from latentmill.stages.workers import number_worker
from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner
from prefect.utilities.annotations import unmapped
from tqdm.auto import tqdm

from latentmill import interrupt
from latentmill.core.hashing import stable_hash
from latentmill.core.store import is_url
from latentmill.recipe import Recipe, RunnerConfig, load_recipe, recipe_from_dict

MAX_UNITS_PER_TASK = 16
MIN_TASK_SAMPLES = 16  # auto grouping: fewer pending samples than this per task run are not split further
PLAN_BATCH = 256  # planned units stored in the catalog per transaction


class Pending(NamedTuple):
    """A planned unit the flow has to run, as the flow holds it (its payload waits in the catalog)."""

    unit_id: str
    samples_in: int


def stage_dir_for(recipe: Recipe, stage: str) -> StageDir:
    """The ``StageDir`` of ``stage`` in ``recipe``'s output tree (not created here)."""
    return StageDir(recipe.stage_dir(stage), stage)


def _captioner(recipe: Recipe):
    """The recipe's captioner; a model sees transparent pixels over ``cache.alpha_background``, as cached."""
    return caption.build_captioner(recipe.caption, recipe.cache.background)


def _near_dups(recipe: Recipe) -> dict[str, Any] | None:
    """The near-duplicate decisions the bucket stage applies (None: ``curate.dedup_threshold`` is null)."""
    return bucket.near_dup_spec(recipe.curate.embedder_fingerprint(recipe.cache.background),
                                recipe.curate.dedup_threshold)


def _clip_spec(recipe: Recipe) -> curate_clips.ClipSpec:
    """The bucket stage's clip plan, which the curate stage scores videos by (K frames per clip)."""
    return curate_clips.clip_spec(recipe.bucket)


def update_near_dups(recipe: Recipe, curate_dir: StageDir, records: Iterable[UnitRecord]) -> dict[str, Any] | None:
    """After the curate units: enter their new embeddings into the near-duplicate index and decide them
    (``latentmill.stages.neardup.update``); the run summary's ``near_duplicates``, None when off."""
    spec = _near_dups(recipe)
    if spec is None:
        return None
    return neardup.update(curate_dir.root, records, spec["embedder"], spec["threshold"], recipe.curate.dedup_index)


def plan_stage(stage: str, recipe: Recipe) -> Iterable[WorkUnit]:
    """The work units of ``stage`` given the upstream stage's committed manifest (ingest's come one at a
    time, as its plan streams them: iterate once)."""
    if stage == "ingest":
        return ingest.plan(recipe.ingest, stage_dir_for(recipe, "ingest"))
    upstream = stage_dir_for(recipe, STAGES[STAGES.index(stage) - 1])
    if stage == "caption":
        return caption.plan(recipe.caption, upstream, _captioner(recipe))
    if stage == "curate":
        return curate.plan(recipe.curate, upstream, background=recipe.cache.background, clips=_clip_spec(recipe))
    if stage == "bucket":
        return bucket.plan(recipe.bucket, upstream, near_dups=_near_dups(recipe))
    return cache.plan(recipe.cache, recipe.model, upstream)


def stage_processor(stage: str, recipe: Recipe) -> Callable[[WorkUnit, UnitOutput], None]:
    """The function that turns one unit of ``stage`` into output shards."""
    return {
        "ingest": lambda unit, out: ingest.process(recipe.ingest, unit, out),
        "caption": lambda unit, out: caption.process(recipe.caption, unit, out, _captioner(recipe)),
        "curate": lambda unit, out: curate.process(recipe.curate, unit, out, recipe.cache.background,
                                                   _clip_spec(recipe)),
        "bucket": lambda unit, out: bucket.process(recipe.bucket, unit, out),
        "cache": lambda unit, out: cache.process(recipe.cache, recipe.model, unit, out),
    }[stage]


def manifest_header(stage: str, recipe: Recipe, records: list[UnitRecord] | None = None) -> dict[str, Any]:
    """Stage-specific manifest fields (the cache stage records its models)."""
    if stage == "ingest":
        return {"fingerprint": stable_hash(ingest.fingerprint(recipe.ingest)), "source": recipe.ingest.source,
                "shard_size": recipe.ingest.shard_size}
    if stage == "caption":
        return caption.manifest_header(recipe.caption, _captioner(recipe))
    if stage == "curate":
        per_clip = any(r.extra.get("clip_videos") for r in records or ())
        return curate.manifest_header(recipe.curate, recipe.cache.background, _clip_spec(recipe) if per_clip else None)
    if stage == "bucket":
        return {"fingerprint": stable_hash(bucket.fingerprint(recipe.bucket, _near_dups(recipe)))}
    return cache.manifest_header(recipe.cache, recipe.model, stage_dir_for(recipe, stage), records,
                                 prompts=validation_texts(recipe))


def validation_texts(recipe: Recipe) -> list[str]:
    """The texts the cache encodes for validation: ``trainer.validation_prompts`` and the family's negative
    prompt (classifier-free guidance), when the family's validation samples from cached embeddings."""
    from latentmill.trainer.adapters import get_adapter

    if not recipe.trainer.validation_prompts:
        return []
    adapter = get_adapter(cache.cache_plan(recipe.cache, recipe.model).family)
    if not (adapter.validates_from_prompts and adapter.prompts_from_cache):
        return []
    return [*recipe.trainer.validation_prompts, adapter.negative_prompt]


def auto_compact(recipe: Recipe, cache_dir: StageDir) -> dict[str, Any] | None:
    """The end of a prep: merge the cache's small units when ``compaction.auto_after`` of them are there
    (``latentmill.stages.compact``; the prep holds the writer lock already). What was merged, or None."""
    if not recipe.compaction.auto_after:
        return None
    merged = compact_stage(cache_dir, recipe.compaction.small_below, recipe.compaction.auto_after)
    if not merged["compacted"]:
        return None
    return {k: merged[k] for k in ("merged_units", "shards_before", "shards_after", "samples",
                                   "member_bytes_copied", "seconds")}


def run_stages_in_process(recipe: Recipe) -> dict[str, tuple[StageDir, dict[str, Any], StageRecords]]:
    """Run the five stages here, one unit after another, without Prefect (tests, benchmarks, debugging).

    The same plan / process / manifest functions as the flow; no snapshot is published. Returns each stage's
    folder, committed manifest and unit records.
    """
    ensure_models(recipe)
    result = {}
    for stage in STAGES:
        stage_dir = stage_dir_for(recipe, stage).ensure()
        process, ids, reused = stage_processor(stage, recipe), [], []
        for unit in plan_stage(stage, recipe):
            record = stage_dir.run_unit(unit, process)
            ids.append(unit.unit_id)
            if record.reused:
                reused.append(unit.unit_id)
        records = StageRecords(stage_dir, ids, reused)
        result[stage] = (stage_dir, stage_dir.write_manifest(records, manifest_header(stage, recipe, records)), records)
        if stage == "curate":
            curate.write_scores_table(records, recipe.prep_dir, recipe.curate.active_scorers())
            update_near_dups(recipe, stage_dir, records)
    if auto_compact(recipe, result["cache"][0]) is not None:  # as the flow does: the manifest names merged units
        stage_dir = result["cache"][0]
        manifest = stage_dir.read_manifest()
        result["cache"] = (stage_dir, manifest, StageRecords(stage_dir, manifest["units"], manifest["units"]))
    return result


def units_run_name(parameters: dict[str, Any]) -> str:
    """A task run's name in the UI says what it does: ``cache · 3 units · 24 samples``."""
    count = len(parameters["unit_ids"])
    return f"{parameters['stage']} · {count} unit{'s' if count != 1 else ''} · {parameters['samples']} samples"


class StoppableOutput:
    """A unit's output that raises ``latentmill.interrupt.Interrupted`` when a stop is asked for (Ctrl-C,
    SIGTERM) as the stage hands it a sample: the unit is abandoned, its temporaries removed and no record
    written (``StageDir.run_unit``), instead of the task runner waiting for the rest of the task run's units.
    The stage functions know nothing of it: every sample, kept or quarantined, passes through here."""

    def __init__(self, out: UnitOutput):
        self._out = out

    def add(self, *args: Any, **kwargs: Any) -> None:
        interrupt.check()
        self._out.add(*args, **kwargs)

    def quarantine(self, *args: Any, **kwargs: Any) -> None:
        interrupt.check()
        self._out.quarantine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def stoppable(process: Callable[[WorkUnit, UnitOutput], None]) -> Callable[[WorkUnit, UnitOutput], None]:
    """``process`` stopping between samples at a stop request, and not starting at all after one."""

    def run(unit: WorkUnit, out: UnitOutput) -> None:
        interrupt.check()
        process(unit, StoppableOutput(out))  # type: ignore[arg-type]  (the same interface)

    return run


def wait_result(future: Any, poll_s: float = 0.2) -> Any:
    """``future.result()``, raising ``Interrupted`` at a stop request instead of waiting for the task run.

    The signal handlers only note a request (``latentmill.interrupt``), so the flow's thread looks for one
    while it waits; the task run's own thread abandons its unit at its next sample.
    """
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    while not done.wait(poll_s):
        if interrupt.requested() is not None:
            _stop_worker_processes()
            interrupt.check()
    interrupt.check()  # a task run that stopped returns only the units it committed (run_units): not a result
    return future.result()


def _stop_worker_processes() -> None:
    """Pass a stop on to the process pool's workers (``runner.kind: processes``), which a signal sent to this
    process alone does not reach: each abandons its unit at the next sample (``start_worker``)."""
    for child in multiprocessing.active_children():
        try:
            os.kill(child.pid, signal.SIGINT)
        except (ProcessLookupError, TypeError):  # gone already, or never started (no pid)
            pass


def start_worker(slot_dir: str) -> None:
    """Initializer of a process-pool worker: its number (one GPU each, ``stages.workers``), and SIGINT as a
    stop request (``latentmill.interrupt``) rather than a ``KeyboardInterrupt`` wherever it lands: a Ctrl-C
    reaches the workers too (the terminal's process group), and so does the flow's own stop
    (``_stop_worker_processes``). SIGTERM keeps ending a worker at once: an idle worker that only noted it
    outlived a run killed with its process group."""
    number_worker(slot_dir)
    signal.signal(signal.SIGINT, lambda signum, frame: interrupt.request(signum))


@task(name="run-units", task_run_name=units_run_name, cache_policy=NONE, retries=1, retry_delay_seconds=1)
def run_units(stage: str, recipe_data: dict, unit_ids: list[str], samples: int) -> list[str]:
    """Run a few planned work units one after another, read by id from the output folder's catalog (a unit
    committed before a retry is reused, not redone); the ids of those committed. ``samples``: their input
    samples, for the task run's name. A stop request (Ctrl-C, SIGTERM) abandons the unit in flight at its
    next sample, uncommitted (``stoppable``)."""
    recipe = recipe_from_dict(recipe_data)
    stage_dir, process = stage_dir_for(recipe, stage), stoppable(stage_processor(stage, recipe))
    committed = []
    try:
        for data in stage_dir.catalog.planned(stage, unit_ids):
            committed.append(stage_dir.run_unit(WorkUnit.from_json(data), process).unit_id)
    except interrupt.Interrupted:
        # The flow stops too (wait_result) and never reads this. Raised, the BaseException would cross a
        # process pool into Prefect's result callback, kill the pool's management thread and hang the exit.
        pass
    return committed


def task_chunks(units: Iterable[Any], runner: RunnerConfig) -> list[list[Any]]:
    """The units of one stage (anything with ``unit_id`` and ``samples_in``) grouped into task runs.

    A Prefect task run costs the API server ~50 ms of CPU (state changes, events), about what encoding a
    small unit costs on a CPU, so units travel in groups: ``runner.units_per_task``, or by default as many
    as leaves every worker two task runs (for balance), at most ``MAX_UNITS_PER_TASK`` (for progress and
    retries on large stages), and fewer task runs when there are fewer than ``MIN_TASK_SAMPLES`` samples
    for each (a refresh's few new samples: one task run, not one per worker).
    """
    units = list(units)
    if not units:
        return []
    samples = sum(unit.samples_in for unit in units)
    runs = min(2 * runner.workers, max(1, samples // MIN_TASK_SAMPLES))
    size = runner.units_per_task or min(MAX_UNITS_PER_TASK, -(-len(units) // runs))
    return [units[i:i + size] for i in range(0, len(units), size)]


def task_runner(runner: RunnerConfig):
    """The Prefect task runner the recipe asks for."""
    if runner.kind == "threads":
        return ThreadPoolTaskRunner(max_workers=runner.workers)
    if runner.kind == "processes":
        import atexit
        import shutil
        import tempfile

        # workers numbered 0, 1, ... by the slot files they lock in here: each keeps to one GPU
        # (stages.workers)
        slot_dir = tempfile.mkdtemp(prefix="latentmill-workers-")
        atexit.register(shutil.rmtree, slot_dir, True)
        return ProcessPoolTaskRunner(
            max_workers=runner.workers, initializer=start_worker, initargs=(slot_dir,)
        )
    if runner.kind == "ray":
        from prefect_ray import RayTaskRunner

        if runner.address:
            return RayTaskRunner(address=runner.address)
        # a local cluster of `workers` CPUs, no dashboard; it stops when the flow ends
        return RayTaskRunner(init_kwargs={"num_cpus": runner.workers, "include_dashboard": False,
                                          "log_to_driver": False})
    from prefect_dask import DaskTaskRunner

    if runner.address:
        return DaskTaskRunner(address=runner.address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": runner.workers, "threads_per_worker": 1})


def release_prep_models() -> int:
    """Forget the encoders, captioning and curate scorer models prep loaded in this process and hand the GPU
    memory they held back to the driver, so that training in this same process (prep-then-train, refresh
    with train) or under torchrun next to it gets whole GPUs. Returns how many model sets were dropped."""
    import gc

    import torch
    from latentmill.stages import curate_models
    from latentmill.stages.captioners.hf import release_models
    from latentmill.stages.families import release_encoders

    count = release_encoders() + release_models() + curate_models.release_models()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return count


def ensure_models(recipe: Recipe) -> None:
    """Build the tiny demo models when ``model.pretrained`` is the tiny recipe's own folder
    (``data/tiny-flux.yaml`` builds ``data/models/tiny-flux``) and that folder is missing; a hub id or another
    folder loads through ``from_pretrained`` as it is (``preflight.tiny_build_target``)."""
    from latentmill.preflight import tiny_build_target

    target = tiny_build_target(recipe.model)
    if target is not None and not (target / "model_index.json").is_file():
        from latentmill.tinyio import ensure_tiny

        # The folder does not exist yet, so its family cannot be read from it: the recipe says it.
        family = "flux" if recipe.model.family == "auto" else recipe.model.family
        print(f"building tiny models from {recipe.model.tiny_recipe} into {recipe.model.pretrained}")
        ensure_tiny(family, recipe.model.pretrained, recipe.model.tiny_recipe)


@flow(name="prep-stages")
def prep_stages(recipe_data: dict, started_run: str | None = None) -> dict[str, Any]:
    """Run ingest → caption → curate → bucket → cache, publish the snapshot; return counts, the snapshot and
    the pictures' index (``prep/plots/index.md``, or None without matplotlib or with ``prep.plots: false``).

    ``started_run``: the id of the flow run the user started (``prep``, ``prep-then-train``, ``refresh``),
    which shows the stage progress, one log line per stage and the artifacts too (see ``latentmill.pipelines.report``).
    SIGINT and SIGTERM stop it between samples (``latentmill.interrupt``): the units in flight are left
    uncommitted, and a served run that its worker cancels is marked Cancelled once they are.
    """
    with interrupt.stop_on_signals():
        return _prep_stages(recipe_data, started_run)


def plan_pending(stage: str, recipe: Recipe, stage_dir: StageDir) -> tuple[list[str], set[str], list[Pending], int]:
    """Plan ``stage`` as the flow runs it: ``(every unit id in plan order, the ids of the units found committed,
    the units to run, the samples of every unit)``, holding ids and sample counts only.

    A unit whose record is committed is reused, without a task run: a refresh that adds 1% of the data pays
    task runs (and worker round trips) for that 1% only. Task runs carry unit ids; the units to run wait in
    the catalog (their payloads are per sample), stored a batch at a time as the plan streams."""
    unit_ids: list[str] = []
    reused: set[str] = set()
    pending: list[Pending] = []
    batch: list[tuple[str, str]] = []
    total = 0
    catalog = stage_dir.catalog
    catalog.put_plan(stage, [])  # the stage's last plan is replaced
    for unit in plan_stage(stage, recipe):
        unit_ids.append(unit.unit_id)
        total += unit.samples_in
        if stage_dir.load_record(unit.unit_id) is not None:
            reused.add(unit.unit_id)
            continue
        pending.append(Pending(unit.unit_id, unit.samples_in))
        batch.append((unit.unit_id, json.dumps(unit.to_json(), separators=(",", ":"))))
        if len(batch) >= PLAN_BATCH:
            catalog.put_plan(stage, batch, replace=False)
            batch = []
    if batch:
        catalog.put_plan(stage, batch, replace=False)
    return unit_ids, reused, pending, total


def _prep_stages(recipe_data: dict, started_run: str | None) -> dict[str, Any]:
    """The body of ``prep_stages``."""
    recipe = recipe_from_dict(recipe_data)
    ensure_models(recipe)
    run_log = RunLog(also=started_run)
    report: dict[str, Any] = {}
    for stage in STAGES:
        interrupt.check()
        start = time.perf_counter()
        stage_dir = stage_dir_for(recipe, stage).ensure()
        unit_ids, reused, pending, total = plan_pending(stage, recipe, stage_dir)
        chunks = [([u.unit_id for u in chunk], sum(u.samples_in for u in chunk))
                  for chunk in task_chunks(pending, recipe.runner)]
        todo = sum(u.samples_in for u in pending)
        del pending
        if stage == "ingest":
            ingest_units = unit_ids  # the inputs' content, for the next prep's unchanged check
        futures = (run_units.map(stage, unmapped(recipe_data), [c[0] for c in chunks], [c[1] for c in chunks])
                   if chunks else [])
        # The UI's progress artifact follows the work to do; none when every unit is reused or the work is
        # one task run (it would only jump from 0 to 100%, for two API calls: a refresh's new data).
        progress = StageProgress(stage, todo, flow_run_id=started_run) if len(chunks) > 1 else None
        with tqdm(total=total, desc=f"{stage:>8}", unit="sample") as bar:
            bar.update(total - todo)
            for future, (_, samples) in zip(futures, chunks):
                wait_result(future)
                bar.update(samples)
                if progress is not None:
                    progress.update(samples)
        records = StageRecords(stage_dir, unit_ids, reused)
        manifest = stage_dir.write_manifest(records, manifest_header(stage, recipe, records))
        report[stage] = stage_report(stage, records, time.perf_counter() - start)
        if stage == "caption":
            report[stage].update(caption.report(recipe.caption, records))
            if "warning" in report[stage]:
                run_log.warning(f"caption: {report[stage]['warning']}")
        if stage == "curate":
            report[stage].update(curate.report(records))
            table = curate.write_scores_table(records, recipe.prep_dir, recipe.curate.active_scorers())
            report[stage]["scores_table"] = str(table) if table else None
            report[stage]["near_duplicates"] = update_near_dups(recipe, stage_dir, records)
        if stage == "bucket":
            report[stage]["buckets"] = bucket.histogram(manifest)
            clips = [int(r.extra["clips_below_threshold"]) for r in records if "clips_below_threshold" in r.extra]
            if clips:  # per-clip verdicts of curate
                report[stage]["clips_below_threshold"] = sum(clips)
        if stage == "cache":
            report[stage].update(cache.component_report(records))
            report[stage]["manifest"] = str(stage_dir.manifest_path)
            merged = auto_compact(recipe, stage_dir)
            if merged is not None:
                report[stage]["compaction"] = merged
        run_log.info(stage_line(stage, report[stage]))
    publish_prep_artifacts(report, recipe.prep_dir, also=[started_run] if started_run else [])
    plots = None
    if recipe.prep.plots:  # only with matplotlib; a failed picture is a warning, never a failed prep
        if publish_prep_plots(recipe.prep_dir, run_log.warning, also=[started_run] if started_run else []):
            plots = str(recipe.prep_dir / PLOTS_DIR / "index.md")
    snapshot = publish_snapshot(recipe.output_dir, recipe.stage_dir("cache"), recipe.prep.eval_fraction,
                                recipe.prep.eval_min_count)
    trackers = log_prep_to_trackers(recipe, report, snapshot)
    publish_tracker_links(trackers, "prep", also=[started_run] if started_run else [])
    return {"stages": report, "snapshot": snapshot, "plots": plots, "ingest_units": ingest_units,
            **({"trackers": trackers} if trackers else {})}


def log_prep_to_trackers(recipe: Recipe, report: dict[str, Any], snapshot: dict[str, Any]) -> dict[str, str | None]:
    """A prep's summary as a ``prep`` run of the recipe's W&B or MLflow project (``trainer.trackers``; TensorBoard
    has no project to share): the recipe, the snapshot and its prep summary, and each stage's counts as
    ``prep/<stage>.<count>``. Returns where each tracker shows it."""
    from latentmill.trainer.trackers import start_trackers

    names = [n for n in recipe.trainer.active_trackers() if n != "tensorboard"]
    if not names:
        return {}
    manifest = json.loads((Path(snapshot["path"]) / "manifest.json").read_text())["snapshot"]
    trackers = start_trackers(names, project=recipe.trainer.tracker_project, run_name=f"prep-{snapshot['name']}",
                              log_dir=recipe.prep_dir, required=recipe.trainer.trackers_required, job_type="prep")
    trackers.log_info(recipe.to_dict(), {"snapshot": snapshot["name"], "snapshot_content_id": manifest["content_id"],
                                         "samples": manifest["samples"], "buckets": manifest["buckets"],
                                         "prep": manifest.get("prep", {})})
    counts = {f"{stage}.{key}": s[key] for stage, s in report.items()
              for key in ("in", "out", "quarantined", "processed", "reused")}
    trackers.log_metrics({"step": 0, **counts}, prefix="prep")
    urls = trackers.urls
    trackers.close()
    return urls


def run_prep(recipe: Recipe, source: str | None = None) -> dict[str, Any]:
    """Run the prep stages with the task runner the recipe asks for, holding the output_dir's writer lock
    (``prep.on_busy``: wait for another writer, or fail naming it; see ``latentmill.pipelines.retention``).

    Called inside a flow run (``prep``, ``prep-then-train``, ``refresh``), that run also gets the progress,
    stage lines and artifacts of the ``prep-stages`` subflow. ``source``: the source folder's signature that the
    caller's unchanged check took before this run (``latentmill.pipelines.unchanged.check``); None: taken here.
    """
    from latentmill.preflight import check_recipe

    check_recipe(recipe, "prep")  # before the lock, the models, the task runner
    if is_url(recipe.output_dir):
        return run_prep_on_store(recipe)
    runner_flow = prep_stages.with_options(task_runner=task_runner(recipe.runner))
    # One writer per output_dir: the CLI, a deployment run and the nodes of a multi-node run all pass here.
    with writer_lock(recipe.output_dir, "prep", on_busy=recipe.prep.on_busy):
        # before the run: a file changed meanwhile is seen next time
        base, source = unchanged.key_base(recipe), source or unchanged.source_signature(recipe)
        result = runner_flow(recipe.to_dict(), started_run=current_run_id())
        units = result.pop("ingest_units")
        unchanged.remember(recipe, result, unchanged.run_key(base, units), units, source)
        return result


def run_prep_on_store(recipe: Recipe) -> dict[str, Any]:
    """``run_prep`` of an ``output_dir`` on an object store (``latentmill.pipelines.objectstore``): under the
    store's writer lease, pull what the store holds into the local work folder but the shards' tars, run the
    prep there while publishing each unit it commits (parts, then record), then the rest (manifests, the
    snapshot, ``LATEST`` last). A unit whose tars are on the store is reused without them; a tar the prep reads
    is downloaded when it is opened, and members read alone are fetched alone (``latentmill.stages.remotetars``).
    The summary's ``store`` says what moved (``downloaded``: files; ``tars_downloaded``, ``ranges_read``: what
    the prep read from the store); its snapshot path is the store's."""
    url = recipe.output_dir.rstrip("/")
    with objectstore.store_lease(url, "prep", on_busy=recipe.prep.on_busy) as lease:
        pulled = objectstore.pull(url, tars=False, list_tars=True)
        work = Path(pulled["work_dir"])
        with objectstore.UnitPublisher(work, url):  # each committed unit, while the prep runs
            result = run_prep(recipe_from_dict({**recipe.to_dict(), "output_dir": str(work)}))
        pushed = objectstore.push(work, url, lease)
    read = remotetars.fetched(work / "prep")
    result["snapshot"]["path"] = objectstore.published_path(url, work, result["snapshot"]["path"])
    result["store"] = {"url": url, "work_dir": str(work), "downloaded": pulled["downloaded"] + read["tars"],
                       "bytes_downloaded": pulled["bytes"] + read["tar_bytes"], "tars_downloaded": read["tars"],
                       "ranges_read": read["ranges"], "range_bytes": read["range_bytes"],
                       "uploaded": pushed["uploaded"], "bytes_uploaded": pushed["bytes"]}
    return result


@flow(name="prep")
def prep(config: str = "configs/demo.yaml", overrides: list[str] | None = None,
         source_signature: str | None = None) -> dict[str, Any]:
    """Prepare a latent cache and publish its snapshot: ``{"stages": {...}, "snapshot": {...}}``.

    ``source_signature``: the command line's unchanged check's signature of the source folder (``run_prep``'s
    ``source``), so that one command walks the folder once."""
    return run_prep(load_recipe(config, overrides), source_signature)


@flow(name="prep")
def prep_recipe(recipe: dict) -> dict[str, Any]:
    """``prep`` of a recipe given as a dict (``Recipe.to_dict()``; see ``latentmill.api``)."""
    return run_prep(recipe_from_dict(recipe))
