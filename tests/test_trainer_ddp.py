"""DDP on CPU (gloo) under torchrun: two ranks train in step, rank 0 writes once, resume is exact."""

import pytest
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import build_tiny_transformer, read_metrics, run_and_resume, write_fake_cache

pytestmark = pytest.mark.slow  # a torchrun launch starts two interpreters (~10 s on 2 cores)


def test_ddp_trains_writes_once_and_resumes_exactly(tmp_path):
    build_tiny_transformer(tmp_path / "pretrained")
    write_fake_cache(tmp_path / "cache", {(48, 64, 1): 6, (64, 32, 1): 6}, smooth=True)
    # 12 samples, batch 2, 2 ranks: 3 steps per epoch. The resume from step 3 (each sample's noise keyed by its
    # place in the epoch) replays steps 4-6 bit for bit (run_and_resume checks it), in the same launch.
    rank0, _ = run_and_resume(tmp_path, tmp_path / "cache", tmp_path / "pretrained", {"strategy": "ddp"}, 6,
                              mode="lora", lora_rank=4, export=False)
    assert rank0["samples_per_s"] > 0
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]  # written by rank 0 only
    step3 = list_checkpoints(tmp_path / "run" / "checkpoints")[0][1]
    assert sorted(p.name for p in step3.glob("rng-rank*")) == ["rng-rank0.safetensors", "rng-rank1.safetensors"]
