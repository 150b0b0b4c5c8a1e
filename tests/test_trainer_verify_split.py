"""Shard verification split across ranks (issue 16, item 8), on 2 gloo ranks.

``LatentLoader(verify=True)`` used to hash every shard on every rank. Now rank r hashes shards r, r+N, ...
and the bad shards are gathered, so every rank raises the same error. Each rank counts the shards it hashed
by wrapping the loader module's own ``_sha256`` (the real hash still runs) and writes the paths to a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_helpers import write_fake_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
# heavy: make test splits a shard check over 2 ranks in test_trainer_shard_check.py (the check training runs)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
import latentmill.trainer.loader as loader_mod

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
hashed = []
real_sha256 = loader_mod._sha256

def counting_sha256(path):
    hashed.append(os.path.basename(path))
    return real_sha256(path)

loader_mod._sha256 = counting_sha256
out = {"rank": rank, "hashed": hashed, "error": None}
try:
    loader = loader_mod.LatentLoader(sys.argv[1], batch_size=2, verify=True, rank=rank, world_size=world)
    out["verified_shards"] = getattr(loader, "verified_shards", None)
    out["batches"] = len(loader)
    loader.close()
except ValueError as exc:
    out["error"] = str(exc)
open(sys.argv[2] + f"-{rank}.json", "w").write(json.dumps(out))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""


def _run_ranks(tmp_path: Path, cache: Path, tag: str) -> list[dict]:
    """The worker on 2 gloo ranks over ``cache``; each rank's result."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / f"{tag}.stderr"
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(tmp_path / "worker.py"), str(cache), str(tmp_path / tag)], cwd=REPO_ROOT,
                              env=env, stdout=stderr, stderr=stderr, timeout=300)
    assert done.returncode == 0, log.read_text()[-3000:]
    return [json.loads((tmp_path / f"{tag}-{rank}.json").read_text()) for rank in (0, 1)]


def test_ranks_hash_disjoint_shares_and_all_raise_on_a_bad_shard(tmp_path):
    cache = tmp_path / "cache"
    manifest = write_fake_cache(cache, {(16, 16, 1): 6, (32, 16, 1): 6}, shards_per_bucket=3)
    names = [entry["name"] for entry in manifest["shards"]]
    assert len(names) == 6 == len(set(names))

    # (a) a clean cache: each rank hashed its own share, disjoint, and together every shard once
    clean = _run_ranks(tmp_path, cache, "clean")
    shares = [set(result["hashed"]) for result in clean]
    assert [len(result["hashed"]) for result in clean] == [3, 3]  # not 6 each (every shard on every rank)
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(names)
    assert [result["verified_shards"] for result in clean] == [[0, 2, 4], [1, 3, 5]]
    assert [result["error"] for result in clean] == [None, None]

    # (b) corrupt a shard rank 1 hashes: both ranks raise, naming it with expected and actual sha256
    victim = next(entry for entry in manifest["shards"] if entry["name"] in shares[1])
    shard = cache / victim["path"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # tar padding: still a valid tar, different bytes
    shard.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    corrupt = _run_ranks(tmp_path, cache, "corrupt")
    assert victim["name"] not in corrupt[0]["hashed"]  # rank 0 did not hash it itself...
    for result in corrupt:  # ...and raises all the same
        error = result["error"]
        assert error is not None and "1 of 6 cache shards: sha256 differs" in error
        assert f"{shard}: expected sha256 {victim['sha256']}, actual {actual}" in error
    assert corrupt[0]["error"] == corrupt[1]["error"]
