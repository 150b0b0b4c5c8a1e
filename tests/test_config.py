"""Recipes: YAML + dotted overrides into typed configs; bad values fail early and say what is allowed."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from latentmill.core.config import ConfigError, apply_overrides, from_dict, parse_override
from latentmill.recipe import Recipe, load_recipe, recipe_from_dict
from tests.conftest import DEMO_CONFIG


def test_demo_recipe_loads_with_overrides():
    recipe = load_recipe(DEMO_CONFIG, ["trainer.max_steps=7", "ingest.source=/x", "cache.dtype=bfloat16"])
    assert isinstance(recipe, Recipe)
    assert recipe.trainer.max_steps == 7
    assert recipe.ingest.source == "/x"
    assert recipe.cache.dtype == "bfloat16"
    assert recipe.bucket.resolution == 128
    # an example recipe's data paths name the shipped data; its output_dir stays relative to the caller
    assert recipe.model.pretrained == str(DEMO_CONFIG.parents[1] / "data" / "models" / "tiny-flux")
    assert recipe.model.tiny_recipe == str(DEMO_CONFIG.parents[1] / "data" / "tiny-flux.yaml")
    assert recipe.output_dir == "outputs/demo" and str(recipe.train_dir) == "outputs/demo/train"
    assert load_recipe("demo").to_dict() == load_recipe(DEMO_CONFIG).to_dict()  # by name, from any folder


def test_override_values_parse_as_yaml():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert apply_overrides({"a": {"b": 1}}, ["a.c=x"]) == {"a": {"b": 1, "c": "x"}}
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("trainer.max_steps")


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.mode=ful", r"trainer.mode: 'ful' is not one of 'full', 'lora'"),
        ("parallel.strategy=zero3", r"parallel.strategy: 'zero3' is not one of 'none', 'ddp', 'fsdp2'"),
        ("runner.kind=k8s", r"runner.kind: 'k8s' is not one of 'threads', 'processes', 'dask', 'ray'"),
        ("trainer.max_steps=lots", r"trainer.max_steps: expected an integer"),
        ("trainer.max_step=5", r"unknown key trainer.max_step; did you mean trainer.max_steps\? allowed keys under "
                               r"trainer: .*max_steps"),
        ("cache.dtype=fp8", r"cache.dtype: 'fp8' is not one of 'float32', 'bfloat16', 'float16'"),
        ("bucket.step=10", r"bucket.step: must be a positive multiple of 16"),
        ("trainer.max_steps=0", r"trainer.max_steps: must be >= 1"),
        ("cache.prefetch=sometimes", r"cache.prefetch: 'sometimes' does not fit bool or 'auto'"),
        ("cache.vae_tiling=always", r"cache.vae_tiling: 'always' is not one of 'auto', 'never'"),
        ("trainer.trackers=[wandb,comet]", r"trainer.trackers: 'comet' is not a known tracker; known: 'tensorboard', "
                                           r"'wandb', 'mlflow'"),
    ],
)
def test_bad_values_name_the_key_and_allowed_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(DEMO_CONFIG, [override])


def test_missing_required_key():
    with pytest.raises(ConfigError, match="model: required"):
        recipe_from_dict({"output_dir": "x"})
    with pytest.raises(ConfigError, match="unknown key colour"):
        recipe_from_dict({"output_dir": "x", "model": {"pretrained": "p"}, "colour": 1})


def test_inspect_prints_the_full_recipe_which_loads_back(capsys):
    import yaml

    from latentmill.cli import main

    assert main(["inspect", str(DEMO_CONFIG)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    full = load_recipe(DEMO_CONFIG)
    assert printed == full.to_dict()
    assert recipe_from_dict(printed).to_dict() == full.to_dict()
    assert printed["trainer"]["max_steps"] == 400 and "lora_rank" in printed["trainer"]


def test_launch_layouts_and_their_errors():
    from latentmill.pipelines.flows import Launch, check_launch

    recipe = load_recipe(DEMO_CONFIG, ["parallel.strategy=fsdp2"])
    assert Launch(4).torchrun_args() == ["--standalone", "--nproc-per-node=4"]
    multi = Launch(8, nnodes=2, rdzv_endpoint="node0:29500")
    assert multi.torchrun_args() == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                                     "--rdzv-endpoint=node0:29500", "--rdzv-id=latentmill"]
    check_launch(recipe, multi)
    with pytest.raises(ConfigError, match="--nnodes > 1 needs --rdzv-endpoint"):
        check_launch(recipe, Launch(8, nnodes=2))
    with pytest.raises(ConfigError, match="16 processes need parallel.strategy 'ddp' or 'fsdp2'"):
        check_launch(load_recipe(DEMO_CONFIG), Launch(8, nnodes=2, rdzv_endpoint="h:1"))


def test_each_rank_trains_on_a_gpu_of_its_own():
    """A rank's GPU is its local rank among the GPUs it sees (0 when a launcher gave it one); a node with
    GPUs refuses more processes than GPUs before any work (NCCL refuses two ranks on one GPU)."""
    from latentmill.pipelines.flows import check_gpus_per_node
    from latentmill.trainer.parallel import local_gpu

    assert [local_gpu(rank, 8) for rank in range(8)] == list(range(8))
    assert [local_gpu(rank, 1) for rank in range(4)] == [0, 0, 0, 0]  # CUDA_VISIBLE_DEVICES: one per rank
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        local_gpu(0, 0)
    check_gpus_per_node(8, 8)
    check_gpus_per_node(4, 0)  # no GPU: gloo on the CPU, any count
    with pytest.raises(ConfigError, match="--nproc 4: this node has 2 GPUs, one process trains per GPU"):
        check_gpus_per_node(4, 2)


def test_units_travel_a_few_per_task_run():
    from latentmill.pipelines.prep import MAX_UNITS_PER_TASK, MIN_TASK_SAMPLES, task_chunks
    from latentmill.stages.shardio import WorkUnit

    from latentmill.recipe import RunnerConfig

    def units(n, samples=MIN_TASK_SAMPLES):
        return [WorkUnit(f"u{i:04d}", [], {}, samples) for i in range(n)]

    def sizes(n, samples=MIN_TASK_SAMPLES, **runner):
        return [len(c) for c in task_chunks(units(n, samples), RunnerConfig(**runner))]

    assert sizes(0) == [] and sizes(1) == [1] and sizes(3) == [1, 1, 1]
    assert sizes(15, workers=2) == [4, 4, 4, 3]  # two task runs per worker
    # a few new samples (a refresh): one task run, or as many as MIN_TASK_SAMPLES-sample groups allow
    assert sizes(5, samples=2, workers=2) == [5]
    assert sizes(6, samples=MIN_TASK_SAMPLES // 2, workers=2) == [2, 2, 2]
    assert sizes(5, samples=2, workers=2, units_per_task=1) == [1] * 5  # the recipe's choice wins
    assert sizes(1000, workers=2) == [MAX_UNITS_PER_TASK] * 62 + [8]  # progress and retries stay fine-grained
    assert sizes(10, workers=2, units_per_task=1) == [1] * 10
    chunks = task_chunks(units(15), RunnerConfig(workers=2))
    assert [u.unit_id for c in chunks for u in c] == [u.unit_id for u in units(15)]  # every unit, once, in order
    with pytest.raises(ConfigError, match="runner.units_per_task: must be >= 0"):
        RunnerConfig(units_per_task=-1).validate()


def test_a_malformed_override_is_named_in_one_line():
    with pytest.raises(ConfigError) as err:
        parse_override("bucket.aspect_ratios=[0.75,1.0")
    assert str(err.value).startswith("override 'bucket.aspect_ratios=[0.75,1.0': cannot parse the value")
    assert "\n" not in str(err.value)


def test_a_malformed_recipe_is_named_with_its_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  max_steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"recipe .*bad.yaml line \d+: not valid YAML") as err:
        load_recipe(path)
    assert "\n" not in str(err.value)


@dataclasses.dataclass
class _Numbers:
    rate: float = 0.0
    maybe: float | None = None
    name: str = ""


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("1E5", 1e5), ("-2.5e-3", -2.5e-3), ("+3e2", 300.0)])
def test_float_keys_take_scientific_notation(text, value):
    # PyYAML (YAML 1.1) reads all but -2.5e-3 as strings; float-typed keys must still take them as numbers
    raw = yaml.safe_load(f"{{rate: {text}, maybe: {text}, name: '{text}'}}")
    numbers = from_dict(_Numbers, raw)
    assert numbers.rate == value and isinstance(numbers.rate, float)
    assert numbers.maybe == value and numbers.name == text


def test_learning_rate_override_takes_scientific_notation():
    recipe = load_recipe(DEMO_CONFIG, ["trainer.learning_rate=1e-4", "trainer.adam_eps=1E-8"])
    assert recipe.trainer.learning_rate == 1e-4 and isinstance(recipe.trainer.learning_rate, float)
    assert recipe.trainer.adam_eps == 1e-8


def test_float_keys_take_scientific_notation_in_recipes(tmp_path):
    text = DEMO_CONFIG.read_text()
    assert "learning_rate: 1.0e-3" in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("learning_rate: 1.0e-3", "learning_rate: 1e-3\n  adam_eps: 1E-8"))
    recipe = load_recipe(path)
    assert recipe.trainer.learning_rate == 1e-3 and recipe.trainer.adam_eps == 1e-8


def test_numeric_looking_strings_stay_strings_for_string_keys():
    recipe = load_recipe(DEMO_CONFIG, ["ingest.source=1e5"])
    assert recipe.ingest.source == "1e5"
    with pytest.raises(ConfigError, match="trainer.learning_rate: expected a number, got 'fast'"):
        load_recipe(DEMO_CONFIG, ["trainer.learning_rate=fast"])
