"""``latentmill sample`` on tiny Flux exports and checkpoints trained here, and the timing rule it uses."""

import json
import statistics

import numpy as np
import pytest
import torch
from latentmill.trainer import ParallelConfig, TrainerConfig, train
from PIL import Image
from safetensors.torch import load_file

from latentmill.cli import main
from latentmill.sample import load_pipeline, parse_size, sample
from latentmill.timing import steady_state
from tests.trainer_helpers import torch_threads, write_fake_cache

pytestmark = pytest.mark.slow  # three tiny trainings and a few pipeline loads (~30 s on 2 cores)


# ------------------------------------------------------------------------------------------------ timing


class FakeClock:
    """A clock that advances only when the workload says so: no real time is measured."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_steady_state_excludes_the_first_call():
    clock, calls = FakeClock(), []
    costs = [10.0, 1.0, 3.0, 2.0, 5.0]  # the first call is slow (compilation), then steady-ish

    def workload(index: int) -> str:
        calls.append(index)
        clock.now += costs[index]
        return f"result-{index}"

    stats = steady_state(workload, 4, clock=clock)
    assert calls == [0, 1, 2, 3, 4]
    assert stats.first_s == 10.0
    assert stats.times_s == [1.0, 3.0, 2.0, 5.0]  # the first call is not among them
    assert stats.median_s == 2.5 and (stats.min_s, stats.max_s) == (1.0, 5.0)
    assert stats.iqr_s == pytest.approx(3.5 - 1.75)  # inclusive quartiles of 1, 2, 3, 5
    assert stats.per_second(5) == 2.0
    assert stats.results == [f"result-{i}" for i in range(5)]
    assert stats.to_json()["repeats"] == 4 and stats.to_json()["first_call_s"] == 10.0


def test_steady_state_syncs_around_each_call_and_handles_no_repeats():
    clock, events = FakeClock(), []

    def workload(index: int) -> None:
        events.append(f"call{index}")
        clock.now += 1.0

    def sync() -> None:
        events.append("sync")
        clock.now += 100.0  # waiting for the device before the clock starts is not the call's time

    stats = steady_state(workload, 1, clock=clock, sync=sync)
    assert events == ["sync", "call0", "sync", "sync", "call1", "sync"]
    assert stats.first_s == 101.0 and stats.times_s == [101.0]  # the trailing sync belongs to the call
    none = steady_state(lambda i: clock.now, 0, clock=clock)
    assert none.times_s == [] and none.median_s is None and none.per_second(1) is None
    with pytest.raises(ValueError):
        steady_state(lambda i: None, -1)


# ------------------------------------------------------------------------------------------------ sample


@pytest.fixture(scope="module")
def runs(tiny_flux, tmp_path_factory):
    """A full run (export + safetensors checkpoint), a LoRA run (export with its base recorded, checkpoint)
    and an FSDP2 run in a process group of one (DCP checkpoint), 2 steps each."""
    root = tmp_path_factory.mktemp("sample")
    write_fake_cache(root / "cache", {(48, 64, 1): 3, (32, 32, 1): 2}, seq_len=64)
    common = {"max_steps": 2, "batch_size": 2, "save_every": 2, "learning_rate": 1e-2}
    with torch_threads(1):
        train(TrainerConfig(mode="full", **common), cache_dir=root / "cache", pretrained=str(tiny_flux),
              train_dir=root / "full", export_dir=root / "full-export", progress=False)
        train(TrainerConfig(mode="lora", lora_rank=4, lora_alpha=8.0, **common), cache_dir=root / "cache",
              pretrained=str(tiny_flux), train_dir=root / "lora", export_dir=root / "lora-export", progress=False,
              provenance={"pretrained": str(tiny_flux)})
        train(TrainerConfig(mode="full", export=False, **common), cache_dir=root / "cache",
              pretrained=str(tiny_flux), train_dir=root / "fsdp", progress=False,
              parallel=ParallelConfig(strategy="fsdp2"), provenance={"pretrained": str(tiny_flux)})
    return root


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _step(run) -> "object":
    return run / "checkpoints" / "step-000002"


def test_full_export_images_grid_and_timing(runs, tmp_path):
    report = sample(runs / "full-export", ["a red square", "a blue circle"], out=tmp_path, steps=2,
                    size=parse_size("48x32"), repeat=2, max_sequence_length=32, device="cpu")
    images = sorted((tmp_path / "images").glob("*.png"))
    assert [p.name for p in images] == [f"c{c:02d}-{j:02d}.png" for c in range(3) for j in range(2)]
    assert {Image.open(p).size for p in images} == {(48, 32)}
    assert Image.open(tmp_path / "grid.png").size == (2 * 48, 3 * 32)  # a row per call
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing == json.loads(json.dumps(report))
    assert timing["kind"] == "full-export" and timing["family"] == "flux"
    assert len(timing["repeats_s"]) == 2 and timing["repeats"] == 2
    assert timing["median_s"] == statistics.median(timing["repeats_s"])  # the first call is not in it
    assert timing["first_call_s"] > 0 and timing["load_s"] > 0
    assert timing["first_call_overhead_s"] == timing["first_call_s"] - timing["median_s"]
    assert timing["images_per_s"] == 2 / timing["median_s"]
    assert timing["s_per_step"] == timing["median_s"] / 2
    assert timing["compile"] is False and timing["compile_s"] is None
    # the same seed gives the same image again: call 0 reproduced through the stock pipeline
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(runs / "full-export")
    direct = pipe(["a red square", "a blue circle"], width=48, height=32, num_inference_steps=2,
                  max_sequence_length=32, generator=torch.Generator().manual_seed(0)).images[0]
    assert np.array_equal(np.asarray(Image.open(images[0])), np.asarray(direct))


def test_lora_export_finds_its_base(runs, tiny_flux, tmp_path):
    loaded = load_pipeline(runs / "lora-export")
    assert loaded.kind == "lora-export" and loaded.base == str(tiny_flux)
    (adapter,) = loaded.pipe.get_active_adapters()
    trained = load_file(_step(runs / "lora") / "model.safetensors")
    state = loaded.pipe.transformer.state_dict()
    assert trained and all(torch.equal(state[k.replace(".default.", f".{adapter}.")], v) for k, v in trained.items())
    # without latentmill.json the base must be given: a one-line error says how, --base makes it work
    bare = tmp_path / "bare-lora"
    bare.mkdir()
    (bare / "pytorch_lora_weights.safetensors").write_bytes(
        (runs / "lora-export" / "pytorch_lora_weights.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="pass --base"):
        load_pipeline(bare)
    assert main(["sample", str(bare), "--prompt", "a cat", "--steps", "1", "--size", "32x32", "--repeat", "1",
                 "--max-sequence-length", "32", "--base", str(tiny_flux), "--out", str(tmp_path / "o")]) == 0
    assert len(list((tmp_path / "o" / "images").glob("*.png"))) == 2


def test_full_checkpoint_safetensors(runs, tiny_flux, tmp_path, capsys):
    step = _step(runs / "full")
    # the run recorded no pretrained path (train() called directly): the error names --base
    assert main(["sample", str(step), "--prompt", "x", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pass --base" in err
    loaded = load_pipeline(step, base=str(tiny_flux))
    assert loaded.kind == "checkpoint" and loaded.info == {"mode": "full", "step": 2, "format": "safetensors"}
    trained, state = load_file(step / "model.safetensors"), loaded.pipe.transformer.state_dict()
    assert trained and all(torch.equal(state[k], v) for k, v in trained.items())
    base = load_pipeline(tiny_flux).pipe.transformer.state_dict()
    assert any(not torch.equal(base[k], state[k]) for k in trained)


def test_lora_checkpoint_safetensors(runs):
    step = _step(runs / "lora")
    loaded = load_pipeline(step)  # base from the checkpoint's recorded provenance
    assert loaded.info["mode"] == "lora"
    trained, state = load_file(step / "model.safetensors"), loaded.pipe.transformer.state_dict()
    assert trained and all(torch.equal(state[k], v) for k, v in trained.items())
    assert loaded.pipe.transformer.peft_config["default"].r == 4


def test_fsdp2_dcp_checkpoint(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = _step(runs / "fsdp")
    assert (step / "dcp").is_dir() and not (step / "model.safetensors").exists()
    # the reference: DCP's own converter, reading the whole checkpoint (optimizer state included)
    dcp_to_torch_save(step / "dcp", tmp_path / "all.pt")
    reference = torch.load(tmp_path / "all.pt", weights_only=True)["model"]
    report = sample(step, ["a red square"], out=tmp_path / "out", steps=1, size=[32, 32], repeat=1,
                    max_sequence_length=32, device="cpu")
    assert report["kind"] == "checkpoint" and report["format"] == "dcp"
    loaded = load_pipeline(step)
    state = loaded.pipe.transformer.state_dict()
    assert reference and all(torch.equal(state[k], v) for k, v in reference.items())
    assert len(report["images"]) == 2


def test_bad_path_names_what_to_pass(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "model_index.json" in err and "pytorch_lora_weights.safetensors" in err and "step-N" in err
    assert main(["sample", str(tmp_path), "--prompt", "x", "--size", "48by32"]) == 2
    assert "WxH" in capsys.readouterr().err


def test_compile_reports_what_and_how_long(runs, tmp_path):
    # the eager backend: Dynamo captures the transformer's graph without generating code (the inductor
    # figure is in the report of issue 19; a test does not wait for a C++ compiler)
    report = sample(runs / "full-export", ["a red square"], out=tmp_path, steps=1, size=[32, 32], repeat=1,
                    max_sequence_length=32, device="cpu", compile=True, compile_backend="eager")
    assert report["compile"] is True and report["compiled"][0].startswith("transformer (FluxTransformer2DModel")
    assert report["compile_s"] == report["first_call_s"] - report["median_s"]
    assert report["dynamo"]["graphs"] >= 1
