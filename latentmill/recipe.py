"""A recipe: the typed configs of every room, composed. YAML and Python users build the same object.

    recipe = load_recipe("configs/demo.yaml", ["trainer.max_steps=200"])
    recipe = Recipe(output_dir="outputs/x", model=ModelConfig(pretrained="black-forest-labs/FLUX.1-dev"))
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from latentmill.core.config import ConfigError, apply_overrides, from_dict, load_yaml, to_dict
from latentmill.models import ModelConfig
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache_config import CacheConfig
from latentmill.stages.caption import CaptionConfig
from latentmill.stages.compact import CompactionConfig
from latentmill.stages.curate import CurateConfig
from latentmill.stages.ingest import IngestConfig
from latentmill.trainer.config import LoaderConfig, ParallelConfig, TrainerConfig


@dataclass
class RunnerConfig:
    """How the prep flow runs stage work units: threads, processes, or a Dask or Ray cluster."""

    kind: Literal["threads", "processes", "dask", "ray"] = "threads"
    workers: int = 2  # threads, processes, or workers (CPUs) of the local Dask / Ray cluster
    address: Optional[str] = None  # an existing cluster: tcp://host:8786 (Dask) or ray://host:10001 / auto (Ray)
    units_per_task: int = 0  # work units per Prefect task run; 0: auto (two task runs per worker, <= 16 units)

    def validate(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"runner.workers: must be >= 1, got {self.workers}")
        if self.units_per_task < 0:
            raise ConfigError(f"runner.units_per_task: must be >= 0 (0 = auto), got {self.units_per_task}")
        for kind, package in (("dask", "prefect_dask"), ("ray", "prefect_ray")):
            if self.kind == kind and importlib.util.find_spec(package) is None:
                raise ConfigError(f"runner.kind: {kind!r} needs the {package.replace('_', '-')} package (pip "
                                  f"install 'latentmill[{kind}]'); allowed without it: 'threads', 'processes'")


@dataclass
class PrepConfig:
    """How a prep behaves around others on the same output_dir, and what it draws at its end."""

    # When another prep, gc or compaction holds the output_dir's writer lock: ``wait`` for it (saying so)
    # or ``fail`` at once with a message naming it. ``wait`` by default: the nodes of a multi-node
    # ``latentmill run`` prep in turn through this lock, and a nightly refresh that starts while a manual
    # prep runs should queue behind it, not be lost.
    on_busy: Literal["wait", "fail"] = "wait"
    # At the end of a prep, draw its pictures into <output_dir>/prep/plots and show them as the ``prep-plots``
    # Prefect artifact (latentmill.plots; only when matplotlib is installed: latentmill[plots]). Cost: the
    # scores table and manifests, plus decoding at most 48 quarantined samples per reason.
    plots: bool = True
    # The held-out set the trainer evaluates on and never trains on (pipelines/snapshot.py ``held_out``): the
    # samples whose key hashes below this fraction, at least eval_min_count of them, at most a quarter of the
    # snapshot; 0 turns it off. On by default so that every run can report a loss on data it never trained on.
    eval_fraction: float = 0.02
    eval_min_count: int = 8

    def validate(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"prep.eval_fraction: must be in [0, 1) (0 turns the held-out set off), got "
                              f"{self.eval_fraction}")
        if self.eval_min_count < 0:
            raise ConfigError(f"prep.eval_min_count: must be >= 0, got {self.eval_min_count}")


@dataclass
class RetentionConfig:
    """What the ``refresh`` flow keeps after publishing (``latentmill gc`` with the same rule)."""

    keep_snapshots: Optional[int] = None  # newest N snapshots (plus pinned ones); null: keep everything

    def validate(self) -> None:
        if self.keep_snapshots is not None and self.keep_snapshots < 1:
            raise ConfigError(f"retention.keep_snapshots: must be >= 1 or null (keep all), got {self.keep_snapshots}")


@dataclass
class Recipe:
    """Everything one prep + train run needs."""

    output_dir: str
    model: ModelConfig
    seed: int = 0
    snapshot: str = "latest"  # the dataset snapshot training reads: "latest" or a published name
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)
    curate: CurateConfig = field(default_factory=CurateConfig)
    bucket: BucketConfig = field(default_factory=BucketConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    prep: PrepConfig = field(default_factory=PrepConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    # A pod's persistent volume (absolute path); else $LATENTMILL_VOLUME. A relative output_dir goes under it,
    # and the CLI puts HF_HOME, the weight-hash store and PREFECT_HOME there (latentmill.volume).
    volume: Optional[str] = None
    compaction: CompactionConfig = field(default_factory=CompactionConfig)

    def validate(self) -> None:
        """Check ``volume`` and place a relative ``output_dir`` under the volume in force (recipe key, else
        ``$LATENTMILL_VOLUME``); an absolute ``output_dir`` is explicit and wins."""
        from latentmill.models import known_families
        from latentmill.volume import check_volume, resolve_output_dir, volume_root

        if self.model.family != "auto" and self.model.family not in known_families():
            raise ConfigError(f"model.family: {self.model.family!r} is not a known family; allowed: 'auto', "
                              f"{', '.join(repr(f) for f in known_families())}")
        self.volume = check_volume(self.volume)
        self.output_dir = resolve_output_dir(self.output_dir, volume_root(self.volume)[0])

    # Where each room writes, under output_dir.
    @property
    def prep_dir(self) -> Path:
        return Path(self.output_dir) / "prep"

    def stage_dir(self, stage: str) -> Path:
        return self.prep_dir / stage

    @property
    def train_dir(self) -> Path:
        return Path(self.output_dir) / f"train{self.expert_suffix}"

    @property
    def export_dir(self) -> Path:
        return Path(self.output_dir) / f"export{self.expert_suffix}"

    @property
    def expert_suffix(self) -> str:
        """``-<trainer.expert>`` (else empty): the runs of each expert of a two-expert pipeline (Wan 2.2 A14B)
        on one snapshot have their own train folder (``resume: latest`` finds the expert's own run) and
        export links."""
        return f"-{self.trainer.expert}" if self.trainer.expert else ""

    def to_dict(self) -> dict:
        return to_dict(self)


def recipe_from_dict(data: dict) -> Recipe:
    """Validate a plain dict (YAML-shaped) into a Recipe; errors name the key and allowed values."""
    return from_dict(Recipe, data)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (a file, or the name of a shipped example: ``demo``), apply ``key.path=value``
    overrides, validate. Relative paths are CWD-relative, except an example recipe's ``data/...`` paths,
    which name the shipped data (:mod:`latentmill.resources`)."""
    from latentmill.resources import anchor_data_paths, find_recipe

    found, example = find_recipe(path)
    data = load_yaml(found)
    if example:
        data = anchor_data_paths(data)
    return recipe_from_dict(apply_overrides(data, overrides or []))
