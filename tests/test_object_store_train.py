"""Training with ``output_dir`` on a real S3 server (moto's, tests/conftest.py): the demo's prep-then-train
streams its snapshot and trains the very losses of the same run on a local output; its checkpoints, metrics
and export are published to the store; a fresh machine resumes from the store's checkpoint bit-exactly, with a
cache limit below its share of the snapshot (shards evicted and fetched again), and again on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from latentmill.cli import main
from tests.helpers import store, upload_demo_inputs

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def _run(command: str, output_dir: str, tiny_flux: Path, source: str, summary: Path, *overrides: str) -> dict:
    """``latentmill COMMAND`` on the demo recipe (cache shards of 128 KiB: the 24 samples in several shards), all
    24 trained on: their buckets (4, 8, 4, 4, 4 samples) split evenly over 2 ranks, so a 2-rank resume trains the
    1-rank losses, which the 18 left by a held-out set do not."""
    assert main([command, str(DEMO_CONFIG), f"output_dir={output_dir}", f"model.pretrained={tiny_flux}",
                 f"ingest.source={source}", "cache.shard_bytes=131072", "trainer.save_every=2", "trainer.log_every=1",
                 "prep.eval_fraction=0",
                 *overrides,
                 "--summary-json", str(summary)]) == 0
    return json.loads(summary.read_text())


def _losses(lines: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, lines.splitlines())]


@pytest.mark.heavy
def test_prep_then_train_on_the_store_trains_the_local_losses_and_resumes_from_the_store(
        store_bucket, tiny_flux, tmp_path, monkeypatch):
    scheme, bucket = store_bucket
    fs = store(scheme)
    source = upload_demo_inputs(fs, bucket)
    url = f"{scheme}://{bucket}/out"

    # the reference: 12 steps on a local output_dir, from the same inputs
    local = _run("run", str(tmp_path / "local"), tiny_flux, source, tmp_path / "local.json", "trainer.max_steps=12")
    reference = _losses((Path(local["train"]["run_dir"]) / "metrics.jsonl").read_text())
    assert [step for step, _ in reference] == list(range(1, 13))

    # the same prep-then-train on the store, 4 steps: the same snapshot, the same losses, bit for bit
    stored = _run("run", url, tiny_flux, source, tmp_path / "store.json", "trainer.max_steps=4")
    assert stored["snapshot"]["name"] == local["snapshot"]["name"]
    run = Path(stored["train"]["run_dir"]).name
    stream = stored["train"]["stream"]
    snapshot_bytes = json.loads(fs.cat_file(f"{bucket}/out/snapshots/{stored['snapshot']['name']}/manifest.json"))[
        "snapshot"]["bytes"]
    assert stream["bytes_downloaded"] == snapshot_bytes and stream["evictions"] == 0  # each shard once
    # published: the metrics, each checkpoint whole, the run record and the export
    prefix = f"{bucket}/out/train/runs/{run}"
    assert _losses(fs.cat_file(f"{prefix}/metrics.jsonl").decode()) == reference[:4]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{prefix}/checkpoints")) == ["step-000002", "step-000004"]
    assert fs.exists(f"{prefix}/checkpoints/step-000004/trainer_state.json")
    assert fs.exists(f"{prefix}/checkpoints/step-000004/model.safetensors")
    assert json.loads(fs.cat_file(f"{prefix}/run.json"))["finished"] is True
    assert fs.exists(f"{prefix}/export/model_index.json")
    assert fs.cat_file(f"{bucket}/out/train/LATEST").decode().strip() == run

    # a fresh machine (empty work folder) resumes the store's latest checkpoint to step 10, with a cache limit of
    # one byte (each batch keeps only its own shards): the losses of steps 5 to 10 are the local run's, bit for bit
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "fresh"))
    resumed = _run("train", url, tiny_flux, source, tmp_path / "resumed.json", "trainer.max_steps=10",
                   "trainer.resume=latest", "loader.cache_limit=1B")
    assert resumed["train"]["resumed_from"].endswith("step-000004")
    assert resumed["train"]["stream"]["evictions"] > 0
    metrics = _losses(fs.cat_file(f"{prefix}/metrics.jsonl").decode())
    assert metrics == reference[:10]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{prefix}/checkpoints")) == ["step-000008", "step-000010"]

    # another fresh machine resumes it on 2 gloo ranks (DDP, the same global batch of 4: 2 per rank), each
    # streaming its own share: steps 11 and 12 train the reference's losses (up to the all-reduce's rounding)
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "fresh-2"))
    two = _run("train", url, tiny_flux, source, tmp_path / "two.json", "trainer.max_steps=12", "trainer.resume=latest",
               "parallel.strategy=ddp", "--nproc", "2")
    assert two["train"]["world_size"] == 2 and two["train"]["resumed_from"].endswith("step-000010")
    assert two["train"]["stream"]["downloads"] + two["train"]["stream"]["shared"] >= 1  # rank 0's: it or rank 1 fetched
    assert sorted((tmp_path / "fresh-2").glob("*/stream-cache/rank-*")) != []
    pooled = list((tmp_path / "fresh-2").glob("*/stream-cache/shared/*.tar"))  # the node's one copy of each tar
    assert pooled and all(p.stat().st_nlink >= 2 for p in pooled)  # and a link in the folder of a rank
    metrics = _losses(fs.cat_file(f"{prefix}/metrics.jsonl").decode())
    assert [step for step, _ in metrics] == list(range(1, 13)) and metrics[:10] == reference[:10]
    assert [loss for _, loss in metrics[10:]] == pytest.approx([loss for _, loss in reference[10:]], rel=1e-5)
