"""The block shuffle (``loader.shuffle_block``): each bucket's shards shuffled and cut into blocks, samples
shuffled within a block, blocks read one after another; every sample once per epoch, the shards live at any
point bounded by a block, the order the same on 1, 2 and 4 ranks of one global batch, and resume exact."""

import itertools
import json

import pytest
from latentmill.trainer.config import LoaderConfig
from latentmill.trainer.loader import LatentLoader

from latentmill.core.config import ConfigError
from latentmill.recipe import recipe_from_dict
from tests.trainer_helpers import write_fake_cache

# shards of 6 and 4 samples (4 per bucket): a multiple of the global batch of 2, so no batch straddles shards
ALIGNED = {(16, 16, 1): 24, (32, 16, 1): 16}
# shards of 5, 3 and 2 samples against global batches of 4: blocks end inside shards
RAGGED = {(16, 16, 1): 20, (32, 16, 1): 9, (16, 32, 1): 7}


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    root = tmp_path_factory.mktemp("aligned")
    write_fake_cache(root, ALIGNED, shards_per_bucket=4)
    return root


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    root = tmp_path_factory.mktemp("ragged")
    write_fake_cache(root, RAGGED, shards_per_bucket=4)
    return root


def _shards(loader, plan):
    """The shards each batch of ``plan`` reads, in order."""
    return [{loader.buckets[bucket][i].shard for i in indices} for bucket, indices in plan]


def _keys(loader, plan):
    return [loader.buckets[bucket][i].key for bucket, indices in plan for i in indices]


def _most_live(shards_per_batch):
    """The most shards live at once: read before and again after some batch (what a cache must hold to fetch
    each shard once)."""
    first, last = {}, {}
    for i, shards in enumerate(shards_per_batch):
        for s in shards:
            first.setdefault(s, i)
            last[s] = i
    return max(sum(1 for s in first if first[s] <= i <= last[s]) for i in range(len(shards_per_batch)))


@pytest.mark.parametrize("block", [1, 2])
def test_every_sample_once_and_at_most_a_block_of_shards_live(aligned, block):
    loader = LatentLoader(aligned, batch_size=2, seed=5, shuffle_block=block, prefetch=False)
    whole = LatentLoader(aligned, batch_size=2, seed=5, prefetch=False)
    everything = sorted(f"s{i:05d}" for i in range(sum(ALIGNED.values())))
    for epoch in range(2):
        plan = loader.global_batches(epoch)
        assert len(plan) == len(whole.global_batches(epoch)) == 20
        assert sorted(_keys(loader, plan)) == everything
        shards = _shards(loader, plan)
        assert max(len(s) for s in shards) == block  # a batch reads its block's shards, no other
        assert _most_live(shards) == block  # a block's shards, then the next block's
        # each bucket's shards are shuffled: not read in the manifest's order
        assert [min(s) for s in shards] != sorted(min(s) for s in shards)
    assert _keys(loader, loader.global_batches(0)) != _keys(loader, loader.global_batches(1))
    # the whole-bucket shuffle keeps nearly every shard live: what the block shuffle bounds
    assert _most_live(_shards(whole, whole.global_batches(0))) >= 6
    # the read batches follow the plan
    read = [k for b in itertools.islice(iter(loader), len(loader)) for k in b["keys"]]
    assert read == _keys(loader, loader.global_batches(0))


def test_ragged_shards_every_sample_once_and_batches_within_a_block(ragged):
    for drop_last in (False, True):
        loader = LatentLoader(ragged, batch_size=4, seed=2, shuffle_block=2, drop_last=drop_last, prefetch=False)
        whole = LatentLoader(ragged, batch_size=4, seed=2, drop_last=drop_last, prefetch=False)
        plan, reference = loader.global_batches(0), whole.global_batches(0)
        # the same batches per bucket, of the same sizes, as the whole-bucket shuffle (drop_last alike)
        assert sorted(zip(plan.which.tolist(), plan.sizes.tolist())) == sorted(
            zip(reference.which.tolist(), reference.sizes.tolist()))
        keys = _keys(loader, plan)
        assert len(keys) == len(set(keys)) == (36 if not drop_last else 20 + 8 + 4)
        assert plan.first.tolist() == [0, *itertools.accumulate(plan.sizes.tolist())][:-1]
        # a batch reads its block's 2 shards and at most the heads of the next ones up to a batch boundary
        assert max(len(s) for s in _shards(loader, plan)) <= 4
        # a bucket's batches come in runs (its blocks): far fewer switches of bucket than batches
        switches = sum(1 for a, b in zip(plan.which, plan.which[1:]) if a != b)
        assert switches <= 6 < len(plan) - 1


def test_the_order_is_the_same_on_one_two_and_four_ranks(aligned):
    def loaders(world):
        return [LatentLoader(aligned, batch_size=4 // world, seed=9, rank=r, world_size=world, shuffle_block=2,
                             prefetch=False) for r in range(world)]

    one = loaders(1)[0]
    plan = one.global_batches(0)
    for world in (2, 4):
        ranks = loaders(world)
        assert all(r.global_batches(0) == plan for r in ranks)
        per_rank = [[list(map(r.buckets[b].__getitem__, i)) for b, i in r.epoch_batches(0)] for r in ranks]
        together = [ref.key for batches in zip(*per_rank) for part in batches for ref in part]
        assert together == _keys(one, plan)  # slice r of each global batch on rank r: the same sequence


@pytest.mark.parametrize("consumed", [3, 10, 13])  # mid-epoch, epoch boundary, second epoch
def test_a_mid_epoch_state_resumes_exactly_on_another_number_of_ranks(aligned, consumed):
    loader = LatentLoader(aligned, batch_size=2, seed=4, shuffle_block=1, rank=1, world_size=2, prefetch=False)
    it = iter(loader)
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["shuffle_block"] == 1
    alone = LatentLoader(aligned, batch_size=4, seed=4, shuffle_block=1, prefetch=False)
    alone.load_state_dict(state)
    want = [next(it)["keys"] for _ in range(4)]
    have = [b["keys"][2:] for b in itertools.islice(iter(alone), 4)]  # rank 1's slice of each global batch
    assert have == want
    # a state of another shuffle is another sequence: a new epoch
    other = LatentLoader(aligned, batch_size=4, seed=4, shuffle_block=2, prefetch=False)
    other.load_state_dict(state)
    assert (other.epoch, other.batch_index) == (state["epoch"] + 1, 0)


def test_the_key_is_validated_in_one_line():
    assert recipe_from_dict({"output_dir": "x", "model": {"pretrained": "p"},
                             "loader": {"shuffle_block": 4}}).loader.shuffle_block == 4
    with pytest.raises(ConfigError, match=r"^loader.shuffle_block: a number of shards >= 1, or null \(each bucket "
                                          r"shuffled whole\), got 0$"):
        LoaderConfig(shuffle_block=0).validate()
    with pytest.raises(ConfigError, match=r"^loader.shuffle_block: 'many' does not fit"):
        recipe_from_dict({"output_dir": "x", "model": {"pretrained": "p"}, "loader": {"shuffle_block": "many"}})


@pytest.mark.slow  # builds a tiny transformer
def test_training_reads_the_block_order(tmp_path):
    """``train(loader=LoaderConfig(shuffle_block=...))`` trains on the block order: the steps' recorded samples
    are the loader's plan."""
    from latentmill.trainer import TrainerConfig, train

    from tests.trainer_helpers import build_tiny_transformer, torch_threads

    build_tiny_transformer(tmp_path / "pretrained")
    write_fake_cache(tmp_path / "cache", ALIGNED, shards_per_bucket=4)
    cfg = TrainerConfig(max_steps=2, batch_size=2, save_every=0, export=False, tensorboard=False,
                        record_samples=True, mode="full")
    with torch_threads(1):
        train(cfg, cache_dir=tmp_path / "cache", pretrained=str(tmp_path / "pretrained"), train_dir=tmp_path / "train",
              seed=3, progress=False, loader=LoaderConfig(shuffle_block=2))
    records = [json.loads(line) for line in (tmp_path / "train" / "samples-rank0.jsonl").read_text().splitlines()]
    read = [k for r in records for b in r["batches"] for k in b["keys"]]
    plan = LatentLoader(tmp_path / "cache", batch_size=2, seed=3, shuffle_block=2).global_batches(0)
    assert read == _keys(LatentLoader(tmp_path / "cache", batch_size=2, seed=3), plan)[:4]
