"""Context parallelism: the ranks of a cp group split each sample's token sequence (``parallel.cp_size``).

Applied from outside to the unmodified model with Diffusers' own machinery: a ``ContextParallelConfig``
over a (dp, ring, ulysses) mesh and the model class's ``_cp_plan``, whose hooks split the inputs along the
sequence, run attention as Ulysses (an all-to-all of heads) or ring (keys and values passed round), and
gather the output at ``proj_out``. So every rank of a cp group sees the whole prediction and computes the
same loss, while its gradients hold only its own tokens' share.

The rest of the contract lives in the training loop (``latentmill.trainer.train``):

* the ranks of a cp group read the same samples and draw the same noise and timesteps: the loader is keyed by
  ``DistContext.dp_rank`` over ``dp_size`` data-parallel ranks, and each sample's draws by its epoch ordinal;
* the cp ranks are consecutive and lie inside one FSDP2 shard group, whose reduce-scatter averages the
  gradients over dp x cp ranks; the shares of a cp group must be summed, so the loss is scaled by cp before
  backward, which makes a cp=2 run equal a cp=1 run;
* every cp rank counts the same samples, so the global batch is divided by cp.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import torch
from latentmill.trainer.adapter import VALIDATION_FRAMES, ModelAdapter
from latentmill.trainer.config import ParallelConfig
from torch import nn

from latentmill.core.config import ConfigError

MIN_DIFFUSERS = (0, 42)  # ContextParallelConfig(mesh=...) and the corrected ring backward (diffusers PR 14274)


def cp_plan(adapter: ModelAdapter) -> dict | None:
    """The Diffusers context-parallel plan of the family's transformer class (None: it has none)."""
    return getattr(adapter.diffusers_class(adapter.transformer_class), "_cp_plan", None)


def check_context_parallel(parallel: ParallelConfig, adapter: ModelAdapter, device: torch.device | None = None
                           ) -> None:
    """A one-line ConfigError, before any work, when ``parallel.cp_*`` cannot run for this family (on ``device``;
    None: not known yet, as before a launch)."""
    if parallel.cp_size == 1:
        return
    import diffusers

    version = tuple(int(p) for p in diffusers.__version__.split(".")[:2])
    if version < MIN_DIFFUSERS:
        raise ConfigError(f"parallel.cp_size: {parallel.cp_size} needs diffusers >= "
                          f"{'.'.join(map(str, MIN_DIFFUSERS))} (installed: {diffusers.__version__}); upgrade "
                          "diffusers or set parallel.cp_size: 1")
    if cp_plan(adapter) is None:
        raise ConfigError(f"parallel.cp_size: {parallel.cp_size}, but the {adapter.family} family's "
                          f"{adapter.transformer_class} has no context-parallel plan in diffusers "
                          f"{diffusers.__version__}; set parallel.cp_size: 1 (FSDP2 with activation "
                          "checkpointing is the memory saving left)")
    if parallel.cp_kind == "ring" and device is not None and device.type != "cuda":
        raise ConfigError("parallel.cp_kind: ring needs an attention that returns its log-sum-exp (CUDA flash "
                          "or cuDNN); on the CPU use parallel.cp_kind: ulysses")


def check_heads(transformer: nn.Module, parallel: ParallelConfig) -> None:
    """Ulysses gives each cp rank its share of the heads: a ConfigError when cp_size does not divide them."""
    heads = getattr(transformer.config, "num_attention_heads", None)
    if parallel.cp_size > 1 and parallel.cp_kind == "ulysses" and heads and heads % parallel.cp_size:
        raise ConfigError(f"parallel.cp_size: {parallel.cp_size} does not divide the transformer's {heads} "
                          "attention heads (Ulysses splits them); use a divisor of it, or parallel.cp_kind: ring")


def _undivided(adapter: ModelAdapter, latents: torch.Tensor, text_tokens: int, cp_size: int) -> list[str]:
    """The token counts of a sample's sequences that the plan splits and ``cp_size`` does not divide."""
    tokens = {"latent tokens": adapter.seq_len(latents)}
    if "encoder_hidden_states" in (cp_plan(adapter) or {}).get("", {}):  # Flux-class: the text is split too
        tokens["text tokens"] = text_tokens
    return [f"{n} {what}" for what, n in tokens.items() if n % cp_size]


def check_cp_batch(adapter: ModelAdapter, batch: dict[str, Any], cp_size: int) -> None:
    """A ValueError naming the bucket's token counts when the sequences the plan splits do not divide by cp."""
    if cp_size == 1:
        return
    bad = _undivided(adapter, batch["latents"], int(batch["prompt_embeds"].shape[1]), cp_size)
    if bad:
        raise ValueError(f"parallel.cp_size: {cp_size} does not divide the sequence of bucket "
                         f"{list(batch['latents'].shape[2:])}: {', '.join(bad)}; use a cp_size that divides "
                         "them, or buckets whose token counts it divides")


def _component_configs(pretrained: str) -> Callable[[str], dict[str, Any]]:
    """The pipeline folder's component configs by name, each read once ({} where there is none: a hub id, whose
    rule's defaults are the published model's)."""
    from latentmill.activations import component_config

    return functools.cache(lambda name: component_config(Path(pretrained), name))


def _sample_undivided(adapter: ModelAdapter, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      text_tokens: int, cp_size: int) -> list[str]:
    """:func:`_undivided` for a sample of ``bucket``, its latent shape from the family's ``sample_shapes`` over
    ``config`` (:func:`_component_configs`)."""
    from latentmill.stages.families import family_class

    shape = family_class(adapter.family).sample_shapes(config, bucket, text_tokens)["latents"]
    return _undivided(adapter, torch.empty(1, *shape, device="meta"), text_tokens, cp_size)


def check_cp_validation(parallel: ParallelConfig, adapter: ModelAdapter, validation_size: list[int],
                        pretrained: str, text_tokens: int) -> None:
    """A one-line ConfigError before any work when cp does not divide the validation samples' sequences: every cp
    rank runs the sampling forward, whose sequence the plan splits as it splits a batch's. The frames of a video
    size without any come from ``VALIDATION_FRAMES``."""
    if parallel.cp_size == 1:
        return
    frames = VALIDATION_FRAMES if adapter.latent_ndim == 4 else 1
    bad = _sample_undivided(adapter, _component_configs(pretrained), [*validation_size, frames][:3], text_tokens,
                            parallel.cp_size)
    if bad:
        raise ConfigError(f"parallel.cp_size: {parallel.cp_size} does not divide the sequence of "
                          f"trainer.validation_size {list(validation_size)}: {', '.join(bad)}; use a validation "
                          "size whose token counts it divides")


def check_cp_buckets(parallel: ParallelConfig, adapter: ModelAdapter, bucket_cfg: Any, pretrained: str,
                     text_tokens: int, shown: int = 3) -> None:
    """A one-line ConfigError before any work when cp does not divide the sequences of a bucket the recipe's bucket
    config makes (``admitted_buckets``), which :func:`check_cp_batch` would refuse only at its first batch, after
    the prep and the model load."""
    if parallel.cp_size == 1:
        return
    from latentmill.stages.bucket import admitted_buckets

    buckets = admitted_buckets(bucket_cfg, video=adapter.latent_ndim == 4)
    bad, config = {}, _component_configs(pretrained)
    for bucket in buckets:
        undivided = _sample_undivided(adapter, config, list(bucket), text_tokens, parallel.cp_size)
        if undivided:
            bad[bucket] = undivided
    if bad:
        named = "; ".join(f"{list(b)}: {', '.join(counts)}" for b, counts in list(bad.items())[:shown])
        more = f"; ... ({len(bad) - shown} more)" if len(bad) > shown else ""
        raise ConfigError(f"parallel.cp_size: {parallel.cp_size} does not divide the sequences of {len(bad)} of the "
                          f"{len(buckets)} buckets [W, H, F] the bucket keys make: {named}{more}; use a cp_size that divides "
                          "them, or bucket sizes (bucket.resolution, bucket.aspect_ratios, bucket.frame_counts) "
                          "whose token counts it divides")


def apply_context_parallel(model: nn.Module, parallel: ParallelConfig, ctx: Any) -> None:
    """Split ``model``'s sequence over the cp ranks of ``ctx`` with Diffusers' ``ContextParallelConfig``.

    On CUDA this is ``model.enable_parallelism``. On the CPU, the same steps without its device choice
    (``rank % torch.accelerator.device_count()``, a division by zero on a host without an accelerator):
    the config set up on our mesh, given to every attention processor, and the model's ``_cp_plan`` hooks.
    """
    if parallel.cp_size == 1:
        return
    from diffusers import ContextParallelConfig
    from latentmill.trainer.parallel import build_mesh

    ring, ulysses = (parallel.cp_size, 1) if parallel.cp_kind == "ring" else (1, parallel.cp_size)
    mesh = build_mesh(parallel, ctx, (ctx.dp_size, ring, ulysses), ("dp", "ring", "ulysses"))
    config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=mesh["ring", "ulysses"])
    if ctx.device.type == "cuda":
        model.enable_parallelism(config=config)
        return
    from diffusers import ParallelConfig as DiffusersParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel as apply_plan

    wrapped = DiffusersParallelConfig(context_parallel_config=config)
    wrapped.setup(ctx.rank, ctx.world_size, ctx.device, mesh=config.mesh)
    model._parallel_config = wrapped
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = wrapped
    apply_plan(model, config, model._cp_plan)
