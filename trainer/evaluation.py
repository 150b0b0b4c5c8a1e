"""Held-out evaluation: the flow-matching loss of a snapshot's held-out samples at fixed noise levels.

A snapshot made with ``prep.eval_fraction`` holds samples training never reads (``held_out``, see
``latentmill.pipelines.snapshot``). At each validation the ``Evaluator`` noises every one of them at each
sigma of ``EVAL_SIGMAS`` (the noise level itself: the recipe's shift is not applied, so runs with different
shifts compare at the same levels) with noise seeded by the sample's key alone (not the run seed: two runs
see the same noise), and reports the unweighted velocity MSE per sigma (``loss_0.1`` ... ``loss_0.9``) and
their mean (``loss``). Cost: held-out samples x 9 forwards without gradient, on rank 0 (on every rank under
FSDP2, whose forward is collective). No weight changes and no RNG stream of training is drawn from.

While training streams its snapshot from a store (``latentmill.trainer.stream``), the held-out samples are read
from a local cache of their own (``held_out_cache``): built once per snapshot, at the first evaluation, by
fetching each shard that holds one (whole, checked against the manifest's sha256, one at a time) and keeping
only its held-out samples, so a validation downloads nothing and the disk holds the held-out samples alone.

With the curate stage's CLIP scorer in the recipe, each validation also scores its images (a video: the four
frames of its grid) against their prompts (``clip_score``, ``eval/clip_score``), on rank 0.
"""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from latentmill.stages.shardio import ShardSink
from latentmill.stages.tarshard import read_shard
from latentmill.trainer.adapter import ModelAdapter
from latentmill.trainer.loader import LatentLoader, read_manifest
from latentmill.trainer.objective import derive_seed, flow_matching_loss, interpolate, velocity_target
from latentmill.trainer.stream import ShardStream, StreamSource

from latentmill.core import durable
from latentmill.core.hashing import stable_hash

EVAL_SIGMAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def eval_noise(key: str, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """The fixed noise of held-out sample ``key``: one float32 tensor per shape (its latents, then each noised
    stream), from a generator seeded by the key alone."""
    gen = torch.Generator().manual_seed(derive_seed(0, f"eval:{key}"))
    return [torch.randn(shape, generator=gen, dtype=torch.float32) for shape in shapes]


def sample_losses(adapter: ModelAdapter, model: torch.nn.Module, batch: dict[str, Any], sigma: float, cfg: Any,
                  device: torch.device) -> torch.Tensor:
    """Per-sample flow-matching losses [B] (float32, on the CPU) of one batch at noise level ``sigma``, without
    gradient: velocity MSE of the latents, plus ``cfg.audio_loss_weight`` times that of each noised stream."""
    inputs = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    latents = inputs["latents"]
    extra = adapter.noised_streams
    shapes = [latents.shape[1:], *(inputs[name].shape[1:] for name in extra)]
    drawn = [eval_noise(key, shapes) for key in batch["keys"]]
    noise = torch.stack([d[0] for d in drawn]).to(device)
    sigmas = torch.full((latents.shape[0],), sigma, dtype=torch.float32, device=device)
    target = velocity_target(latents, noise)
    extra_targets = {}
    for i, name in enumerate(extra, start=1):
        stream_noise = torch.stack([d[i] for d in drawn]).to(device)
        extra_targets[name] = velocity_target(inputs[name], stream_noise)
        inputs[name] = interpolate(inputs[name], stream_noise, sigmas)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with torch.no_grad(), autocast:
        pred = adapter.forward(model, interpolate(latents, noise, sigmas), sigmas, inputs, cfg)
    pred, extra_preds = pred if extra else (pred, {})
    losses = []
    for row in range(latents.shape[0]):
        loss = flow_matching_loss(pred[row:row + 1], target[row:row + 1])
        for name, extra_pred in extra_preds.items():
            loss = loss + cfg.audio_loss_weight * flow_matching_loss(extra_pred[row:row + 1],
                                                                     extra_targets[name][row:row + 1])
        losses.append(loss)
    return torch.stack(losses).float().cpu()


def clip_scorer(recipe: dict[str, Any] | None) -> Any:
    """The recipe's curate config when its CLIP scorer is on (``clip_score`` in ``curate.scorers``, or
    ``curate.min_clip_score`` set), else None: what ``clip_score`` scores validation images with."""
    if not recipe or "curate" not in recipe:
        return None
    from latentmill.stages.curate import CurateConfig

    from latentmill.core.config import from_dict

    cfg = from_dict(CurateConfig, recipe["curate"])
    return cfg if "clip_score" in cfg.active_scorers() else None


def clip_score(curate_cfg: Any, rows: list[list[Any]], prompts: list[str]) -> float:
    """The mean CLIP score (the curate stage's ``clip_score``: 100 x cosine) of each prompt's validation images
    (a video: the mean over its frames) against that prompt."""
    from latentmill.stages.curate_models import model_scores

    scores = model_scores(curate_cfg, rows, list(prompts), [["clip_score"]] * len(rows))
    return sum(s["clip_score"] for s in scores) / len(scores)


def held_out_cache(source: StreamSource, manifest: dict, rank: int) -> Path:
    """A local cache (folder with ``manifest.json``) of the held-out samples alone of the snapshot that
    ``source`` streams (``manifest``: its manifest), under ``source.cache_dir``: kept while the snapshot's
    held-out set is the same, else built again by fetching each shard that holds a held-out sample, whole and
    checked against the manifest's sha256 (``CorruptShardError`` otherwise), and keeping those samples."""
    entries = [(number, entry) for number, entry in enumerate(manifest["shards"]) if entry.get("held_out")]
    held = stable_hash([[entry["path"], entry.get("sha256"), entry["held_out"]] for _, entry in entries])
    folder = Path(source.cache_dir) / f"held-out-rank-{rank}"
    if (folder / "manifest.json").is_file() and read_manifest(folder).get("held_out_of") == held:
        return folder
    shutil.rmtree(folder, ignore_errors=True)  # a build killed midway: its manifest, written last, is missing
    stream = ShardStream(source.url, folder / "download", None, source.local_copy)
    shards = []
    try:
        for number, entry in entries:
            stream.fetch_now(number)
            places, tar_path = set(entry["held_out"]), folder / f"held-out-{number:06d}.tar"
            sink = ShardSink(tar_path)  # the stages' writer: the same tar layout, and its index beside it
            for place, sample in enumerate(read_shard(stream.local[number])):
                if place in places:
                    sink.write({k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")})
            sha256 = sink.commit()
            stream.local[number].unlink()  # one downloaded shard on disk at a time
            shards.append({"path": tar_path.name, "sha256": sha256, "samples": len(places),
                           "index": sink.index, "held_out": list(range(len(places))),
                           **({"bucket": entry["bucket"]} if entry.get("bucket") else {})})
    finally:
        stream.close()
    shutil.rmtree(folder / "download")
    durable.write_json(folder / "manifest.json", {**manifest, "shards": shards, "held_out_of": held})
    return folder


class Evaluator:
    """The held-out evaluation of one run: its loader over the snapshot's held-out samples only (``stream``: the
    snapshot is on a store, and the loader reads their ``held_out_cache``, built at the first evaluation)."""

    def __init__(self, cache_dir: str | Path, manifest: dict, batch_size: int, adapter: ModelAdapter,
                 device: torch.device, stream: StreamSource | None = None, rank: int = 0) -> None:
        self.adapter, self.device, self.batch_size = adapter, device, batch_size
        self.samples = sum(len(entry.get("held_out", [])) for entry in manifest["shards"])
        self._source = (cache_dir, manifest, stream, rank)
        self._loader: LatentLoader | None = None

    @property
    def loader(self) -> LatentLoader:
        """The held-out samples' loader, opened at first use: a streaming run's start-up downloads no tar."""
        if self._loader is None:
            cache_dir, manifest, stream, rank = self._source
            if stream is not None:
                cache_dir = held_out_cache(stream, manifest, rank)
                manifest = read_manifest(cache_dir)
            self._loader = LatentLoader(cache_dir, self.batch_size, manifest=manifest, held_out="only",
                                        prefetch=False)
        return self._loader

    def run(self, models: list[tuple[Any, torch.nn.Module]], cfg: Any) -> dict[str, float]:
        """``{"loss_0.1": ..., "loss": mean}`` of ``models`` (each an ``Expert`` and the model it trains: a sigma
        goes to the one that serves it; a sigma none serves is left out). Each model is in eval mode meanwhile."""
        was = [model.training for _, model in models]
        for _, model in models:
            model.eval()
        sums = {sigma: 0.0 for sigma in EVAL_SIGMAS}
        served = {sigma: next((m for e, m in models if bool(e.serves(torch.tensor([sigma])))), None)
                  for sigma in EVAL_SIGMAS}
        try:
            for batch in self.loader.in_order():
                for sigma, model in served.items():
                    if model is not None:
                        sums[sigma] += float(sample_losses(self.adapter, model, batch, sigma, cfg, self.device).sum())
        finally:
            for (_, model), training in zip(models, was):
                model.train(training)
        scores = {f"loss_{sigma:g}": sums[sigma] / self.samples for sigma, model in served.items() if model is not None}
        return {**scores, "loss": sum(scores.values()) / len(scores)} if scores else {}

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
