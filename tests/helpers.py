"""Test helpers shared by several test modules."""

from __future__ import annotations

from typing import Any

from latentmill.recipe import Recipe
from pipelines.prep import STAGES, manifest_header, plan_stage, stage_processor
from stages.shardio import StageDir, UnitRecord


def prep_in_process(recipe: Recipe) -> dict[str, tuple[StageDir, dict[str, Any], list[UnitRecord]]]:
    """Run the four prep stages in this process (no Prefect) through the flow's own plan/process/header."""
    result = {}
    for name in STAGES:
        sd = StageDir(recipe.stage_dir(name), name).ensure()
        records = [sd.run_unit(u, stage_processor(name, recipe)) for u in plan_stage(name, recipe)]
        result[name] = (sd, sd.write_manifest(records, manifest_header(name, recipe)), records)
    return result
