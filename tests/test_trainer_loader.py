"""LatentLoader: one bucket per batch, every sample once per epoch, order a pure function of (seed, epoch),
and an exact mid-epoch resume from ``state_dict``."""

import itertools
import json

import pytest
import torch

from tests.trainer_helpers import write_fake_cache
from trainer.loader import LatentLoader, read_manifest

BUCKETS = {(48, 64, 1): 5, (64, 32, 1): 3, (32, 32, 1): 7}  # [width, height, frames] -> samples


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    write_fake_cache(root, BUCKETS, shards_per_bucket=2)
    return root


def _keys(batches):
    return [key for b in batches for key in b["keys"]]


def test_batches_hold_one_bucket_with_matching_shapes(cache):
    loader = LatentLoader(cache, batch_size=2, seed=0)
    meta_bucket = {}
    for bucket, refs in loader.buckets.items():
        for i, ref in enumerate(refs):
            meta = loader.read_metadata(bucket, i)
            assert meta["key"] == ref.key and tuple(meta["bucket"]) == bucket
            meta_bucket[ref.key] = bucket
    for batch in itertools.islice(loader, 3 * len(loader)):
        width, height, _ = batch["bucket"]
        B = len(batch["keys"])
        assert {meta_bucket[k] for k in batch["keys"]} == {tuple(batch["bucket"])}
        assert batch["latents"].shape == (B, 16, height // 8, width // 8)
        assert batch["prompt_embeds"].shape == (B, 8, 32)
        assert batch["pooled_prompt_embeds"].shape == (B, 32)
        assert all(
            batch[k].dtype == torch.float32 for k in ("latents", "prompt_embeds", "pooled_prompt_embeds")
        )


def test_every_sample_once_per_epoch(cache):
    loader = LatentLoader(cache, batch_size=2, seed=3)
    n = len(loader)
    assert n == 3 + 2 + 4  # ceil(5/2) + ceil(3/2) + ceil(7/2)
    batches = list(itertools.islice(loader, 2 * n))
    all_keys = sorted(f"s{i:05d}" for i in range(sum(BUCKETS.values())))
    for epoch in range(2):
        in_epoch = batches[epoch * n : (epoch + 1) * n]
        assert {b["epoch"] for b in in_epoch} == {epoch}
        assert [b["index"] for b in in_epoch] == list(range(n))
        assert sorted(_keys(in_epoch)) == all_keys
    assert _keys(batches[:n]) != _keys(batches[n:])  # a new shuffle each epoch


def test_drop_last_keeps_only_full_batches(cache):
    loader = LatentLoader(cache, batch_size=2, seed=0, drop_last=True)
    assert len(loader) == 2 + 1 + 3
    assert all(len(b["keys"]) == 2 for b in itertools.islice(loader, len(loader)))


def test_order_is_a_function_of_seed_and_epoch(cache):
    def order(seed, n_batches=18):
        return _keys(itertools.islice(LatentLoader(cache, batch_size=2, seed=seed), n_batches))

    assert order(0) == order(0)
    assert order(0) != order(1)
    # the batch plan alone, without reading data, is the same function
    loader = LatentLoader(cache, batch_size=2, seed=0)
    assert loader.epoch_batches(1) == LatentLoader(cache, batch_size=2, seed=0).epoch_batches(1)
    assert loader.epoch_batches(0) != loader.epoch_batches(1)


@pytest.mark.parametrize("consumed", [0, 4, 9, 13])  # start, mid-epoch, epoch boundary, second epoch
def test_state_dict_resumes_exactly(cache, consumed):
    loader = LatentLoader(cache, batch_size=2, seed=7)
    it = iter(loader)
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))  # must survive JSON
    expected = [next(it) for _ in range(6)]

    fresh = LatentLoader(cache, batch_size=2, seed=7)
    fresh.load_state_dict(state)
    got = list(itertools.islice(fresh, 6))
    for want, have in zip(expected, got):
        assert have["keys"] == want["keys"] and have["bucket"] == want["bucket"]
        for name in ("latents", "prompt_embeds", "pooled_prompt_embeds"):
            assert torch.equal(have[name], want[name])


def test_state_of_another_dataset_starts_a_new_epoch(cache):
    loader = LatentLoader(cache, batch_size=2, seed=7)
    loader.load_state_dict({"epoch": 2, "batch_index": 5, "seed": 7, "batch_size": 2, "dataset_id": "other"})
    assert (loader.epoch, loader.batch_index) == (3, 0)


def test_manifest_checks(tmp_path):
    with pytest.raises(FileNotFoundError, match="run the cache stage"):
        read_manifest(tmp_path)
    manifest = write_fake_cache(tmp_path, {(16, 16, 1): 3})
    manifest["shards"][0]["samples"] = 4
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest says 4 samples, the tar holds 3"):
        LatentLoader(tmp_path, batch_size=2)
    manifest["shards"][0]["samples"] = 3
    manifest["stage"] = "bucket"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="'cache' stage"):
        read_manifest(tmp_path)


def test_verify_detects_a_changed_shard(tmp_path):
    manifest = write_fake_cache(tmp_path, {(16, 16, 1): 2})
    LatentLoader(tmp_path, batch_size=2, verify=True)
    shard = tmp_path / manifest["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # tar padding: still a valid tar, different bytes
    shard.write_bytes(bytes(data))
    LatentLoader(tmp_path, batch_size=2)  # not checked unless asked
    with pytest.raises(ValueError, match="sha256 differs"):
        LatentLoader(tmp_path, batch_size=2, verify=True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_share_each_epoch_equally_and_disjointly(cache, world_size):
    loaders = [
        LatentLoader(cache, batch_size=2, seed=1, rank=r, world_size=world_size) for r in range(world_size)
    ]
    plan = loaders[0].global_batches(0)  # 9 batches
    per_rank = len(plan) // world_size
    assert [len(loader) for loader in loaders] == [per_rank] * world_size
    epochs = [list(itertools.islice(loader, per_rank)) for loader in loaders]
    seen = [key for batches in epochs for key in _keys(batches)]
    assert len(seen) == len(set(seen))  # no sample on two ranks
    expected = [k for _, idx in plan[: per_rank * world_size] for k in idx]
    assert len(seen) == len(expected)
    # the next batch of every rank is from epoch 1
    assert all(next(iter(loader))["epoch"] == 1 for loader in loaders)


# --- cache format 2: family, trimmed text, posterior distribution, empty prompt / caption dropout ---


def test_format_1_and_2_are_read_and_family_defaults_to_flux(tmp_path):
    v1 = write_fake_cache(tmp_path / "v1", {(16, 16, 1): 2}, format_version=1)
    assert "family" not in v1 and LatentLoader(tmp_path / "v1", batch_size=2).family == "flux"
    write_fake_cache(tmp_path / "v2", {(16, 16, 9): 2}, family="wan")
    assert LatentLoader(tmp_path / "v2", batch_size=2).family == "wan"
    manifest = json.loads((tmp_path / "v2" / "manifest.json").read_text())
    manifest["format_version"] = 3
    (tmp_path / "v2" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format_version 3, this trainer reads 1 and 2"):
        read_manifest(tmp_path / "v2")


def test_trimmed_prompt_embeds_are_zero_padded_to_pad_to(tmp_path):
    write_fake_cache(tmp_path, {(32, 16, 9): 5}, family="wan", trimmed=True, seq_len=12)
    loader = LatentLoader(tmp_path, batch_size=5, seed=0)
    batch = next(iter(loader))
    assert batch["latents"].shape == (5, 16, 3, 2, 4)  # 9 frames -> 3 latent frames
    assert batch["prompt_embeds"].shape == (5, 12, 32) and "pooled_prompt_embeds" not in batch
    for i, key in enumerate(batch["keys"]):
        ref = next(r for r in loader.buckets[(32, 16, 9)] if r.key == key)
        from safetensors.torch import load as load_st

        raw = load_st(loader._read(ref, "text.safetensors"))["prompt_embeds"]
        n = raw.shape[0]
        assert 2 <= n <= 12
        assert torch.equal(batch["prompt_embeds"][i, :n], raw.float())
        assert not batch["prompt_embeds"][i, n:].any()  # zeros, like WanPipeline's padding


def test_pad_tokens_refuses_more_tokens_than_pad_to():
    from trainer.loader import pad_tokens

    assert pad_tokens(torch.ones(3, 2), 5).tolist() == [[1, 1]] * 3 + [[0, 0]] * 2
    with pytest.raises(ValueError, match="more than the manifest's text.pad_to"):
        pad_tokens(torch.ones(6, 2), 5)


def test_distribution_caches_carry_latents_std(tmp_path):
    write_fake_cache(tmp_path, {(16, 16, 1): 2}, latents="distribution")
    batch = next(iter(LatentLoader(tmp_path, batch_size=2)))
    assert batch["latents_std"].shape == batch["latents"].shape
    assert (batch["latents_std"] > 0).all()


def test_caption_dropout_is_seeded_per_sample_and_epoch(tmp_path):
    from safetensors.torch import load_file

    write_fake_cache(tmp_path, {(16, 16, 9): 40}, family="wan", trimmed=True, seq_len=6)
    empty = load_file(tmp_path / "empty_prompt.safetensors")["prompt_embeds"].float()
    loader = LatentLoader(tmp_path, batch_size=8, seed=3, caption_dropout=0.25)
    batches = list(itertools.islice(loader, 10))  # two epochs
    dropped = torch.cat([b["caption_dropped"] for b in batches])
    assert 0.1 < dropped.float().mean() < 0.45  # 80 draws at p = 0.25
    for b in batches:
        for i, drop in enumerate(b["caption_dropped"]):
            if drop:
                assert torch.equal(b["prompt_embeds"][i, :1], empty) and not b["prompt_embeds"][i, 1:].any()
    # a pure function of (seed, epoch, key): the same decisions after a resume, new ones next epoch
    again = LatentLoader(tmp_path, batch_size=8, seed=3, caption_dropout=0.25)
    again.load_state_dict(json.loads(json.dumps({**loader.state_dict(), "epoch": 0, "batch_index": 2})))
    for want, have in zip(batches[2:], itertools.islice(again, 8)):
        assert have["keys"] == want["keys"] and torch.equal(have["caption_dropped"], want["caption_dropped"])
        assert torch.equal(have["prompt_embeds"], want["prompt_embeds"])
    by_epoch = [{k: bool(d) for b in batches[e * 5 : e * 5 + 5] for k, d in zip(b["keys"], b["caption_dropped"])}
                for e in (0, 1)]  # fmt: skip
    assert by_epoch[0] != by_epoch[1]
    assert not torch.cat([b["caption_dropped"] for b in itertools.islice(LatentLoader(tmp_path, 8), 5)]).any()


def test_caption_dropout_needs_the_empty_prompt(tmp_path):
    write_fake_cache(tmp_path, {(16, 16, 1): 2}, format_version=1)
    with pytest.raises(ValueError, match="no empty_prompt entry"):
        LatentLoader(tmp_path, batch_size=2, caption_dropout=0.1)


def test_prefetch_changes_neither_batches_nor_position(cache):
    with LatentLoader(cache, batch_size=3, seed=5, prefetch=True) as ahead, \
            LatentLoader(cache, batch_size=3, seed=5, prefetch=False) as plain:
        fast, slow = iter(ahead), iter(plain)
        for n in range(1, 3 * len(ahead) + 2):  # across epoch boundaries
            a, b = next(fast), next(slow)
            assert _keys([a]) == _keys([b]) and torch.equal(a["latents"], b["latents"])
            assert ahead.state_dict() == plain.state_dict()
            assert ahead.epoch * len(ahead) + ahead.batch_index == n  # handed out n, whatever was read ahead
