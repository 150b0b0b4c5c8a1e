"""LatentLoader: one bucket per batch, every sample once per epoch, order a pure function of (seed, epoch),
and an exact mid-epoch resume from ``state_dict``."""

import itertools
import json

import pytest
import torch
from latentmill.stages.tarshard import index_shard
from latentmill.trainer.loader import CacheFormatError, LatentLoader, read_manifest

from tests.trainer_helpers import old_cache, reindex, write_fake_cache

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
    # 2 ranks of 4: no bucket holds a global batch of 8
    with pytest.raises(ValueError, match=r"^no batch of 4 per rank x 2 ranks in any bucket: lower batch_size"):
        next(iter(LatentLoader(cache, batch_size=4, seed=0, drop_last=True, rank=1, world_size=2)))


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
    with pytest.raises(ValueError, match="manifest says 4 samples, the index holds 3"):
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
def test_ranks_read_slices_of_the_global_batches_one_rank_reads(cache, world_size):
    """Rank r reads the r-th slice of each global batch: together the ranks read what one rank with their global
    batch reads, in the same order, with the same epoch ordinals, so a position saved on one number of ranks
    continues on another."""
    loaders = [LatentLoader(cache, batch_size=2, seed=1, rank=r, world_size=world_size) for r in range(world_size)]
    alone = LatentLoader(cache, batch_size=2 * world_size, seed=1)
    assert loaders[0].global_batches(0) == alone.global_batches(0)
    assert [len(loader) for loader in loaders] == [len(alone)] * world_size

    def epoch0(loader):
        return list(itertools.takewhile(lambda b: b["epoch"] == 0, LatentLoader(
            cache, batch_size=loader.batch_size, seed=1, rank=loader.rank, world_size=loader.world_size)))

    ranks, whole = [epoch0(loader) for loader in loaders], epoch0(alone)
    assert len({len(batches) for batches in ranks}) == 1  # in step: the same count on every rank
    # a partial batch of fewer samples than ranks (2 ranks: the 5-sample bucket's last 1; 4: the 3-sample
    # bucket) gives no rank a sample: every rank passes over it
    assert len(whole) - len(ranks[0]) == 1
    by_index = {b["index"]: b for b in whole}
    for at in zip(*ranks):
        assert len({b["index"] for b in at}) == 1 and len({len(b["keys"]) for b in at}) == 1
        one = by_index[at[0]["index"]]
        n = len(at[0]["keys"]) * world_size  # a partial batch's rest over a multiple of the ranks is skipped
        assert [k for b in at for k in b["keys"]] == one["keys"][:n]
        assert [o for b in at for o in b["ordinals"]] == one["ordinals"][:n]
    seen = [k for batches in ranks for k in _keys(batches)]
    assert len(seen) == len(set(seen))  # no sample on two ranks
    # what a multiple of the ranks leaves of the partial batches: 2 ranks (batches of 4) 1 + 1 + 1 of 1, 3, 3;
    # 4 ranks (batches of 8) 1 + 3 + 3 of 5, 3, 7
    assert len(seen) == sum(BUCKETS.values()) - (3 if world_size == 2 else 7)

    # a position saved on these ranks (before a global batch that every rank reads from) continues on one rank
    # of the same global batch
    plan = loaders[0].global_batches(0)
    at = next(i for i in range(1, len(plan)) if plan.sizes[i] >= world_size)
    loaders[0].load_state_dict({**loaders[0].state_dict(), "batch_index": at})
    state = json.loads(json.dumps(loaders[0].state_dict()))
    one = LatentLoader(cache, batch_size=2 * world_size, seed=1)
    one.load_state_dict(state)
    assert (one.epoch, one.batch_index) == (0, at)
    want, have = next(iter(loaders[0])), next(iter(one))
    assert have["keys"][: len(want["keys"])] == want["keys"] and have["ordinals"][0] == want["ordinals"][0]
    other = LatentLoader(cache, batch_size=2, seed=1)  # another global batch: another sequence, a new epoch
    other.load_state_dict(state)
    assert (other.epoch, other.batch_index) == (1, 0)


# --- the cache format: 3 only; family, trimmed text, posterior distribution, empty prompt / caption dropout ---


@pytest.mark.parametrize("version", [1, 2])
def test_format_1_and_2_are_refused_with_one_line_that_says_how_to_upgrade(tmp_path, version):
    write_fake_cache(tmp_path, {(16, 16, 1): 2})
    old_cache(tmp_path, version)
    path = tmp_path / "manifest.json"
    want = (f"{path}: cache format {version} is no longer read; re-run `latentmill prep <recipe>` to index it "
            "(nothing is re-encoded)")
    for build in (lambda: read_manifest(tmp_path), lambda: LatentLoader(tmp_path, batch_size=2),
                  lambda: LatentLoader(tmp_path, batch_size=2, manifest=json.loads(path.read_text()))):
        with pytest.raises(CacheFormatError) as err:
            build()
        assert str(err.value) == want


def test_format_3_is_read_and_another_version_is_refused(tmp_path):
    write_fake_cache(tmp_path, {(16, 16, 9): 2}, family="wan")
    assert LatentLoader(tmp_path, batch_size=2).family == "wan"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["format_version"] = 4
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format_version 4, this trainer reads 3"):
        read_manifest(tmp_path)


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


MASKED_STREAMS = [{"name": "latents", "component": "vae", "shape": "[C, F', H/8, W/8]", "normalisation": "",
                   "pad": "none"},
                  {"name": "prompt_embeds", "component": "text", "shape": "[L, D]", "normalisation": "",
                   "pad": "mask"}]


def test_a_mask_stream_gets_its_mask_column(tmp_path):
    """A text stream declared with pad "mask" (Qwen-Image, Z-Image) is zero-padded to pad_to like a "zeros"
    stream, and the batch carries ``<name>_mask``: True on exactly the tokens each sample stored, also for
    a caption dropped to the (one-token) empty prompt."""
    from safetensors.torch import load as load_st

    write_fake_cache(tmp_path, {(32, 16, 9): 6}, family="wan", trimmed=True, seq_len=12, streams=MASKED_STREAMS)
    loader = LatentLoader(tmp_path, batch_size=6, seed=0, caption_dropout=0.5)
    batch = next(iter(loader))
    assert batch["prompt_embeds"].shape == (6, 12, 32)
    mask = batch["prompt_embeds_mask"]
    assert mask.dtype == torch.bool and mask.shape == (6, 12)
    assert 0 < int(batch["caption_dropped"].sum()) < 6  # both kinds of row in the batch
    for i, key in enumerate(batch["keys"]):
        ref = next(r for r in loader.buckets[(32, 16, 9)] if r.key == key)
        n = 1 if batch["caption_dropped"][i] else load_st(loader._read(ref, "text.safetensors"))["prompt_embeds"].shape[0]
        assert mask[i].tolist() == [True] * n + [False] * (12 - n)
        assert not batch["prompt_embeds"][i, n:].any()
    # a cache without the rule (Wan's "zeros") has no mask column
    write_fake_cache(tmp_path / "zeros", {(32, 16, 9): 2}, family="wan", trimmed=True, seq_len=12)
    assert "prompt_embeds_mask" not in next(iter(LatentLoader(tmp_path / "zeros", batch_size=2, seed=0)))


def test_streams_of_a_manifest_and_the_family_check(tmp_path):
    """A manifest without ``streams`` (written before they were recorded) has its family's; the trainer
    refuses a cache of another family, or one without a stream the model reads, in one line."""
    from latentmill.trainer.loader import CacheFamilyError, check_streams, manifest_streams

    manifest = write_fake_cache(tmp_path, {(32, 32, 1): 2})
    assert "streams" not in manifest
    assert [s["name"] for s in manifest_streams(manifest)] == ["latents", "prompt_embeds", "pooled_prompt_embeds"]
    check_streams(manifest, "flux", ("latents", "prompt_embeds", "pooled_prompt_embeds"), "m.json")
    with pytest.raises(CacheFamilyError, match="made for the 'flux' family, the recipe trains 'wan'"):
        check_streams(manifest, "wan", ("latents", "prompt_embeds"), "m.json")
    with pytest.raises(CacheFamilyError, match="prompt_embeds_2 missing"):
        check_streams(manifest, "flux", ("latents", "prompt_embeds_2"), "m.json")


def test_pad_tokens_refuses_more_tokens_than_pad_to():
    from latentmill.trainer.loader import pad_tokens

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
    manifest = write_fake_cache(tmp_path, {(16, 16, 1): 2})
    del manifest["empty_prompt"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
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


# --- the direct read path: safetensors headers parsed by the loader, payloads read into the batch tensors ---


def _add_second_captions(cache_dir, seed=1):
    """Give every sample of a fake cache a ``text.1.safetensors`` (other random tensors, other lengths)."""
    import io
    import tarfile

    from safetensors.torch import load as load_st
    from safetensors.torch import save as save_st

    gen = torch.Generator().manual_seed(seed)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    for entry in manifest["shards"]:
        path = cache_dir / entry["path"]
        with tarfile.open(path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for member, data in members:
                tar.addfile(member, io.BytesIO(data))
                if member.name.endswith(".text.safetensors"):
                    first = load_st(data)
                    n = int(torch.randint(1, first["prompt_embeds"].shape[0] + 1, (1,), generator=gen))
                    shapes = {k: v.shape if k != "prompt_embeds" else (n, *v.shape[1:]) for k, v in first.items()}
                    other = {k: torch.randn(shapes[k], generator=gen).to(v.dtype) for k, v in first.items()}
                    info = tarfile.TarInfo(member.name.replace(".text.", ".text.1."))
                    info.size = len(blob := save_st(other))
                    tar.addfile(info, io.BytesIO(blob))
        path.write_bytes(out.getvalue())
    reindex(cache_dir)


def _reference_batch(loader, batch, seed, dropout, empty):
    """The batch as the loader built it before: safetensors ``load`` per member, pad, ``torch.stack``."""
    from latentmill.trainer.loader import caption_choice, caption_dropped, pad_tokens
    from safetensors.torch import load as load_st

    refs = {ref.key: ref for refs in loader.buckets.values() for ref in refs}
    columns = {}
    for key in batch["keys"]:
        ref = refs[key]
        vae = load_st(loader._read(ref, "vae.safetensors"))
        texts = ref.texts
        text = load_st(loader._read(ref, texts[caption_choice(seed, batch["epoch"], key, len(texts))]))
        if caption_dropped(seed, batch["epoch"], key, dropout):
            text = empty
        sample = {"latents": vae["latents"], **text}
        if loader.distribution:
            sample["latents_std"] = vae["latents_std"]
        if loader.pad_to is not None:
            sample["prompt_embeds"] = pad_tokens(sample["prompt_embeds"], loader.pad_to)
        for name, tensor in sample.items():
            columns.setdefault(name, []).append(tensor)
    return {name: torch.stack(ts).to(loader.dtype) for name, ts in columns.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("empty_dtype", [None, torch.float32])  # float32: dropped rows promote the column
def test_direct_read_equals_a_reference_decode(tmp_path, monkeypatch, dtype, empty_dtype):
    import hashlib

    import latentmill.trainer.batch_reader as batch_reader
    from safetensors.torch import load_file, save_file

    buckets = {(32, 16, 1): 11, (16, 16, 1): 6}
    write_fake_cache(tmp_path, buckets, trimmed=True, seq_len=9, latents="distribution", shards_per_bucket=2)
    _add_second_captions(tmp_path)
    if empty_dtype is not None:  # an empty prompt stored in another dtype than the samples
        path = tmp_path / "empty_prompt.safetensors"
        save_file({k: v.to(empty_dtype) for k, v in load_file(path).items()}, str(path))
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        manifest["empty_prompt"]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    empty = load_file(tmp_path / "empty_prompt.safetensors")
    monkeypatch.setattr(batch_reader, "PARALLEL_READ_BYTES", 0)  # also the several-threads path
    seed, dropout = 4, 0.3
    for io_threads, prefetch in [(1, False), (3, True)]:
        loader = LatentLoader(tmp_path, batch_size=4, seed=seed, dtype=dtype, caption_dropout=dropout,
                              io_threads=io_threads, prefetch=prefetch)  # fmt: skip
        assert all(ref.texts == ("text.safetensors", "text.1.safetensors") for r in loader.buckets.values()
                   for ref in r)  # fmt: skip
        batches = list(itertools.islice(loader, 3 * len(loader)))
        assert torch.cat([b["caption_dropped"] for b in batches]).any()
        for batch in batches:
            want = _reference_batch(loader, batch, seed, dropout, empty)
            got = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "caption_dropped"}
            assert set(got) == set(want)
            assert set(want) == {"latents", "latents_std", "prompt_embeds", "pooled_prompt_embeds"}
            for name in want:
                assert got[name].dtype == want[name].dtype == dtype and got[name].is_contiguous()
                assert torch.equal(got[name], want[name]), name
        loader.close()


@pytest.mark.parametrize("trimmed", [True, False])
def test_batches_of_samples_with_one_header_are_read_by_a_plan_and_equal_the_reference(
    tmp_path, monkeypatch, trimmed
):
    """Samples that share their VAE and text headers (a bucket's samples usually do) are read by a plan
    built once per header pair (``ShardReader._read_planned``): dropped captions, padding to pad_to, a
    second caption and latents_std come out as the reference decode has them; other batches take the
    general path."""
    import hashlib

    from latentmill.trainer.batch_reader import ShardReader
    from safetensors.torch import load_file, save_file

    from tests.trainer_helpers import SEQ_LEN

    buckets = {(32, 16, 1): 9, (16, 16, 1): 5}
    if trimmed:  # 2 or 3 real tokens padded to 3, second captions of 1 to 3: many batches share headers
        write_fake_cache(tmp_path, buckets, trimmed=True, seq_len=3, latents="distribution", shards_per_bucket=2)
        _add_second_captions(tmp_path)
    else:  # every caption SEQ_LEN tokens; the empty prompt as long, as the cache stage writes it untrimmed
        write_fake_cache(tmp_path, buckets, latents="distribution")
        path = tmp_path / "empty_prompt.safetensors"
        empty = load_file(path)
        empty["prompt_embeds"] = torch.randn(SEQ_LEN, empty["prompt_embeds"].shape[1]).to(torch.bfloat16)
        save_file(empty, str(path))
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        manifest["empty_prompt"]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    empty = load_file(tmp_path / "empty_prompt.safetensors")
    planned = []  # per planned batch: whether it has a dropped caption
    original = ShardReader._read_planned

    def spy(self, plan, refs, texts):
        planned.append(any(text is None for text in texts))
        return original(self, plan, refs, texts)

    monkeypatch.setattr(ShardReader, "_read_planned", spy)
    seed, dropout = 7, 0.3
    with LatentLoader(tmp_path, batch_size=2, seed=seed, caption_dropout=dropout, prefetch=False) as loader:
        batches = list(itertools.islice(loader, 4 * len(loader)))
        for batch in batches:
            want = _reference_batch(loader, batch, seed, dropout, empty)
            for name in ("latents", "latents_std", "prompt_embeds", "pooled_prompt_embeds"):
                assert torch.equal(batch[name], want[name]), name
        plans = len(loader._reader._plans)
    assert any(planned) and not all(planned)  # planned batches with a dropped caption and without one
    assert len(planned) < len(batches) if trimmed else len(planned) == len(batches)
    assert 1 <= plans <= (6 if trimmed else 2)  # one per header pair (per bucket untrimmed), not per batch


def _member_header(path, key, ext):
    """(file offset, bytes) of the JSON header of a safetensors member in a shard."""
    offset, _ = dict(index_shard(path))[key][ext]
    data = path.read_bytes()
    n = int.from_bytes(data[offset : offset + 8], "little")
    return offset + 8, data[offset + 8 : offset + 8 + n]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda h: h.replace(b'"BF16"', b'"XF16"', 1), "unknown dtype 'XF16'"),
        (lambda h: h.replace(b'"shape":[16,', b'"shape":[17,', 1), r"hold 128 bytes, BF16 \[17, 2, 2\] needs"),
        (lambda h: h.replace(b'"data_offsets":[0,', b'"data_offsets":[2,', 1), "data_offsets"),
        (lambda h: b'"' + b"a" * (len(h) - 2) + b'"', "not a JSON object"),
        (lambda h: h[:-3] + b"xyz", "not JSON"),
    ],
)
def test_a_corrupt_member_header_names_the_shard_and_the_key(tmp_path, corrupt, message):
    manifest = write_fake_cache(tmp_path, {(16, 16, 1): 3})
    shard = tmp_path / manifest["shards"][0]["path"]
    at, header = _member_header(shard, "s00001", "vae.safetensors")
    bad = corrupt(header)
    assert len(bad) == len(header)
    data = bytearray(shard.read_bytes())
    data[at : at + len(header)] = bad
    shard.write_bytes(bytes(data))
    reindex(tmp_path)  # the index gives the bad header no layout: the loader reads and checks it itself
    loader = LatentLoader(tmp_path, batch_size=3)  # the index reads headers, it does not refuse samples
    with pytest.raises(ValueError, match=message) as err:
        next(iter(loader))
    text = str(err.value)
    assert str(shard) in text and "'s00001'" in text and "s00001.vae.safetensors" in text


def test_a_header_length_past_the_member_is_refused(tmp_path):
    manifest = write_fake_cache(tmp_path, {(16, 16, 1): 2})
    shard = tmp_path / manifest["shards"][0]["path"]
    at, header = _member_header(shard, "s00000", "text.safetensors")
    data = bytearray(shard.read_bytes())
    data[at - 8 : at] = (10**6).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    reindex(tmp_path)
    with pytest.raises(ValueError, match=r"s00000.*text\.safetensors.*header length 1000000 runs past"):
        next(iter(LatentLoader(tmp_path, batch_size=2, prefetch=False)))


def test_the_index_lists_what_the_walker_lists_and_odd_tars_walk_as_tarfile_does(tmp_path):
    import io
    import tarfile

    from latentmill.stages.shardindex import load_shard_index
    from latentmill.stages.tarshard import tar_members

    manifest = write_fake_cache(tmp_path, {(16, 16, 1): 5, (32, 16, 1): 3})
    for entry in manifest["shards"]:
        path = tmp_path / entry["path"]
        index = load_shard_index(path, entry["index"])
        assert index.samples() == index_shard(path)  # the writer's index is the one walker's and rule's
        assert all(layout >= 0 for layout, name in zip(index.columns["member_layout"], index.columns["member_name"])
                   if index.names[name].endswith(".safetensors"))  # every safetensors header came with it
    # directories, a ustar prefix, a pax header (long name): the fast path or tarfile, the same members
    for fmt in (tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            long_path = "x" * 90 + "/" + "y" * 60 + ".vae.safetensors"  # a ustar prefix
            names = [("d", None), ("d/a.json", 3), (long_path, 700), ("noext", 1)]
            if fmt != tarfile.USTAR_FORMAT:
                names.append(("z" * 120 + ".json", 5))  # too long for ustar: a pax / GNU long-name header
            for name, size in names:
                info = tarfile.TarInfo(name)
                if size is None:
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                else:
                    info.size = size
                    tar.addfile(info, io.BytesIO(bytes(size)))
        path = tmp_path / f"odd-{fmt}.tar"
        path.write_bytes(buf.getvalue())
        with tarfile.open(path) as tar:
            assert tar_members(path) == [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
        assert [key for key, _ in index_shard(path)] == ["d/a", "x" * 90 + "/" + "y" * 60] + (
            ["z" * 120] if fmt != tarfile.USTAR_FORMAT else [])


def test_read_ahead_in_a_thread_changes_neither_batches_nor_position(cache, monkeypatch):
    """A consumer slow enough for the read-ahead thread (forced here) gets what a plain loader gives."""
    import threading

    import latentmill.trainer.loader as loader_module

    monkeypatch.setattr(loader_module, "PREFETCH_MIN_CONSUMER_S", 0.0)
    monkeypatch.setattr(loader_module, "PREFETCH_DELAY_SHARE", 1.0)  # and the delayed start
    with LatentLoader(cache, batch_size=3, seed=5, prefetch=True) as ahead, \
            LatentLoader(cache, batch_size=3, seed=5, prefetch=False) as plain:
        fast, slow = iter(ahead), iter(plain)
        for n in range(1, 3 * len(ahead) + 2):
            a, b = next(fast), next(slow)
            if n == 2:
                assert any(t.name.startswith("latent-prefetch") for t in threading.enumerate())
            assert _keys([a]) == _keys([b]) and (a["epoch"], a["index"]) == (b["epoch"], b["index"])
            for name in ("latents", "prompt_embeds", "pooled_prompt_embeds"):
                assert torch.equal(a[name], b[name])
            assert ahead.state_dict() == plain.state_dict()
            assert ahead.epoch * len(ahead) + ahead.batch_index == n
        state = ahead.state_dict()
    resumed = LatentLoader(cache, batch_size=3, seed=5, prefetch=True)
    resumed.load_state_dict(state)
    assert _keys([next(iter(resumed))]) == _keys([next(slow)])


def test_the_read_ahead_thread_runs_no_dtype_conversion(cache, monkeypatch):
    """The bf16 -> float32 conversion is a multi-threaded torch op: run in the read-ahead thread, its
    OpenMP team fought the training step's for the cores (CPU steps 1.3-1.5x slower). It runs in the
    consumer's thread, when the batch is handed out."""
    import threading

    import latentmill.trainer.loader as loader_module

    monkeypatch.setattr(loader_module, "PREFETCH_MIN_CONSUMER_S", 0.0)
    converted_in = []
    original = LatentLoader._convert

    def spy(self, batch):
        converted_in.append(threading.current_thread().name)
        return original(self, batch)

    monkeypatch.setattr(LatentLoader, "_convert", spy)
    with LatentLoader(cache, batch_size=3, seed=5, dtype=torch.float32, prefetch=True) as loader:
        it = iter(loader)
        batches = [next(it) for _ in range(4)]
    assert converted_in and set(converted_in) == {threading.current_thread().name}
    assert all(b["latents"].dtype == torch.float32 and b["prompt_embeds"].dtype == torch.float32 for b in batches)
    raw = loader._read_batch(*loader.epoch_batches(0)[0], 0, convert=False)
    assert raw["latents"].dtype == torch.bfloat16  # what the fake cache stores


def _advice_spy(monkeypatch):
    """Record (shard path, offset, length) of every POSIX_FADV_WILLNEED; every advice is given for real."""
    import os

    advised = []
    real_fadvise = os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    return advised


def _members_read(loader, batch, seed):
    """What a batch reads: (shard path, offset, size) of its VAE member and its caption's text member."""
    import latentmill.trainer.loader as loader_module

    out = []
    for key, dropped in zip(batch["keys"], batch["caption_dropped"].tolist()):
        ref = next(r for refs in loader.buckets.values() for r in refs if r.key == key)
        text = ref.texts[loader_module.caption_choice(seed, batch["epoch"], key, len(ref.texts))]
        for member in ["vae.safetensors"] + ([] if dropped else [text]):
            out.append((str(loader.shard_paths[ref.shard].resolve()), *ref.members[member]))
    return out


def test_samples_on_disk_get_the_next_batches_advised_and_the_same_batches(tmp_path, monkeypatch):
    """Samples not in the page cache: when a batch is handed out, the kernel has been asked
    (POSIX_FADV_WILLNEED) for exactly the members of it and of the next ADVISE_AHEAD_BATCHES batches (the
    VAE member and the caption that epoch reads, nothing for a dropped caption). Batches are unchanged."""
    import collections

    import latentmill.trainer.loader as loader_module

    buckets = {(32, 16, 1): 11, (16, 16, 1): 6}
    write_fake_cache(tmp_path, buckets, trimmed=True, seq_len=9, shards_per_bucket=2)
    _add_second_captions(tmp_path)
    ahead = loader_module.ADVISE_AHEAD_BATCHES
    assert ahead >= 1
    options = dict(batch_size=3, seed=2, caption_dropout=0.3, prefetch=False)
    with LatentLoader(tmp_path, **options) as plain:
        count = 2 * len(plain) + 1  # across an epoch boundary
        expected = list(itertools.islice(plain, count + ahead))
    assert torch.cat([b["caption_dropped"] for b in expected]).any()

    advised = _advice_spy(monkeypatch)
    monkeypatch.setattr(LatentLoader, "_on_disk_now", lambda self, ref: True)  # every sample on disk
    with LatentLoader(tmp_path, **options) as on_disk:
        it = iter(on_disk)
        for n in range(count):
            got, want = next(it), expected[n]
            assert got["keys"] == want["keys"] and torch.equal(got["caption_dropped"], want["caption_dropped"])
            for name in ("latents", "prompt_embeds", "pooled_prompt_embeds"):
                assert torch.equal(got[name], want[name]), name
            window = [m for batch in expected[: n + 1 + ahead] for m in _members_read(plain, batch, 2)]
            assert collections.Counter(advised) == collections.Counter(window), n


def test_cached_samples_get_no_advice_and_dropped_ones_do(tmp_path, monkeypatch):
    """The page-cache probe (a 1-byte RWF_NOWAIT read of each sample's largest member): shards just written
    are in the page cache, so nothing is advised; after os.sync and POSIX_FADV_DONTNEED on every shard
    (what `cold` means in the benchmarks), samples are advised, only ones the next batches read, and the
    batches are the same."""
    import os

    buckets = {(16, 16, 1): 12}
    # text members of 640 KiB: their middle lies past what the kernel reads ahead of a tar header
    write_fake_cache(tmp_path, buckets, seq_len=320, text_dim=1024, shards_per_bucket=2)
    options = dict(batch_size=4, seed=1, prefetch=False)
    with LatentLoader(tmp_path, **options) as plain:
        expected = list(itertools.islice(plain, len(plain)))
    advised = _advice_spy(monkeypatch)
    with LatentLoader(tmp_path, **options) as hot:
        assert hot._nowait  # Linux >= 4.14 on a local file system
        batches = list(itertools.islice(hot, len(hot)))
    assert advised == []
    assert [b["keys"] for b in batches] == [b["keys"] for b in expected]

    os.sync()
    for path in plain.shard_paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    with LatentLoader(tmp_path, **options) as cold:
        batches = list(itertools.islice(cold, len(cold)))
    read = {m for batch in expected for m in _members_read(plain, batch, 1)}
    assert advised and set(advised) <= read
    for got, want in zip(batches, expected):
        assert got["keys"] == want["keys"]
        for name in ("latents", "prompt_embeds", "pooled_prompt_embeds"):
            assert torch.equal(got[name], want[name]), name
