"""Training on two nodes with ``output_dir`` on a real S3 server (moto's, tests/conftest.py): two ``latentmill
train --nproc 1 --nnodes 2`` processes, each with a work folder of its own (two machines), one rendezvous on
loopback, FSDP2 over gloo (DCP writes each rank's shard on its node). The store ends with one run folder whose
checkpoints hold every rank's shard and RNG file and a trainer_state.json, the run's files published by global
rank 0's node only; a fresh machine resumes the last checkpoint on one node and trains the losses of the same
run uninterrupted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from latentmill.pipelines.objectstore import TRAIN_LOCK
from latentmill.pipelines.storeruns import RANK0_MARKER

from latentmill.cli import main
from tests.helpers import free_port, store, upload_demo_inputs

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
# 24 samples in cache shards of 128 KiB, all trained on (buckets of 4, 8, 4, 4, 4 samples: 2 ranks split them)
COMMON = ["cache.shard_bytes=131072", "prep.eval_fraction=0", "trainer.save_every=2", "trainer.log_every=1",
          "trainer.keep_latest_k=2", "parallel.strategy=fsdp2"]


def _losses(text: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, text.splitlines())]


def _train(url: str, tiny_flux: Path, work: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "LATENTMILL_WORK_DIR": str(work), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "latentmill.cli", "train", str(DEMO_CONFIG), f"output_dir={url}",
                             f"model.pretrained={tiny_flux}", *COMMON, *args], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


# make test covers each part of this path in seconds: tests/test_checkpoint_nodes.py (each node's local rank 0 keeps
# its own checkpoint folder, 2 gloo ranks under FSDP2), tests/test_object_store.py (a checkpoint's trainer_state.json
# held back until every node's parts are on the store, run files and deletions by rank 0's node only, the lease
# joined by the nodes of one rendezvous, which take the holder's run folder)
@pytest.mark.heavy
def test_two_nodes_train_into_one_run_on_the_store_and_a_fresh_machine_resumes_it(s3_bucket, tiny_flux, tmp_path,
                                                                                 monkeypatch):
    fs = store("s3")
    source = upload_demo_inputs(fs, s3_bucket)
    url, reference_url = f"s3://{s3_bucket}/out", f"s3://{s3_bucket}/ref"
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "prep"))
    assert main(["prep", str(DEMO_CONFIG), f"output_dir={url}", f"model.pretrained={tiny_flux}",
                 f"ingest.source={source}", *COMMON[:2]]) == 0
    fs.copy(f"{s3_bucket}/out", f"{s3_bucket}/ref", recursive=True)  # the same snapshot, for the reference run

    # the reference: 6 steps on one node of 2 ranks, uninterrupted
    reference = _train(reference_url, tiny_flux, tmp_path / "ref", tmp_path / "ref.log", "trainer.max_steps=6",
                       "--nproc", "2")
    assert reference.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    run_ref = fs.cat_file(f"{s3_bucket}/ref/train/LATEST").decode().strip()
    expected = _losses(fs.cat_file(f"{s3_bucket}/ref/train/runs/{run_ref}/metrics.jsonl").decode())
    assert [step for step, _ in expected] == list(range(1, 7))

    # two nodes of one rank each, 4 steps: the first holds the training lease, the second joins it
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, "trainer.max_steps=4"]
    first = _train(url, tiny_flux, tmp_path / "node-a", tmp_path / "node-a.log", *nodes)
    deadline = time.monotonic() + 300
    while not fs.exists(f"{s3_bucket}/out/{TRAIN_LOCK}"):
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "node-a.log").read_text()[-3000:]
        time.sleep(0.2)
    second = _train(url, tiny_flux, tmp_path / "node-b", tmp_path / "node-b.log", *nodes)
    codes = [first.wait(timeout=900), second.wait(timeout=900)]
    logs = [(tmp_path / f"node-{n}.log").read_text() for n in "ab"]
    assert codes == [0, 0], "\n---\n".join(log[-3000:] for log in logs)
    assert f"joining the training lease of {url}" in logs[1] and "joining" not in logs[0]

    runs = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{s3_bucket}/out/train/runs"))
    assert len(runs) == 1  # one run folder, the one the lease holder chose
    run = runs[0]
    prefix = f"{s3_bucket}/out/train/runs/{run}"
    assert fs.cat_file(f"{s3_bucket}/out/train/LATEST").decode().strip() == run
    # both nodes trained in that folder; global rank 0 marked one of them
    folders = [next((tmp_path / f"node-{n}").glob(f"*/train/runs/{run}")) for n in "ab"]
    main_node = [(folder / RANK0_MARKER).is_file() for folder in folders]
    assert sorted(main_node) == [False, True]
    other = folders[main_node.index(False)]
    # every checkpoint on the store holds both ranks' shards and RNG files, its metadata and its state
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{prefix}/checkpoints")) == ["step-000002", "step-000004"]
    for step in ("step-000002", "step-000004"):
        names = sorted(p.split(f"{step}/", 1)[1] for p in fs.find(f"{prefix}/checkpoints/{step}"))
        assert names == ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "lr_scheduler.pt",
                         "rng-rank0.safetensors", "rng-rank1.safetensors", "trainer_state.json"], names
        # the other node's folder holds only its rank's parts of the checkpoint: it wrote no run-level file
        mine = sorted(p.relative_to(other / "checkpoints" / step).as_posix()
                      for p in (other / "checkpoints" / step).rglob("*") if p.is_file())
        assert len(mine) == 2 and mine[0].startswith("dcp/__") and mine[1].startswith("rng-rank"), mine
    # the run's files are those of rank 0's node: its run.json says finished, the other node's (never published)
    # does not; the metrics are the reference's first 4 steps
    assert json.loads(fs.cat_file(f"{prefix}/run.json"))["finished"] is True
    assert json.loads((other / "run.json").read_text())["finished"] is False
    assert not (other / "metrics.jsonl").exists()
    losses = _losses(fs.cat_file(f"{prefix}/metrics.jsonl").decode())
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert [loss for _, loss in losses] == pytest.approx([loss for _, loss in expected[:4]], rel=1e-5)
    assert not fs.exists(f"{s3_bucket}/out/{TRAIN_LOCK}")  # released

    # a fresh machine resumes the store's step 4 on one node of 2 ranks: steps 5 and 6 are the reference's
    resumed = _train(url, tiny_flux, tmp_path / "fresh", tmp_path / "fresh.log", "trainer.max_steps=6",
                     "trainer.resume=latest", "--nproc", "2")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "fresh.log").read_text()[-3000:]
    losses = _losses(fs.cat_file(f"{prefix}/metrics.jsonl").decode())
    assert [step for step, _ in losses] == list(range(1, 7))
    assert [loss for _, loss in losses] == pytest.approx([loss for _, loss in expected], rel=1e-5)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{prefix}/checkpoints")) == ["step-000004", "step-000006"]
