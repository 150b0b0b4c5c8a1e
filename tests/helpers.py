"""Test helpers shared by several test modules."""

from __future__ import annotations

from latentmill.pipelines.prep import run_stages_in_process as prep_in_process  # noqa: F401  (the stages, no Prefect)
