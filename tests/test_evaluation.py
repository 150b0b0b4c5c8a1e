"""The held-out set (prep.eval_fraction) and the evaluation on it: which samples training never reads, the
snapshot that records them, and the losses the trainer reports at each validation."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from latentmill.pipelines.snapshot import held_out, holdout_rank, publish
from latentmill.trainer.loader import LatentLoader

from latentmill.inspect import inspect_path
from tests.helpers import store
from tests.trainer_helpers import write_fake_cache


def _keys(n: int, start: int = 0) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest()[:16] for i in range(start, start + n)]


def test_held_out_keys_follow_the_key_alone_and_a_refresh_moves_none():
    keys = _keys(4000)
    chosen = held_out(keys, 0.02, 8)
    assert chosen == {k for k in keys if holdout_rank(k) < 0.02}
    assert 50 <= len(chosen) <= 110  # ~2% of 4000
    grown = keys + _keys(1000, start=4000)
    again = held_out(grown, 0.02, 8)
    assert again & set(keys) == chosen  # no old sample changed sets
    assert held_out(keys, 0.0, 8) == set()


def test_min_count_and_the_cap_and_clips_of_one_video_stay_together():
    keys = _keys(40)
    assert len(held_out(keys, 0.001, 8)) == 8  # raised to the minimum, lowest ranks first
    assert held_out(keys, 0.001, 8) == set(sorted(keys, key=holdout_rank)[:8])
    assert len(held_out(_keys(12), 0.001, 8)) == 3  # training keeps three quarters
    clips = [f"{video}-c{j}" for video in _keys(20) for j in range(3)]
    chosen = held_out(clips, 0.001, 8)
    assert len(chosen) == 9 and len({k.split("-")[0] for k in chosen}) == 3  # whole videos


def _cache_keys(loader: LatentLoader) -> list[str]:
    return [ref.key for refs in loader.buckets.values() for ref in refs]


def test_training_never_reads_a_held_out_sample_and_the_snapshot_records_both(tmp_path, capsys):
    out = tmp_path / "out"
    cache = out / "prep" / "cache"
    write_fake_cache(cache, {(32, 32, 1): 20, (64, 32, 1): 12}, seq_len=8, shards_per_bucket=2)
    before = {p.name: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    plain = publish(out, cache, 0.0)
    split = publish(out, cache, 0.1, 8)
    assert split["new"] and split["name"] != plain["name"]  # the rule is part of the data's identity
    assert {p.name: p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before  # no cache byte changed
    manifest = json.loads((Path(split["path"]) / "manifest.json").read_text())
    everything = _cache_keys(LatentLoader(Path(plain["path"]), 4))
    assert len(everything) == 32
    expected = held_out(everything, 0.1, 8)
    assert len(expected) == 8 and manifest["snapshot"]["eval"] == {"fraction": 0.1, "min_count": 8, "samples": 8}
    train = LatentLoader(Path(split["path"]), 4, seed=3)
    assert set(_cache_keys(train)) == set(everything) - expected and train.num_samples == 24
    seen = set()
    for _, batch in zip(range(2 * len(train)), train):  # two epochs of the real iterator
        seen.update(batch["keys"])
    assert seen == set(everything) - expected
    evaluation = LatentLoader(Path(split["path"]), 3, held_out="only")
    assert sorted(k for b in evaluation.in_order() for k in b["keys"]) == sorted(expected)
    assert train.dataset_id != LatentLoader(Path(plain["path"]), 4).dataset_id
    inspect_path(Path(split["path"]))
    assert "  held out for evaluation: 8 samples (eval_fraction 0.1, eval_min_count 8)" in capsys.readouterr().out
    # a compaction (no recipe) keeps the latest rule: the same snapshot
    assert publish(out, cache) == {**split, "new": False}


@pytest.mark.heavy  # the real prep flow twice (~35 s); the fast test above pins the same contract on publish
@pytest.mark.slow
def test_a_new_fraction_is_a_new_snapshot_that_encodes_nothing(tiny_flux, demo_images, tmp_path):
    from latentmill.pipelines.prep import run_prep

    from latentmill.recipe import load_recipe
    from tests.conftest import DEMO_CONFIG

    def prep(*extra: str) -> dict:
        return run_prep(load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path / 'out'}", f"model.pretrained={tiny_flux}",
                                                  f"ingest.source={demo_images}", *extra]))

    first = prep()
    second = prep("prep.eval_fraction=0.05", "prep.eval_min_count=4")
    assert second["snapshot"]["new"] and second["snapshot"]["name"].startswith("0002-")
    cache = second["stages"]["cache"]
    assert cache["processed"] == 0 and cache["reused"] == first["stages"]["cache"]["out"] == 24
    assert cache["components"] == {"vae": {"processed": 0, "reused": 24}, "text": {"processed": 0, "reused": 24}}
    manifest = json.loads((Path(second["snapshot"]["path"]) / "manifest.json").read_text())
    assert manifest["snapshot"]["eval"]["samples"] == 4
    assert sum(len(s.get("held_out", [])) for s in manifest["shards"]) == 4


# ---------------------------------------------------------------- the evaluation in training


@pytest.fixture()
def held_out_cache(tiny_flux, tmp_path) -> Path:
    """A snapshot of 12 samples of one bucket, 3 of them held out, with the validation prompts encoded."""
    from tests.trainer_helpers import add_validation_prompts

    out = tmp_path / "out"
    write_fake_cache(out / "prep" / "cache", {(32, 32, 1): 12}, seq_len=16, smooth=True)
    add_validation_prompts(out / "prep" / "cache", str(tiny_flux), ["a red square", "a blue circle"],
                           max_sequence_length=16)  # as a prep does
    return Path(publish(out, out / "prep" / "cache", 0.01, 3)["path"])


@pytest.mark.slow
def test_eval_loss_is_the_objective_by_hand_and_changes_nothing(tiny_flux, held_out_cache):
    from latentmill.trainer import TrainerConfig
    from latentmill.trainer.adapters import get_adapter
    from latentmill.trainer.evaluation import EVAL_SIGMAS, Evaluator, eval_noise, sample_losses
    from latentmill.trainer.loader import read_manifest

    adapter = get_adapter("flux")
    model = adapter.load(str(tiny_flux))  # from_pretrained, the user's loading path
    (expert,) = adapter.experts(str(tiny_flux))
    cfg = TrainerConfig()
    manifest = read_manifest(held_out_cache)
    evaluator = Evaluator(held_out_cache, manifest, 2, adapter, torch.device("cpu"))
    assert evaluator.samples == 3
    batch = next(evaluator.loader.in_order())
    # by hand, sample 0 at sigma 0.3: x = 0.7 x0 + 0.3 eps, target eps - x0, mean squared error
    x0 = batch["latents"][:1]
    (eps,) = eval_noise(batch["keys"][0], [x0.shape[1:]])
    inputs = {k: v[:1] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        pred = adapter.forward(model, 0.7 * x0 + 0.3 * eps[None], torch.tensor([0.3]), inputs, cfg)
    by_hand = float(((pred - (eps[None] - x0)) ** 2).mean())
    assert float(sample_losses(adapter, model, batch, 0.3, cfg, torch.device("cpu"))[0]) == pytest.approx(by_hand,
                                                                                                       rel=1e-5)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    model.train()
    first = evaluator.run([(expert, model)], cfg)
    assert set(first) == {f"loss_{s:g}" for s in EVAL_SIGMAS} | {"loss"}
    assert first["loss"] == pytest.approx(sum(first[f"loss_{s:g}"] for s in EVAL_SIGMAS) / 9)
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # eval never trains
    evaluator.close()


@pytest.mark.slow
def test_a_local_and_a_streaming_run_report_equal_eval_losses_and_never_train_on_held_out_keys(
        tiny_flux, held_out_cache, s3_bucket, tmp_path):
    from latentmill.trainer import TrainerConfig, train
    from latentmill.trainer.stream import StreamSource

    from tests.trainer_helpers import read_metrics, torch_threads

    out = held_out_cache.parent.parent
    store("s3").put(str(out) + "/", f"{s3_bucket}/out", recursive=True)
    streams = {"a": None, "b": StreamSource(f"s3://{s3_bucket}/out/snapshots/{held_out_cache.name}",
                                            str(tmp_path / "stream-cache"))}
    held = {k for b in LatentLoader(held_out_cache, 4, held_out="only").in_order() for k in b["keys"]}
    cfg = TrainerConfig(max_steps=4, batch_size=3, learning_rate=1e-3, save_every=0, validate_every=2,
                        validation_prompts=["a red square"], validation_steps=1, validation_size=[32, 32],
                        record_samples=True, export=False)
    evals = []
    for name in ("a", "b"):
        with torch_threads(1):
            summary = train(cfg, cache_dir=held_out_cache, pretrained=str(tiny_flux), train_dir=tmp_path / name,
                            seed=5, progress=False, stream=streams[name])
        records = read_metrics(tmp_path / name)
        evals.append([(r["step"], r["eval"]) for r in records if "eval" in r])
        assert summary["eval"] == evals[-1][-1][1]
        trained = {k for line in (tmp_path / name / "samples-rank0.jsonl").read_text().splitlines()
                   for b in json.loads(line)["batches"] for k in b["keys"]}
        assert len(trained) == 9 and not trained & held  # every training sample, and no held-out one
    assert [step for step, _ in evals[0]] == [2, 4]
    assert evals[0] == evals[1]  # same seed, same weights, same fixed noise, streamed or not: equal losses
    assert evals[0][0][1] != evals[0][1][1]  # and they follow the weights
    # the streaming run read its 3 held-out samples from a local cache of their own, not from the snapshot
    (folder,) = (tmp_path / "stream-cache").glob("held-out-rank-0")
    assert sum(e["samples"] for e in json.loads((folder / "manifest.json").read_text())["shards"]) == 3


def test_while_streaming_the_held_out_samples_come_once_into_a_cache_of_their_own(s3_bucket, tmp_path):
    from latentmill.trainer.evaluation import held_out_cache
    from latentmill.trainer.loader import read_manifest
    from latentmill.trainer.shard_check import CorruptShardError
    from latentmill.trainer.stream import StreamSource

    fs = store("s3")
    out = tmp_path / "out"
    write_fake_cache(out / "prep" / "cache", {(16, 16, 1): 12, (32, 16, 1): 8}, seq_len=8, shards_per_bucket=3,
                     seed=3)  # 20 samples in 6 shards
    snapshot = Path(publish(out, out / "prep" / "cache", 0.1, 5)["path"])
    manifest = read_manifest(snapshot)
    holding = [e for e in manifest["shards"] if e.get("held_out")]
    assert sum(len(e["held_out"]) for e in holding) == 5  # 20 samples: the minimum of 5, under the cap of 5
    fs.put(str(out) + "/", f"{s3_bucket}/out", recursive=True)
    url = f"s3://{s3_bucket}/out/snapshots/{snapshot.name}"
    folder = held_out_cache(StreamSource(url, str(tmp_path / "cache")), manifest, 0)
    local = list(LatentLoader(snapshot, 2, held_out="only").in_order())
    streamed = list(LatentLoader(folder, 2, held_out="only").in_order())
    assert [b["keys"] for b in streamed] == [b["keys"] for b in local] and len(local) >= 3  # the same batches
    for x, y in zip(streamed, local):
        for name in ("latents", "prompt_embeds", "pooled_prompt_embeds"):
            assert torch.equal(x[name], y[name]), name
    tars = sorted(folder.glob("*.tar"))
    assert len(tars) == len(holding) and not (folder / "download").exists()  # the held-out samples alone
    # kept while the held-out set is the same: a second start reads nothing from the store
    fs.rm(f"{s3_bucket}/out", recursive=True)
    assert held_out_cache(StreamSource(url, str(tmp_path / "cache")), manifest, 0) == folder
    assert sorted(folder.glob("*.tar")) == tars
    # a damaged shard on the store is fetched again once, then named
    fs.put(str(out) + "/", f"{s3_bucket}/out", recursive=True)
    damaged = (snapshot / holding[0]["path"]).resolve().relative_to(out.resolve())
    fs.pipe(f"{s3_bucket}/out/{damaged.as_posix()}", b"not the shard")
    with pytest.raises(CorruptShardError, match=f"{damaged.name} differs from the snapshot's manifest"):
        held_out_cache(StreamSource(url, str(tmp_path / "fresh")), manifest, 0)


@pytest.mark.slow
def test_with_the_curate_clip_scorer_each_validation_reports_its_clip_score(tiny_flux, held_out_cache, tmp_path):
    from latentmill.stages.curate import CurateConfig
    from latentmill.stages.curate_models import model_scores
    from latentmill.trainer import TrainerConfig, train
    from PIL import Image

    from latentmill.tiny_clip import build_tiny_clip
    from tests.trainer_helpers import read_metrics, torch_threads

    clip = build_tiny_clip(tmp_path / "tiny-clip", seed=0)
    prompts = ["a red square", "a blue circle"]
    cfg = TrainerConfig(max_steps=2, batch_size=3, learning_rate=1e-3, save_every=0, validate_every=2,
                        validation_prompts=prompts, validation_steps=1, validation_size=[32, 32], export=False)
    curate = {"clip_model": str(clip), "scorers": ["clip_score"]}
    with torch_threads(1):
        train(cfg, cache_dir=held_out_cache, pretrained=str(tiny_flux), train_dir=tmp_path / "run", seed=0,
              progress=False, recipe={"curate": curate})
    (record,) = [r for r in read_metrics(tmp_path / "run") if "eval" in r]
    assert {"loss", "loss_0.5", "clip_score"} <= set(record["eval"])
    grid = Image.open(tmp_path / "run" / "validation" / "step-000002.png").convert("RGB")
    tiles = [[grid.crop((0, 32 * i, 32, 32 * i + 32))] for i in range(2)]  # each prompt's image, lossless
    scores = model_scores(CurateConfig(**curate), tiles, prompts, [["clip_score"]] * 2)
    assert record["eval"]["clip_score"] == pytest.approx((scores[0]["clip_score"] + scores[1]["clip_score"]) / 2,
                                                         rel=1e-5)


@pytest.mark.heavy  # a 2-rank torchrun launch of two runs (~50 s)
@pytest.mark.slow
def test_under_ddp_rank_0_evaluates_and_under_fsdp2_every_rank_does(tiny_flux, held_out_cache, tmp_path):
    from tests.trainer_helpers import launch_jobs, read_metrics

    cfg = {"max_steps": 2, "batch_size": 1, "learning_rate": 1e-3, "save_every": 0, "export": False,
           "validate_every": 2, "validation_prompts": ["a red square"], "validation_steps": 1,
           "validation_size": [32, 32]}
    jobs = [{"cfg": cfg, "cache": str(held_out_cache), "pretrained": str(tiny_flux), "train_dir": str(tmp_path / s),
             "parallel": {"strategy": s}} for s in ("ddp", "fsdp2")]
    (ddp0, ddp1), (fsdp0, fsdp1) = launch_jobs(tmp_path, jobs)
    assert len(ddp0["eval"]) == 10 and "eval" not in ddp1  # rank 0 alone; the run went on in step
    assert fsdp0["eval"] == fsdp1["eval"] and len(fsdp0["eval"]) == 10  # a collective forward on every rank
    for strategy in ("ddp", "fsdp2"):
        (record,) = [r for r in read_metrics(tmp_path / strategy) if "eval" in r]
        assert record["step"] == 2 and record["eval"] == (ddp0 if strategy == "ddp" else fsdp0)["eval"]
