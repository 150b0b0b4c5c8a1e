"""The models a run trains and which one each micro-batch trains: a pipeline's one transformer, or the experts of
Wan 2.2 A14B (``trainer.expert: high | low | both``; :class:`latentmill.trainer.adapter.Expert` says which noise
levels each serves).

A run holds one :class:`Part` per trained model, each with its own optimizer and schedule (under FSDP2 each its
own sharded root). With two experts in one run, :func:`route_micro_batches` picks the expert of every
micro-batch from a sigma drawn by (seed, step, micro-batch), and :func:`expert_sigma` draws each sample's noise
level within the range of the expert it trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from latentmill.trainer.adapter import Expert
from latentmill.trainer.objective import derive_seed, sample_sigmas, sample_sigmas_within


@dataclass
class Part:
    """One trained model of a run (the pipeline's transformer, or one expert) and its optimizer and schedule."""

    expert: Expert
    transformer: torch.nn.Module  # what save and export use
    model: torch.nn.Module  # what forward runs on (the same module under FSDP2)
    trainable: list[torch.nn.Parameter]
    optimizer: Any = None
    scheduler: Any = None


def route_micro_batches(parts: list[Part], cfg: Any, seed: int, step: int) -> list[int]:
    """The part each micro-batch of optimizer step ``step`` (0-based) trains: 0 for a run of one model.

    Two experts: one sigma per micro-batch, drawn like the samples' (at ``cfg.shift``) but from a generator
    seeded by (seed, step, micro-batch), picks the expert that serves it: each expert gets its share of the
    recipe's sigmas, every rank routes alike (so the collectives of each expert's FSDP2 model match), and a
    resumed run routes as the original.
    """
    accum = cfg.grad_accum_steps
    if len(parts) == 1:
        return [0] * accum
    routes = []
    for micro in range(accum):
        gen = torch.Generator().manual_seed(derive_seed(seed, f"expert:{step}:{micro}"))
        sigma = sample_sigmas(1, cfg, gen)  # at trainer.shift (expert both: shift_mode fixed)
        routes.append(next(i for i, part in enumerate(parts) if bool(part.expert.serves(sigma))))
    return routes


def expert_sigma(cfg: Any, generator: torch.Generator, shift: float, expert: Expert) -> torch.Tensor:
    """One sample's noise level [1]: the recipe's distribution at ``shift``, restricted to the levels ``expert``
    serves (the only model of a pipeline serves them all)."""
    if expert.name == "all":
        return sample_sigmas(1, cfg, generator, shift=shift)
    return sample_sigmas_within(cfg, generator, shift, expert.sigma_min, expert.sigma_max)


# an expert routed fewer than this share of a run's micro-batches trains far behind the other one: at 3% (18 of
# 600 steps) Wan 2.2's tiny high-noise expert still predicted the clean latent no better than chance
LOW_SHARE = 0.05


def routing_shares(experts: list[Expert], cfg: Any, draws: int = 100_000) -> dict[str, float]:
    """Each expert's share of the micro-batches of a run of both: the share of the recipe's sigmas (at
    ``cfg.shift``) it serves, from ``draws`` draws of a fixed generator."""
    sigmas = sample_sigmas(draws, cfg, torch.Generator().manual_seed(0))
    return {e.name: float(e.serves(sigmas).float().mean()) for e in experts}


def routing_warning(experts: list[Expert], cfg: Any) -> str | None:
    """A one-line warning when a run of both experts routes one of them too few micro-batches to learn; else None."""
    if len(experts) < 2:
        return None
    name, share = min(routing_shares(experts, cfg).items(), key=lambda item: item[1])
    if share >= LOW_SHARE:
        return None
    total = cfg.max_steps * cfg.grad_accum_steps
    return (f"trainer.expert: both at trainer.shift {cfg.shift:g}: the {name} expert serves {share:.1%} of the "
            f"sigmas, so it trains on about {share * total:.0f} of the run's {total} micro-batches; train it in a run "
            f"of its own (trainer.expert={name}) or at the pipeline's shift")


def other_parts(parts: list[Part]) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]]:
    """The models after the first (a run of both experts: ``transformer_2``) as checkpoints store them."""
    return {p.expert.component: (p.transformer, p.optimizer, p.scheduler) for p in parts[1:]}
