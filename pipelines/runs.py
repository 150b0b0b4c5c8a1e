"""Training runs: each in a folder of its own, found again by its recipe and snapshot; nothing is deleted.

::

    <output_dir>/train/runs/<key>/      run.json, recipe.json, metrics.jsonl, checkpoints/, tb/, validation/, export/,
                                        sample.png (the demo)
    <output_dir>/train/LATEST           the name of the run started last
    <output_dir>/train/metrics.jsonl    -> runs/<LATEST>/metrics.jsonl
    <output_dir>/export                 -> train/runs/<newest full fine-tune>/export   (a Diffusers pipeline)
    <output_dir>/export-lora            -> train/runs/<newest LoRA run>/export         (a LoRA adapter)
    (trainer.expert of a two-expert pipeline: train-<expert>/, export-<expert>, export-lora-<expert>)

A run's ``<key>`` is a hash of what decides its weights: the snapshot it reads, the trainer and parallel
settings (all of them but ``trainer.resume``), the model, the seed and the world size. The rules:

* ``trainer.resume: null`` with the key of a finished run: nothing is trained again; the summary of that run
  is returned (``already_trained``). Change the recipe, or train on a new snapshot, to train again.
* ``trainer.resume: null`` otherwise: the run's folder (a fresh one, or the same key's unfinished one,
  whose checkpoints are set aside as ``checkpoints.previous-N``, never deleted).
* ``trainer.resume: latest``: the latest checkpoint of the run started last (``LATEST``), whatever its key (a
  requeued job, a longer schedule); with no checkpoint anywhere, a fresh run from step 0, said in one line.
* ``trainer.resume: <checkpoint path>``: in the folder of the run that checkpoint belongs to.

Full and LoRA exports live in their runs' folders and never overwrite each other; the two links name the
newest of each. Outputs of the layout before runs (``train/checkpoints``, ``train/metrics.jsonl``,
``export/``) move once into ``train/runs/0000-legacy/``, where ``resume: latest`` finds them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from latentmill.core import durable
from latentmill.core.config import to_dict
from latentmill.core.hashing import stable_hash
from latentmill.recipe import Recipe

LATEST = "LATEST"
LEGACY = "0000-legacy"
RUN_FILE = "run.json"
RECIPE_FILE = "recipe.json"  # the resolved recipe of the run's latest start (``latentmill compare`` diffs it)
# Trainer keys that say how a run is carried out, not what it learns: a change trains nothing again.
RUN_SETTINGS = ("resume", "cpu_threads")


@dataclass
class RunPlan:
    """Where a training run writes, and the summary of the finished run when there is nothing to do."""

    folder: Path
    key: str
    done: dict[str, Any] | None = None


def local_recipe(recipe: Recipe) -> Recipe:
    """The recipe whose runs live here: an ``output_dir`` on an object store trains in its local work folder
    (``latentmill.core.store.work_dir_for``), which ``latentmill.pipelines.storeruns.RunPublisher`` publishes."""
    from latentmill.core.store import is_url, work_dir_for

    if not is_url(recipe.output_dir):
        return recipe
    return dataclasses.replace(recipe, output_dir=str(work_dir_for(recipe.output_dir)))


def runs_dir(recipe: Recipe) -> Path:
    return recipe.train_dir / "runs"


def run_key(recipe: Recipe, snapshot: str, world_size: int) -> str:
    """What decides a run's weights: snapshot, trainer settings but how to run them (``resume``,
    ``cpu_threads``), parallel, model, seed, world."""
    trainer = {k: v for k, v in to_dict(recipe.trainer).items() if k not in RUN_SETTINGS}
    return stable_hash({"snapshot": snapshot, "trainer": trainer, "parallel": to_dict(recipe.parallel),
                        "model": to_dict(recipe.model), "seed": recipe.seed, "world_size": world_size})


def read_run(folder: Path) -> dict[str, Any]:
    """A run's ``run.json`` (empty for a legacy run)."""
    path = folder / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def latest_run(recipe: Recipe) -> Path | None:
    """The folder of the run started last, or None."""
    pointer = recipe.train_dir / LATEST
    if not pointer.is_file():
        return None
    folder = runs_dir(recipe) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def relink(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` (a relative symlink, replaced atomically; a stable path to the newest)."""
    durable.symlink(link, target)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    durable.write_json(path, data)


def migrate_legacy(recipe: Recipe) -> None:
    """Move outputs of the layout before runs into ``train/runs/0000-legacy`` (nothing is deleted)."""
    train, out = recipe.train_dir, Path(recipe.output_dir)
    legacy = runs_dir(recipe) / LEGACY
    names = ["checkpoints", "metrics.jsonl", "tb", "validation", "metrics.previous.jsonl", "checkpoints.previous"]
    found = [train / n for n in names if (train / n).exists() and not (train / n).is_symlink()]
    export = out / "export"
    old_export = export.is_dir() and not export.is_symlink()
    if not found and not old_export:
        return
    legacy.mkdir(parents=True, exist_ok=True)
    for path in found:
        os.replace(path, legacy / path.name)
    if old_export:
        os.replace(export, legacy / "export")
        relink(export, legacy / "export")
    durable.write_text(train / LATEST, LEGACY + "\n")
    if (legacy / "metrics.jsonl").exists():
        relink(train / "metrics.jsonl", legacy / "metrics.jsonl")
    print(f"train: moved the outputs of an earlier layout into {legacy}")


def _start(recipe: Recipe, folder: Path, key: str, snapshot: str) -> RunPlan:
    """Make ``folder`` the run started last: its ``run.json``, ``LATEST`` and the metrics link."""
    folder.mkdir(parents=True, exist_ok=True)
    record = read_run(folder)
    if not record or record.get("key") != key:
        _write_json(folder / RUN_FILE, {"key": key, "snapshot": snapshot, "mode": recipe.trainer.mode,
                                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        "finished": False, **({"resumed_from": record} if record else {})})
    _write_json(folder / RECIPE_FILE, recipe.to_dict())
    durable.write_text(recipe.train_dir / LATEST, folder.name + "\n")
    relink(recipe.train_dir / "metrics.jsonl", folder / "metrics.jsonl")
    return RunPlan(folder, key)


def _has_checkpoint(folder: Path) -> bool:
    return any((folder / "checkpoints").glob("step-*"))


def plan_run(recipe: Recipe, snapshot: str, world_size: int = 1) -> RunPlan:
    """Decide where this training run writes, or find that it already ran (see the module docstring)."""
    recipe.train_dir.mkdir(parents=True, exist_ok=True)
    migrate_legacy(recipe)
    key = run_key(recipe, snapshot, world_size)
    resume = recipe.trainer.resume
    if resume == "latest":
        latest = latest_run(recipe)
        if latest is not None and _has_checkpoint(latest):
            return _start(recipe, latest, key, snapshot)
        # else: a fresh run; the trainer says in one line that it found no checkpoint
    elif resume:
        checkpoint = Path(resume).resolve()
        for folder in (checkpoint.parent.parent, checkpoint.parent.parent.parent):
            if folder.parent == runs_dir(recipe).resolve():  # .../runs/<run>/checkpoints/step-N[/...]
                return _start(recipe, folder, key, snapshot)
    else:
        folder = runs_dir(recipe) / key[:16]
        record = read_run(folder)
        if record.get("finished") and record.get("key") == key:
            return RunPlan(folder, key, done={**record["summary"], "already_trained": True})
    return _start(recipe, runs_dir(recipe) / key[:16], key, snapshot)


def join_run(recipe: Recipe, snapshot: str, world_size: int, name: str) -> RunPlan:
    """The run folder ``name`` that another node of the same training on several nodes chose
    (``objectstore.training_lease``), made the run started last here too: every node trains into one folder."""
    recipe.train_dir.mkdir(parents=True, exist_ok=True)
    return _start(recipe, runs_dir(recipe) / name, run_key(recipe, snapshot, world_size), snapshot)


@contextmanager
def training_run(recipe: Recipe, world: int, rendezvous: str | None = None) -> Iterator[RunPlan]:
    """Plan a training of ``recipe`` on ``world`` processes and hold what it needs while the body trains: the
    output's training lock, so a second training is refused in one line (``rendezvous``: a training on several
    nodes, each running the same command; they join the first node's lock). ``plan.done`` set: the same recipe
    already trained on the same snapshot, nothing to do.

    An ``output_dir`` on an object store trains in the local work folder (:func:`local_recipe`), under the
    store's training lease: the snapshot's manifests and indexes and the runs are pulled first (its shards
    stream), a node joining a training on several nodes takes the run folder the lease holder recorded (nodes
    start at different times), and while the body trains the run is published there (each node its ranks'
    parts of the checkpoints, global rank 0's node the rest: ``storeruns.RunPublisher``) and its snapshot
    pinned (a gc there keeps it). ``latentmill train`` and ``deploy/launch.sh``'s node step both pass here."""
    from latentmill.pipelines.objectstore import pinned_on_store, pull, training_lease
    from latentmill.pipelines.retention import training_lock
    from latentmill.pipelines.snapshot import resolve_snapshot
    from latentmill.pipelines.storeruns import RunPublisher, pull_runs

    from latentmill.core.store import check_store

    local = local_recipe(recipe)
    on_store = local is not recipe
    with ExitStack() as held:
        lease = None
        if on_store:
            check_store(recipe.output_dir)
            # before the runs are pulled and a run folder chosen: a second training changes nothing there
            lease = held.enter_context(training_lease(recipe.output_dir, rendezvous=rendezvous))
            pull(recipe.output_dir, Path(local.output_dir), tars=False)  # manifests and indexes; shards stream
            pull_runs(recipe.output_dir, Path(local.output_dir))  # the checkpoints a resume reads
        else:  # under torchrun this process holds it, not the ranks
            held.enter_context(training_lock(recipe.output_dir, rendezvous))
        snapshot = resolve_snapshot(local.output_dir, recipe.snapshot).name  # clear error if prep has not run
        if lease is not None and lease.joined:
            chosen = lease.recorded("run")
            plan = join_run(local, snapshot, world, chosen["run"])
            if chosen.get("done"):
                plan.done = {"already_trained": True, "run_dir": str(plan.folder)}
        else:
            plan = plan_run(local, snapshot, world)
            if lease is not None and rendezvous is not None:
                lease.record(run=plan.folder.name, done=plan.done is not None)
        if plan.done is not None:
            print(f"train: already trained on snapshot {snapshot} with this recipe, in {plan.folder} "
                  "(nothing to redo; change the recipe or the data to train again)", flush=True)
        else:
            check_resume_batch(recipe, plan.folder, world)
            if on_store:
                held.enter_context(RunPublisher(Path(local.output_dir), recipe.output_dir,
                                                lease=None if lease is None or lease.joined else lease,
                                                run_dir=plan.folder if rendezvous is not None else None))
                held.enter_context(pinned_on_store(recipe.output_dir, snapshot))
        yield plan


def check_resume_batch(recipe: Recipe, run_folder: str | Path, world: int) -> None:
    """Fail before torchrun starts when the checkpoint the run resumes trains a global batch that ``world``
    processes cannot split evenly (the trainer checks it again on every rank)."""
    from latentmill.trainer.checkpoint import read_trainer_state, resolve_resume
    from latentmill.trainer.loader import resume_batch_size

    path = resolve_resume(recipe.trainer.resume, Path(run_folder) / "checkpoints", announce=False)
    if path is not None:
        saved = read_trainer_state(path).get("loader", {})
        resume_batch_size(saved, recipe.trainer.batch_size, world // recipe.parallel.cp_size, str(path))


def export_link(recipe: Recipe, mode: str) -> Path:
    """The stable path of the newest export of ``mode``: ``<output_dir>/export`` or ``export-lora`` (one expert of
    a two-expert pipeline: ``export-high``, ``export-lora-low``...)."""
    return Path(recipe.output_dir) / (("export-lora" if mode == "lora" else "export") + recipe.expert_suffix)


def finish_run(recipe: Recipe, plan: RunPlan, summary: dict[str, Any]) -> dict[str, Any]:
    """Record a finished run; point the export link of its mode at its export. Returns the summary with
    ``run_dir`` and ``export_dir`` (the link)."""
    summary = {**summary, "run_dir": str(plan.folder)}
    exported = summary.get("export_dir")
    if exported:
        link = export_link(recipe, recipe.trainer.mode)
        if link.is_dir() and not link.is_symlink():  # a folder the user made there: never replaced
            print(f"train: {link} is a folder, not a link; the export stays in {exported}")
        else:
            relink(link, Path(exported))
            summary["export_dir"] = str(link)
    record = read_run(plan.folder)
    _write_json(plan.folder / RUN_FILE, {**record, "key": plan.key, "finished": True,
                                         "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "summary": summary})
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m latentmill.pipelines.runs RECIPE_JSON WORLD_SIZE RENDEZVOUS -- COMMAND...``: one node of a
    launcher (``deploy/launch.sh``). Under the output's training lock or, on an object store, its training lease
    (``RENDEZVOUS`` names a training on several nodes, whose nodes join the first's; empty on one node), plan the
    run (:func:`training_run`), then run ``COMMAND`` (torchrun) with the run's folder appended, and exit with its
    status. Nothing runs (exit 0) when the same recipe already trained on the same snapshot. A stop (SIGINT,
    SIGTERM) goes to the ranks once, as ``latentmill train`` does."""
    import socket

    from latentmill.pipelines.retention import OutputBusyError

    from latentmill import interrupt
    from latentmill.recipe import recipe_from_dict

    args = argv if argv is not None else sys.argv[1:]
    (recipe_json, world_size, rendezvous), command = args[:3], args[args.index("--") + 1:]
    recipe = recipe_from_dict(json.loads(Path(recipe_json).read_text()))
    try:
        with training_run(recipe, int(world_size), rendezvous or None) as plan:
            if plan.done is not None:
                return 0
            print(f"[latentmill] {socket.gethostname()}: {' '.join(command)} in {plan.folder}", file=sys.stderr,
                  flush=True)
            code, stopped_by = interrupt.run_ranks([*command, str(plan.folder)])
            # ranks stopped by a signal save their step and end as after a finished run: say it was a stop
            return 128 + stopped_by if stopped_by is not None and code == 0 else code
    except OutputBusyError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
