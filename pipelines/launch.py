"""Entry point of one training process under torchrun: ``python -m latentmill.pipelines.launch RECIPE_JSON SUMMARY_JSON RUN_DIR``.

`latentmill train CONFIG --nproc N` writes the validated recipe to JSON and starts
``torchrun --standalone --nproc-per-node N -m latentmill.pipelines.launch RECIPE_JSON SUMMARY_JSON RUN_DIR``; every rank
trains in the run folder, rank 0 writes the summary.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from latentmill.trainer.stream import StreamSource

from latentmill.core.store import is_url, work_dir_for
from latentmill.interrupt import Interrupted
from latentmill.models import check_cache_compatible
from latentmill.recipe import Recipe, recipe_from_dict


def train_recipe(recipe: Recipe, run_dir: str | Path, progress: bool = True,
                 on_step: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Train on the recipe's dataset snapshot (refusing one made by other models) in the run folder
    ``run_dir`` (``latentmill.pipelines.runs.plan_run`` chose it) and export into ``<run_dir>/export``.

    ``on_step(record)``: called with each step's metrics record on rank 0 (see ``latentmill.trainer.train``).
    """
    from latentmill.pipelines.retention import pinned_for_training
    from latentmill.trainer import train

    # The snapshot stays pinned while this process reads it: a gc meanwhile keeps it (pipelines.retention).
    with (nullcontext(None) if is_url(recipe.output_dir) else pinned_for_training(recipe.output_dir,
                                                                                 recipe.snapshot)) as cache_dir:
        stream = None
        if cache_dir is None:  # on a store: its manifest pulled into the work folder, its shards streamed
            cache_dir, stream = stream_source(recipe)
        manifest = json.loads((cache_dir / "manifest.json").read_text())
        run_dir = Path(run_dir)
        return train(
            recipe.trainer,
            cache_dir=cache_dir,
            pretrained=recipe.model.pretrained,
            train_dir=run_dir,
            seed=recipe.seed,
            export_dir=run_dir / "export",
            parallel=recipe.parallel,
            progress=progress,
            check_cache=lambda manifest: check_cache_compatible(manifest, recipe.model, _family(recipe)),
            on_step=on_step,
            provenance={"snapshot": cache_dir.name, "snapshot_content_id": manifest["snapshot"]["content_id"],
                        "run": run_dir.name, "output_dir": str(recipe.output_dir),
                        "pretrained": recipe.model.pretrained, "mode": recipe.trainer.mode},
            recipe=recipe.to_dict(),
            stream=stream,
            loader=recipe.loader,
        )


def stream_source(recipe: Recipe) -> tuple[Path, StreamSource]:
    """An ``output_dir`` on a store: the snapshot's folder in the work folder (its manifest, pulled by
    ``run_train``) and where its shards stream from and to (``loader.cache_dir``, else ``<work>/stream-cache``)."""
    from latentmill.pipelines.objectstore import published_path
    from latentmill.pipelines.snapshot import resolve_snapshot

    work = work_dir_for(recipe.output_dir)
    folder = resolve_snapshot(work, recipe.snapshot)
    cache = recipe.loader.cache_dir or str(work / "stream-cache")
    return folder, StreamSource(published_path(recipe.output_dir, work, str(folder)), cache,
                                recipe.loader.limit_bytes, str(folder))


def _family(recipe: Recipe) -> str | None:
    """The recipe's model family, or None when it cannot be read here (a hub id not downloaded)."""
    from latentmill.stages.families import detect_family

    try:
        return detect_family(recipe.model)
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) < 3:
        sys.exit("usage: python -m latentmill.pipelines.launch RECIPE_JSON SUMMARY_JSON RUN_DIR (RUN_DIR: "
                 "`python -m latentmill.pipelines.runs RECIPE_JSON WORLD_SIZE RENDEZVOUS -- COMMAND` plans it)")
    recipe_json, summary_json, run_dir = args[:3]
    recipe = recipe_from_dict(json.loads(Path(recipe_json).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and is_url(recipe.output_dir):  # its node publishes the run's files (storeruns.RunPublisher)
        from latentmill.pipelines.storeruns import RANK0_MARKER

        (Path(run_dir) / RANK0_MARKER).touch()
    try:
        summary = train_recipe(recipe, run_dir, progress=rank == 0)
    except Interrupted:  # SIGINT or SIGTERM: every rank stopped after the same step (trainer.train)
        # 0: torchrun takes any other status for a failed worker and prints its error report; the command
        # that launched torchrun asked for the stop (pipelines.flows._stop_ranks) and says it in one line
        return 0
    if rank == 0:  # the run is finished: record it, link its export
        from latentmill.pipelines.runs import RunPlan, finish_run, local_recipe, run_key

        world = int(os.environ.get("WORLD_SIZE", "1"))
        summary = finish_run(local_recipe(recipe), RunPlan(Path(run_dir), run_key(recipe, summary["snapshot"], world)),
                             summary)
        Path(summary_json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
