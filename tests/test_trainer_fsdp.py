"""FSDP2 (and HSDP) on CPU (gloo) under torchrun: sharded training, sharded (DCP) checkpoints with an exact
resume, a gathered export that loads and generates, and uneven shards that keep the ranks in step."""

import json
import statistics
from pathlib import Path

import pytest
import torch
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import add_validation_prompts, launch_jobs, read_metrics, write_fake_cache

pytestmark = pytest.mark.slow  # each torchrun launch starts two interpreters (~10 s on 2 cores)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_flux):
    root = tmp_path_factory.mktemp("fsdp")
    # uneven on purpose: shards of 3+2 and 2+1 samples; batches of 2 -> 3 + 2 = 5 global batches per epoch,
    # which 2 ranks cannot split evenly
    write_fake_cache(root / "cache", {(48, 64, 1): 5, (64, 32, 1): 3}, smooth=True, shards_per_bucket=2)
    add_validation_prompts(root / "cache", str(tiny_flux), ["a red square"], max_sequence_length=16)  # run c's
    return root


def _job(root: Path, pretrained: Path, train_dir: Path, parallel: dict, **cfg) -> dict:
    cfg = {"max_steps": 8, "batch_size": 2, "learning_rate": 3e-3, "save_every": 4, "keep_latest_k": 0,
           "export": False, "lora_rank": 4, **cfg}  # fmt: skip
    return {"cfg": cfg, "cache": str(root / "cache"), "pretrained": str(pretrained),
            "train_dir": str(train_dir), "parallel": parallel}  # fmt: skip


@pytest.fixture(scope="module")
def runs(setup, tiny_flux, tmp_path_factory):
    """One launch: FSDP2 full (a), its resume from step 4 (b), HSDP 2x1 LoRA, accumulating, validating (c)."""
    out = tmp_path_factory.mktemp("fsdp-runs")
    fsdp, hsdp = {"strategy": "fsdp2"}, {"strategy": "fsdp2", "hsdp_replicate": 2}
    step4 = out / "a" / "checkpoints" / "step-000004"
    jobs = [
        _job(setup, tiny_flux, out / "a", fsdp, mode="full", export=True),
        _job(setup, tiny_flux, out / "b", fsdp, mode="full", resume=str(step4)),
        _job(
            setup,
            tiny_flux,
            out / "c",
            hsdp,
            mode="lora",
            max_steps=4,
            learning_rate=1e-2,
            export=True,
            grad_accum_steps=2,
            validate_every=4,
            validation_prompts=["a red square"],
            validation_steps=1,
            validation_size=[32, 32],
        ),
    ]
    return out, dict(zip("abc", launch_jobs(out, jobs)))


def test_fsdp2_trains_resumes_exactly_and_exports(runs, tiny_flux):
    tmp_path, summaries = runs
    rank0, rank1 = summaries["a"]
    # uneven shards: both ranks read 2 batches per epoch and finish the same steps and epochs
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert rank0["steps"] == rank1["steps"] == 8 and rank0["epochs"] == rank1["epochs"] == 4.0
    assert rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(tmp_path / "a")]
    assert len(losses) == 8 and all(map(lambda x: 0 < x < 1e3, losses))
    assert statistics.mean(losses[-3:]) < statistics.mean(losses[:3])

    # sharded checkpoints: one DCP shard file per rank, no gathered weights
    checkpoints = list_checkpoints(tmp_path / "a" / "checkpoints")
    assert [s for s, _ in checkpoints] == [4, 8]
    step4 = checkpoints[0][1]
    assert (step4 / "dcp").is_dir() and not (step4 / "model.safetensors").exists()
    assert len(list((step4 / "dcp").glob("*.distcp"))) == 2
    assert json.loads((step4 / "trainer_state.json").read_text())["format"] == "dcp"

    # kill-and-resume with the same world size replays steps 5-8 bit for bit
    resumed, _ = summaries["b"]
    assert resumed["resumed_from"] == str(step4)
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == losses[4:]

    # the export gathers the full weights on rank 0 and loads in the stock pipeline
    from diffusers import DiffusionPipeline, FluxPipeline

    pipe = DiffusionPipeline.from_pretrained(rank0["export_dir"])
    assert isinstance(pipe, FluxPipeline) and rank1["export_dir"] is None
    base = FluxPipeline.from_pretrained(tiny_flux).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys() and any(not torch.equal(base[k], exported[k]) for k in base)
    image = pipe("a red square", height=32, width=32, num_inference_steps=2, max_sequence_length=16).images[0]
    assert image.size == (32, 32)


def test_hsdp_lora_trains_and_exports(runs, tiny_flux):
    tmp_path, summaries = runs
    rank0, rank1 = summaries["c"]  # 2 replicas x 1 shard
    assert rank0["steps"] == rank1["steps"] == 4 and rank0["final_loss"] == rank1["final_loss"]
    assert (
        rank0["epochs"] == rank1["epochs"] == 4.0
    )  # 4 steps x 2 micro-batches, 2 batches per rank and epoch
    (_, step4), = list_checkpoints(tmp_path / "c" / "checkpoints")[-1:]  # fmt: skip
    # validation with a sharded transformer: every rank samples (collective forward), rank 0 saves the grid
    assert [Path(p).name for p in rank0["validation"]] == ["step-000004.png"] and rank1["validation"] == []
    assert (step4 / "dcp").is_dir()

    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.load_lora_weights(rank0["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert pipe.transformer.peft_config[adapter].r == 4
    image = pipe("a red square", height=32, width=32, num_inference_steps=2, max_sequence_length=16).images[0]
    assert image.size == (32, 32)
