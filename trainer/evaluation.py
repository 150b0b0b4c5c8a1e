"""Held-out evaluation: the flow-matching loss of a snapshot's held-out samples at fixed noise levels.

A snapshot made with ``prep.eval_fraction`` holds samples training never reads (``held_out``, see
``latentmill.pipelines.snapshot``). At each validation the ``Evaluator`` noises every one of them at each
sigma of ``EVAL_SIGMAS`` (the noise level itself: the recipe's shift is not applied, so runs with different
shifts compare at the same levels) with noise seeded by the sample's key alone (not the run seed: two runs
see the same noise), and reports the unweighted velocity MSE per sigma (``loss_0.1`` ... ``loss_0.9``) and
their mean (``loss``). Cost: held-out samples x 9 forwards without gradient, on rank 0 (on every rank under
FSDP2, whose forward is collective). No weight changes and no RNG stream of training is drawn from.

With the curate stage's CLIP scorer in the recipe, each validation also scores its images (a video: the four
frames of its grid) against their prompts (``clip_score``, ``eval/clip_score``), on rank 0.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from latentmill.trainer.adapter import ModelAdapter
from latentmill.trainer.loader import LatentLoader
from latentmill.trainer.objective import derive_seed, flow_matching_loss, interpolate, velocity_target

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


class Evaluator:
    """The held-out evaluation of one run: its loader over the snapshot's held-out samples only."""

    def __init__(self, cache_dir: str | Path, manifest: dict, batch_size: int, adapter: ModelAdapter,
                 device: torch.device) -> None:
        self.adapter, self.device = adapter, device
        self.loader = LatentLoader(cache_dir, batch_size, manifest=manifest, held_out="only", prefetch=False)
        self.samples = self.loader.num_samples

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
        self.loader.close()
