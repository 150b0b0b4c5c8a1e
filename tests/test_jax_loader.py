"""``latentmill.jax.JaxLatentLoader``: from a published snapshot, exactly the batches of the torch
``LatentLoader`` (keys, bucket, position, every array's values), for whole epochs, rank shares and a
resumed position; bf16 output as ``ml_dtypes.bfloat16`` with the stored bytes; ``jax.Array`` output."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from latentmill.pipelines.snapshot import publish
from latentmill.trainer.loader import LatentLoader

from latentmill.jax import JaxLatentLoader, resolve_snapshot_dir
from tests.trainer_helpers import write_fake_cache

REPO = Path(__file__).resolve().parents[1]
BUCKETS = {(48, 64, 1): 5, (64, 32, 1): 3, (32, 32, 1): 7}  # [width, height, frames] -> samples
ARRAYS = ("latents", "latents_std", "prompt_embeds", "pooled_prompt_embeds", "caption_dropped")


def make_snapshot(output_dir: Path, buckets=BUCKETS, **cache_options) -> Path:
    """A published snapshot (format 3: an index beside each tar) of a fake cache; returns its folder."""
    cache = output_dir / "prep" / "cache"
    write_fake_cache(cache, buckets, shards_per_bucket=2, **cache_options)
    return Path(publish(output_dir, cache)["path"])


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return make_snapshot(tmp_path_factory.mktemp("out"))


def assert_same_batches(torch_batches: list[dict], jax_batches: list[dict]) -> int:
    """Every batch equal: keys, bucket, epoch, index, and each array's shape and values. Returns the count
    of arrays compared."""
    assert len(torch_batches) == len(jax_batches)
    compared = 0
    for want, have in zip(torch_batches, jax_batches):
        assert (have["keys"], have["bucket"], have["epoch"], have["index"]) == (
            want["keys"], want["bucket"], want["epoch"], want["index"])
        assert sorted(k for k in have if k in ARRAYS) == sorted(k for k in want if k in ARRAYS)
        for name in ARRAYS:
            if name in want:
                assert isinstance(have[name], np.ndarray)
                assert np.array_equal(have[name], want[name].numpy()), name
                assert have[name].dtype == want[name].numpy().dtype, name
                compared += 1
    return compared


@pytest.mark.parametrize("seed", [0, 5])
def test_two_epochs_equal_the_torch_loaders(snapshot, seed):
    torch_loader = LatentLoader(snapshot, batch_size=2, seed=seed)
    jax_loader = JaxLatentLoader(snapshot, batch_size=2, seed=seed)
    n = len(torch_loader)
    assert len(jax_loader) == n == 3 + 2 + 4  # ceil(5/2) + ceil(3/2) + ceil(7/2)
    want = list(itertools.islice(torch_loader, 2 * n))
    got = list(itertools.islice(jax_loader, 2 * n))
    assert assert_same_batches(want, got) == 2 * n * 4  # latents, prompt_embeds, pooled, caption_dropped
    assert [b["epoch"] for b in got] == [0] * n + [1] * n
    assert {len({tuple(b["bucket"])}) for b in got} == {1}
    assert sorted(k for b in got[:n] for k in b["keys"]) == [f"s{i:05d}" for i in range(15)]
    assert [k for b in got[:n] for k in b["keys"]] != [k for b in got[n:] for k in b["keys"]]  # reshuffled
    assert got[0]["latents"].dtype == np.float32
    assert jax_loader.state_dict() == torch_loader.state_dict()


def test_rank_shares_equal_the_torch_loaders(snapshot):
    shares = []
    for rank in range(2):
        torch_loader = LatentLoader(snapshot, batch_size=2, seed=3, rank=rank, world_size=2, drop_last=True)
        jax_loader = JaxLatentLoader(snapshot, batch_size=2, seed=3, rank=rank, world_size=2, drop_last=True)
        n = len(jax_loader)
        assert n == len(torch_loader) == 1 + 0 + 1  # full global batches of 2 x 2 ranks in buckets of 5, 3, 7
        got = list(itertools.islice(jax_loader, 2 * n))
        assert_same_batches(list(itertools.islice(torch_loader, 2 * n)), got)
        shares.append([tuple(b["keys"]) for b in got[:n]])
    assert not set(shares[0]) & set(shares[1])  # the ranks' batches of an epoch are disjoint


def test_shuffle_block_gives_the_torch_loaders_block_order(snapshot):
    """``shuffle_block`` reaches the torch loader's plan: the block order, not the whole-bucket one."""
    torch_loader = LatentLoader(snapshot, batch_size=2, seed=1, shuffle_block=1)
    jax_loader = JaxLatentLoader(snapshot, batch_size=2, seed=1, shuffle_block=1)
    n = len(jax_loader)
    got = list(itertools.islice(jax_loader, 2 * n))
    assert assert_same_batches(list(itertools.islice(torch_loader, 2 * n)), got) == 2 * n * 4
    whole = [b["keys"] for b in itertools.islice(JaxLatentLoader(snapshot, batch_size=2, seed=1), 2 * n)]
    assert [b["keys"] for b in got] != whole
    assert jax_loader.state_dict()["shuffle_block"] == 1


@pytest.mark.parametrize("consumed", [4, 9, 13])  # mid-epoch, epoch boundary, second epoch
def test_resume_from_a_mid_epoch_position(snapshot, consumed):
    loader = JaxLatentLoader(snapshot, batch_size=2, seed=7)
    it = iter(loader)
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))  # must survive JSON
    expected = [next(it) for _ in range(6)]

    fresh = JaxLatentLoader(snapshot, batch_size=2, seed=7)
    fresh.load_state_dict(state)
    resumed = list(itertools.islice(fresh, 6))
    torch_loader = LatentLoader(snapshot, batch_size=2, seed=7)  # a position saved by one resumes the other
    torch_loader.load_state_dict(state)
    assert_same_batches(list(itertools.islice(torch_loader, 6)), resumed)
    for want, have in zip(expected, resumed):
        assert have["keys"] == want["keys"] and np.array_equal(have["latents"], want["latents"])


def test_trimmed_video_distribution_and_caption_dropout(tmp_path):
    """A Wan-class snapshot: 5-D latents, latents_std, prompts zero-padded to pad_to, dropped captions."""
    snap = make_snapshot(tmp_path, {(32, 32, 5): 4, (32, 16, 9): 5}, family="wan", trimmed=True,
                         latents="distribution")
    options = dict(batch_size=2, seed=1, caption_dropout=0.4)
    torch_loader, jax_loader = LatentLoader(snap, **options), JaxLatentLoader(snap, **options)
    n = 2 * len(torch_loader)
    got = list(itertools.islice(jax_loader, n))
    assert assert_same_batches(list(itertools.islice(torch_loader, n)), got) == n * 4
    assert got[0]["latents"].ndim == 5 and got[0]["prompt_embeds"].shape[1] == 8  # SEQ_LEN tokens
    dropped = np.concatenate([b["caption_dropped"] for b in got])
    assert dropped.dtype == np.bool_ and 0 < dropped.sum() < len(dropped)


def test_bfloat16_output_holds_the_stored_bytes(snapshot):
    torch_loader = LatentLoader(snapshot, batch_size=4, seed=2, dtype=torch.bfloat16)
    stored = JaxLatentLoader(snapshot, batch_size=4, seed=2, dtype=None)  # the manifest's dtype: bfloat16
    jax_loader = JaxLatentLoader(snapshot, batch_size=4, seed=2, dtype="bfloat16")
    assert stored.dtype == "bfloat16"
    batches = zip(itertools.islice(torch_loader, 5), itertools.islice(jax_loader, 5), itertools.islice(stored, 5))
    for want, have, also in batches:
        for name in ("latents", "prompt_embeds", "pooled_prompt_embeds"):
            assert have[name].dtype == also[name].dtype == ml_dtypes.bfloat16
            assert have[name].shape == tuple(want[name].shape)
            assert have[name].tobytes() == also[name].tobytes() == want[name].view(torch.uint16).numpy().tobytes()
    with pytest.raises(ValueError, match="hands out one of"):
        JaxLatentLoader(snapshot, batch_size=2, dtype="int8")


def test_as_jax_puts_arrays_on_the_device(snapshot):
    import jax

    loader = JaxLatentLoader(resolve_snapshot_dir(snapshot.parent.parent), batch_size=2, seed=0, as_jax=True)
    plain = JaxLatentLoader(snapshot, batch_size=2, seed=0)
    for have, want in zip(itertools.islice(loader, 3), itertools.islice(plain, 3)):
        assert isinstance(have["latents"], jax.Array) and isinstance(have["keys"], list)
        assert have["keys"] == want["keys"]
        assert np.array_equal(np.asarray(have["latents"]), want["latents"])


def test_import_needs_neither_torch_nor_jax():
    code = "import sys, latentmill.jax; print(sorted({'torch', 'jax'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
