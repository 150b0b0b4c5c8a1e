"""Shard indexes (cache format 3): written at commit, a pure function of the tar, and the loader's start-up.

The loader starts from the indexes and opens no tar; its batches equal a reference decode of the members
the walker lists; a missing, damaged or stale index stops it with an error naming the shard and what to do;
a prep re-run gives shards committed without an index (format 2) their index, re-encoding nothing.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from latentmill.stages.shardindex import (
    ShardIndexError,
    build_shard_index,
    index_path,
    index_tar,
    read_shard_index,
)
from latentmill.stages.shardio import StageDir, WorkUnit
from latentmill.stages.tarshard import index_shard
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.shard_index import layout_from_index, parse_safetensors_header
from safetensors.torch import save as save_st

from latentmill.core.hashing import sha256_bytes
from tests.test_trainer_loader import _add_second_captions, _reference_batch
from tests.trainer_helpers import old_cache, write_fake_cache

_TAR_OPENS: list[str] | None = None  # while a list: every path opened that ends in .tar


def _audit(event: str, args: tuple) -> None:
    if _TAR_OPENS is not None and event == "open" and str(args[0]).endswith(".tar"):
        _TAR_OPENS.append(str(args[0]))


sys.addaudithook(_audit)  # "open" is raised by open(), io.open, os.open and tarfile alike


def _tar_opens(build):
    """(result of ``build()``, the .tar paths it opened)."""
    global _TAR_OPENS
    _TAR_OPENS = []
    try:
        return build(), _TAR_OPENS
    finally:
        _TAR_OPENS = None


def _cache_samples(n: int, buckets=((32, 16, 1),), seed: int = 0, tokens: int | None = None) -> list[dict]:
    """Cache-stage samples (bf16, text 32 wide, pooled 32) cycling through ``buckets``; ``tokens``: the
    prompt length (default 2, 3, 4, 2, ...: trimmed text)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        width, height, frames = buckets[i % len(buckets)]
        vae = save_st({"latents": torch.randn(16, height // 8, width // 8, generator=gen).bfloat16()})
        text = save_st({"prompt_embeds": torch.randn(tokens or 2 + i % 3, 32, generator=gen).bfloat16(),
                        "pooled_prompt_embeds": torch.randn(32, generator=gen).bfloat16()})
        meta = json.dumps({"key": f"k{i:03d}", "bucket": [width, height, frames]}).encode()
        samples.append({"__key__": f"k{i:03d}", "vae.safetensors": vae, "text.safetensors": text, "json": meta})
    return samples


def _commit(root: Path, samples: list[dict], unit_id: str = "u" * 64):
    stage = StageDir(root, "cache").ensure()

    def process(unit, out):
        for s in samples:
            out.add(s, bucket=json.loads(s["json"])["bucket"])

    return stage, stage.run_unit(WorkUnit(unit_id, [], {}, len(samples)), process)


def test_commit_writes_an_index_that_describes_the_tar(tmp_path):
    samples = _cache_samples(7, buckets=((32, 16, 1), (16, 16, 1)))
    stage, record = _commit(tmp_path / "s", samples)
    shard = record.shards[0]
    tar = stage.root / shard.path
    idx = index_path(tar)
    data = idx.read_bytes()
    assert idx.name == tar.name.removesuffix(".tar") + ".idx"
    assert shard.index == {"name": idx.name, "size": len(data), "sha256": sha256_bytes(data)}
    manifest = stage.write_manifest([record], {"fingerprint": "f"})
    assert manifest["shards"][0]["index"] == shard.index
    index = read_shard_index(data)
    assert index.samples() == index_shard(tar)  # keys, members, offsets and sizes as the walker lists them
    assert index.tar_size == tar.stat().st_size
    c = index.columns
    assert [index.buckets[b] for b in c["sample_bucket"]] == [json.loads(s["json"])["bucket"] for s in samples]
    for i, s in enumerate(samples):  # each safetensors member's layout is its parsed header
        for ext in ("vae.safetensors", "text.safetensors"):
            m = [k for k, name in enumerate(c["member_name"]) if index.names[name] == ext][i]
            blob = s[ext]
            header = blob[8 : 8 + int.from_bytes(blob[:8], "little")]
            assert layout_from_index(index.layouts[c["member_layout"][m]]) == parse_safetensors_header(header)
        json_member = [k for k, name in enumerate(c["member_name"]) if index.names[name] == "json"][i]
        assert c["member_layout"][json_member] == -1
    assert len(index.layouts) == 2 + 3  # two VAE shapes, three text lengths: a layout is stored once
    assert len(data) < 200 * len(samples) + 2000  # compact: columns, not per-sample JSON


def test_index_bytes_are_a_pure_function_of_the_tar(tmp_path):
    samples = _cache_samples(9)
    indexes = []
    for name in ("a", "b"):
        stage, record = _commit(tmp_path / name, samples)
        tar = stage.root / record.shards[0].path
        data = index_path(tar).read_bytes()
        assert index_tar(tar) == data  # from the tar alone, read back
        indexes.append(data)
    assert indexes[0] == indexes[1]
    # the same samples as another tar (another order): another index
    stage, record = _commit(tmp_path / "c", samples[::-1])
    assert index_path(stage.root / record.shards[0].path).read_bytes() != indexes[0]


def test_loader_starts_from_indexes_without_opening_a_tar_and_reads_what_the_walker_lists(tmp_path):
    buckets = {(32, 16, 1): 11, (16, 16, 1): 6}
    cache = tmp_path / "cache"
    manifest = write_fake_cache(cache, buckets, trimmed=True, seq_len=9, latents="distribution", shards_per_bucket=2)
    _add_second_captions(cache)
    seed, dropout = 4, 0.3
    options = dict(batch_size=4, seed=seed, caption_dropout=dropout, prefetch=False)
    loader, opened = _tar_opens(lambda: LatentLoader(cache, **options))
    assert opened == [] and loader.num_samples == 17  # no tar opened at start-up
    walked = {}  # key -> (shard number, members) as the one walker and grouping rule list them
    for number, entry in enumerate(manifest["shards"]):
        walked.update({key: (number, members) for key, members in index_shard(cache / entry["path"])})
    for bucket, refs in loader.buckets.items():  # the same members, caption lists and checked headers
        assert [r.key for r in refs] == [k for k in walked if (int(k[1:]) < 11) == (bucket == (32, 16, 1))]
        for ref in refs:
            assert (ref.shard, ref.members) == walked[ref.key]
            assert ref.texts == ("text.safetensors", "text.1.safetensors")
            assert set(ref.layouts) == {"vae.safetensors", "text.safetensors", "text.1.safetensors"}
    empty = loader.empty_prompt
    got = list(itertools.islice(loader, 3 * len(loader)))
    assert torch.cat([b["caption_dropped"] for b in got]).any()
    for batch in got:
        reference = _reference_batch(loader, batch, seed, dropout, empty)
        assert all(torch.equal(batch[k], v) for k, v in reference.items())
    loader.close()


def test_a_shard_may_hold_several_buckets(tmp_path):
    """Per-sample buckets (what byte-sized shards will write): batches still hold one bucket each."""
    cache = tmp_path / "cache"
    write_fake_cache(cache, {(16, 16, 1): 4}, shards_per_bucket=1)
    samples = _cache_samples(10, buckets=((32, 16, 1), (16, 16, 1), (16, 32, 1)), tokens=8)
    _, record = _commit(cache, samples)
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = {**vars(record.shards[0])}
    entry["bucket"] = None  # a mixed shard: the buckets are in its index
    manifest["shards"].append(entry)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    loader = LatentLoader(cache, batch_size=2, seed=1)
    assert {b: len(r) for b, r in loader.buckets.items()} == {(16, 16, 1): 4 + 3, (16, 32, 1): 3, (32, 16, 1): 4}
    assert [r.key for r in loader.buckets[(16, 16, 1)]] == ["s00000", "s00001", "s00002", "s00003",
                                                             "k001", "k004", "k007"]
    keys = []
    for batch in itertools.islice(loader, len(loader)):
        width, height, _ = batch["bucket"]
        assert batch["latents"].shape[2:] == (height // 8, width // 8)
        keys += batch["keys"]
    assert sorted(keys) == sorted([f"s{i:05d}" for i in range(4)] + [f"k{i:03d}" for i in range(10)])


def _corrupt_cases(cache: Path, manifest: dict):
    shard = cache / manifest["shards"][1]["path"]
    idx = shard.with_name(manifest["shards"][1]["index"]["name"])
    data = idx.read_bytes()
    yield "missing", lambda: idx.unlink(), "cannot be read"
    yield "truncated", lambda: idx.write_bytes(data[:-5]), "holds .* bytes, the manifest says"
    yield "garbage", lambda: idx.write_bytes(b"\x07" * len(data)), "runs past|not a shard index"
    flipped = bytearray(data)
    flipped[len(data) - 3] ^= 0xFF  # a key byte: still parses, sha256 differs (checked with verify=True)
    yield "flipped", lambda: idx.write_bytes(bytes(flipped)), None
    yield "stale", lambda: shard.write_bytes(shard.read_bytes() + b"\0" * 512), "tar holds .* bytes, its index"


@pytest.mark.parametrize("case", ["missing", "truncated", "garbage", "flipped", "stale"])
def test_a_missing_or_damaged_index_stops_the_loader_naming_the_shard(tmp_path, case):
    cache = tmp_path / "cache"
    manifest = write_fake_cache(cache, {(16, 16, 1): 6}, shards_per_bucket=3)
    shard = cache / manifest["shards"][1]["path"]
    damage, match = next((d, m) for name, d, m in _corrupt_cases(cache, manifest) if name == case)
    damage()
    if match is None:
        LatentLoader(cache, batch_size=2)  # a same-size change: only a check of the sha256 sees it
        with pytest.raises(ValueError, match="its index .* sha256 differs from the manifest") as err:
            LatentLoader(cache, batch_size=2, verify=True)
    else:
        with pytest.raises(ValueError, match=match) as err:
            LatentLoader(cache, batch_size=2)
        assert "re-run the prep" in str(err.value)
    assert str(shard) in str(err.value)


def test_format_3_without_an_index_entry_is_refused(tmp_path):
    cache = tmp_path / "cache"
    manifest = write_fake_cache(cache, {(16, 16, 1): 4}, shards_per_bucket=2)
    del manifest["shards"][0]["index"]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"shard shards/.*\.tar has no index entry; re-run `latentmill prep <recipe>`"):
        LatentLoader(cache, batch_size=2)


def test_a_unit_committed_without_index_gets_it_when_reused(tmp_path):
    """A format 2 unit (no index) reused by a later prep: its index is written from the tar, nothing runs."""
    samples = _cache_samples(5)
    stage, record = _commit(tmp_path / "s", samples)
    tar = stage.root / record.shards[0].path
    want = index_path(tar).read_bytes()
    saved = json.loads(stage.unit_path(record.unit_id).read_text())
    del saved["shards"][0]["index"]  # what a format 2 prep recorded
    stage.unit_path(record.unit_id).write_text(json.dumps(saved))
    index_path(tar).unlink()
    calls = []
    again = stage.run_unit(WorkUnit(record.unit_id, [], {}, 5), lambda u, o: calls.append(1))
    assert again.reused and not calls
    assert index_path(tar).read_bytes() == want and again.shards[0].index == record.shards[0].index
    assert json.loads(stage.unit_path(record.unit_id).read_text())["shards"][0]["index"] == record.shards[0].index
    index_path(tar).write_bytes(b"damaged")  # a damaged index is rewritten too
    assert stage.load_record(record.unit_id) is not None and index_path(tar).read_bytes() == want
    tar.write_bytes(tar.read_bytes()[:-1024])  # a changed tar whose index is lost: the rebuilt index
    index_path(tar).unlink()  # differs from the recorded one, so the unit runs again
    assert stage.load_record(record.unit_id) is None


def test_build_shard_index_takes_member_lists_directly():
    """The writer the benchmark uses for sparse tars: the columns the tar walk would give."""
    vae = save_st({"latents": torch.zeros(16, 2, 2, dtype=torch.bfloat16)})
    header = vae[8 : 8 + int.from_bytes(vae[:8], "little")]
    samples = [("a", {"json": (512, 10), "vae.safetensors": (1536, len(vae))})]
    data = build_shard_index(4096, samples, {(0, "vae.safetensors"): header}, [[16, 16, 1]])
    index = read_shard_index(data)
    assert index.samples() == samples and index.buckets == [[16, 16, 1]]
    assert layout_from_index(index.layouts[0]) == parse_safetensors_header(header)
    with pytest.raises(ShardIndexError, match="outside the tar"):
        read_shard_index(build_shard_index(1024, samples, {}, [None]))


def test_verify_checks_each_index(tmp_path, capsys):
    from latentmill.inspect import verify_path

    cache = tmp_path / "cache"
    manifest = write_fake_cache(cache, {(16, 16, 1): 6}, shards_per_bucket=3)
    assert verify_path(cache) == 0
    idx = cache / manifest["shards"][1]["path"]
    idx = idx.with_name(manifest["shards"][1]["index"]["name"])
    data = bytearray(idx.read_bytes())
    data[-3] ^= 0xFF  # the tar is intact; only its index changed
    idx.write_bytes(bytes(data))
    assert verify_path(cache) == 1
    out = capsys.readouterr().out
    assert "sha256 differs from the manifest" in out and idx.name in out and "3 shards: 2 ok, 1 bad" in out


def test_a_prep_re_run_indexes_an_old_cache_without_re_encoding(tiny_flux, tmp_path):
    """A prep of format 2 (no index beside any tar) is refused by the trainer in one line; the same prep run
    again reuses every unit, writes each index from its tar, and the manifest names them: format 3."""
    from latentmill.stages.bucket import BucketConfig
    from latentmill.stages.cache import CacheConfig
    from latentmill.stages.ingest import IngestConfig
    from latentmill.trainer.loader import CacheFormatError

    from latentmill.models import ModelConfig
    from latentmill.recipe import Recipe
    from tests.conftest import DEMO_IMAGES
    from tests.helpers import prep_in_process

    recipe = Recipe(output_dir=str(tmp_path), model=ModelConfig(pretrained=str(tiny_flux)),
                    ingest=IngestConfig(source=str(DEMO_IMAGES), shard_size=8),
                    bucket=BucketConfig(resolution=64, aspect_ratios=[1.0]),
                    cache=CacheConfig(batch_size=4, max_sequence_length=8, shard_bytes=65536))
    first = prep_in_process(recipe)
    cache_dir, manifest, _ = first["cache"]
    indexes = {e["name"]: (cache_dir.root / e["path"]).with_name(e["index"]["name"]).read_bytes()
               for e in manifest["shards"]}
    assert manifest["format_version"] == 3 and len(indexes) > 1
    for stage, (stage_dir, _, _) in first.items():  # what a prep before shard indexes left
        old_cache(stage_dir.root, 2 if stage == "cache" else None)
    assert not list(tmp_path.glob("prep/*/shards/*.idx"))
    with pytest.raises(CacheFormatError, match="cache format 2 is no longer read; re-run `latentmill prep"):
        LatentLoader(cache_dir.root, batch_size=2)

    again = prep_in_process(recipe)
    for stage, (_, _, records) in again.items():
        assert records and all(r.reused for r in records), stage  # nothing ran: nothing re-encoded
    _, upgraded, records = again["cache"]
    assert upgraded["format_version"] == 3
    assert upgraded["shards"] == manifest["shards"]
    for entry in upgraded["shards"]:  # each index written from its tar equals the one written at commit
        assert (cache_dir.root / entry["path"]).with_name(entry["index"]["name"]).read_bytes() == indexes[entry["name"]]
    with LatentLoader(cache_dir.root, batch_size=2) as loader:
        assert loader.num_samples == manifest["counts"]["out"] and next(iter(loader))["latents"].ndim == 4
