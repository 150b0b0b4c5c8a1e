"""Activation memory of one training micro-batch per rank, from the transformer's config and a bucket.

One formula for every family; what differs between families comes from their own declarations: the token
count of a bucket (the cache side's ``Encoders.sample_shapes`` gives the latent and text shapes, the adapter's
``seq_len`` the tokens after patchify), whether the text tokens run through the blocks with the latent tokens
(``ModelAdapter.text_in_blocks``: joint attention) or only feed cross-attention, the blocks' widths
(``ModelAdapter.block_widths``), what a family's blocks keep in float32 (``ModelAdapter.float32_activations``) and
the other token streams its blocks carry beside the latents' (``ModelAdapter.side_streams``: LTX-2's audio), each
counted as the latents' are at its own widths, the text tokens of the blocks' sequence (``ModelAdapter.text_tokens``)
and the dense attention mask a family's blocks save (``ModelAdapter.attention_mask_bytes``: quadratic in the tokens).
With ``S`` tokens per sample on a rank (the sequence divided by cp), a micro-batch of ``B``, hidden width ``D``,
feed-forward width ``F``, ``L`` blocks, activations in bf16 (2 bytes):

* a block saves for its backward ``SAVED_PER_D·D + SAVED_PER_F·F`` bf16 elements per token (its norms' inputs
  and outputs, attention's q, k, v and output, the feed-forward's pre- and post-activation, the gated
  residuals), plus the family's float32 extra;
* activation checkpointing keeps each block's input (``D`` per token, plus the family's extra) and recomputes
  one block at a time in backward: ``L`` inputs plus one block's saved tensors;
* without it every block's saved tensors are held when backward starts: ``L`` times a block's;
* both add backward's working tensors, ``WORK_PER_D·D`` per token, and ``FIXED_BYTES`` that do not grow with
  the tokens (embeddings of the conditioning, the loss).

The constants count tensors per token, and were checked against torch's own memory tracker
(``torch.distributed._tools.mem_tracker.MemTracker``) on the real Diffusers classes under ``FakeTensorMode``
(FLUX.1-dev and Wan2.1-14B widths, two depths, two token counts, with and without checkpointing):
``bench/actplan.py`` and ``tests/test_plan_activations.py``.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

COMPUTE_BYTES = 2  # bf16 autocast / FSDP2 mixed precision: activations are bfloat16
SAVED_PER_D = 18  # bf16 tensors of width D a block saves per token (see the module docstring)
SAVED_PER_F = 2  # bf16 tensors of width F a block saves per token: the feed-forward's pre- and post-activation
WORK_PER_D = 7  # bf16 tensors of width D backward's working set adds per token
FIXED_BYTES = 96 * 2**20  # what does not grow with the tokens: conditioning embeddings, the loss


@dataclass(frozen=True)
class ActivationShape:
    """What the estimate reads: the micro-batch's tokens and the blocks' widths."""

    bucket: tuple[int, ...]  # [W, H] or [W, H, F]: the largest bucket the recipe admits
    latent_tokens: int  # per sample, after patchify
    text_tokens: int  # per sample, at cache.max_sequence_length
    text_in_blocks: bool  # the text tokens join the blocks' sequence (joint attention)
    float32_extra: tuple[int, int]  # bytes per token and unit of D held in float32: (block input, saved)
    hidden: int  # D
    ffn: int  # F
    blocks: int  # L
    batch: int  # B, trainer.batch_size
    # (tokens per sample, hidden width, feed-forward width) of each other token stream through the same blocks
    # beside the latents' (LTX-2's audio: ``ModelAdapter.side_streams``)
    side_streams: tuple[tuple[int, int, int], ...] = ()
    # bytes per (query token, key token) of the blocks' sequence a block saves for backward: a dense attention mask
    # (``ModelAdapter.attention_mask_bytes``: HunyuanVideo 1.5's)
    mask_bytes: int = 0

    @property
    def tokens(self) -> int:
        """The blocks' sequence per sample."""
        return self.latent_tokens + (self.text_tokens if self.text_in_blocks else 0)


def activation_bytes(shape: ActivationShape, *, checkpointing: bool, cp: int = 1) -> int:
    """Peak activation bytes of one micro-batch on one rank (see the module docstring); ``cp`` ranks split
    each sample's sequence."""
    input_extra, saved_extra = shape.float32_extra
    saved = shape.batch * math.ceil(shape.tokens / cp) * shape.tokens * shape.mask_bytes
    block_input = work = 0
    for tokens, hidden, ffn in ((shape.tokens, shape.hidden, shape.ffn), *shape.side_streams):
        n = shape.batch * math.ceil(tokens / cp)
        saved += n * ((SAVED_PER_D * hidden + SAVED_PER_F * ffn) * COMPUTE_BYTES + saved_extra * hidden)
        block_input += n * hidden * (COMPUTE_BYTES + input_extra)
        work += n * WORK_PER_D * hidden * COMPUTE_BYTES
    held = shape.blocks * block_input + saved if checkpointing else shape.blocks * saved
    return held + work + FIXED_BYTES


def largest_bucket(bucket_cfg: Any, video: bool, tokens_of: Any) -> list[int]:
    """The bucket ``[W, H(, F)]`` of the most tokens (``tokens_of(bucket)``) the bucket config admits: every
    aspect ratio at the largest pixel budget, and for a video family the longest clip."""
    from latentmill.stages.bucket import bucket_sizes

    kind = "video" if video else "image"
    frames = [bucket_cfg.frame_count_list()[-1]] if video else []
    sizes = bucket_sizes(bucket_cfg, bucket_cfg.tiers(kind)[-1]).values()
    return max(([w, h, *frames] for w, h in sizes), key=lambda b: (tokens_of(b), b))


def component_config(folder: Path, name: str) -> dict[str, Any]:
    """``<folder>/<name>/config.json``, or {} when the folder has none (the family's defaults then apply:
    those of the published model)."""
    path = folder / name / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def activation_shape(adapter: Any, family: str, folder: Path, transformer_config: dict[str, Any], recipe: Any,
                     blocks: int) -> ActivationShape:
    """The activation shape of ``recipe``'s largest bucket for ``family``'s transformer in ``folder``."""
    from latentmill.stages.families import family_class

    encoders = family_class(family)
    seq = recipe.cache.max_sequence_length

    def shapes(bucket: list[int]) -> dict[str, tuple[int, ...]]:
        return encoders.sample_shapes(lambda name: component_config(folder, name), bucket, seq)

    def tokens(bucket: list[int]) -> int:
        return adapter.seq_len(torch.empty(1, *shapes(bucket)["latents"], device="meta"))

    bucket = largest_bucket(recipe.bucket, encoders.FRAME_STEP is not None, tokens)
    text = adapter.text_tokens(shapes(bucket))
    hidden, ffn = adapter.block_widths(transformer_config)
    return ActivationShape(tuple(bucket), tokens(bucket), int(text), adapter.text_in_blocks,
                           tuple(adapter.float32_activations), hidden, ffn, blocks, recipe.trainer.batch_size,
                           tuple(adapter.side_streams(transformer_config, shapes(bucket))),
                           adapter.attention_mask_bytes)



def shipped_point(family: str, folder: str, overrides: dict[str, Any], bucket: list[int],
                  text_tokens: int) -> tuple[dict[str, Any], ActivationShape]:
    """A measurement point: the shipped transformer config of ``configs/models/<folder>`` with ``overrides`` (a
    reduced depth, say), and the activation shape of a recipe whose largest bucket is ``bucket`` ([H, W, F])
    with ``text_tokens`` tokens, batch 1."""
    from latentmill.recipe import load_recipe
    from latentmill.resources import resource_root
    from latentmill.trainer.adapters import get_adapter

    adapter, shipped = get_adapter(family), resource_root() / "configs" / "models" / folder  # plan's folder
    cls = adapter.diffusers_class(adapter.transformer_class)
    config = {**cls.load_config(str(shipped), subfolder="transformer"), **overrides}
    with torch.device("meta"):
        blocks = len(adapter.blocks(cls.from_config(config)))
    # the recipe's largest bucket is this one bucket: one aspect ratio at its pixel budget, its frame count
    frames = [f"bucket.max_frames={bucket[2]}", f"bucket.frame_counts=[{bucket[2]}]"] if bucket[2] > 1 else []
    recipe = load_recipe("demo", [f"bucket.resolution={round((bucket[0] * bucket[1]) ** 0.5)}",
                                  f"bucket.aspect_ratios=[{bucket[0] / bucket[1]}]", "bucket.step=16",
                                  f"cache.max_sequence_length={text_tokens}", "trainer.batch_size=1", *frames])
    return config, activation_shape(adapter, family, shipped, config, recipe, blocks)

@functools.cache
def _fake_mode(cls: type) -> Any:
    """One fake mode per process: the adapters cache small tensors (Flux's position ids) across calls, and a
    fake tensor cannot enter another fake mode; real ones may (a cache filled by real steps)."""
    return cls(allow_non_fake_inputs=True)


def _known(tensor: torch.Tensor) -> torch.Tensor:
    """The real ``tensor`` as a fake one that carries its values, so that a scalar computed from it alone (a mask's
    real-token count) is known: the families that trim their text by its mask take data-dependent shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = _fake_mode(FakeTensorMode)
    return mode.fake_tensor_converter.from_real_tensor(mode, tensor, make_constant=True)


def measured_activation_bytes(family: str, config: dict[str, Any], bucket: list[int], max_sequence_length: int, *,
                              checkpointing: bool, batch: int = 1, fake: bool = True) -> int:
    """Peak activation bytes of one forward and backward of ``family``'s real Diffusers transformer built from
    ``config`` in bf16, at ``bucket``, measured by torch's ``MemTracker`` under ``FakeTensorMode`` (no memory
    is used: real sizes run on a CPU). Each gradient is dropped as soon as it is accumulated, as FSDP2's
    reduce-scatter frees it; the peak minus parameters and buffers is the activations' (the check of
    :func:`activation_bytes`). ``fake=False``: real tensors on the CPU, for a class whose forward branches on its
    inputs' values (HunyuanVideo 1.5's ``torch.all(image_embeds == 0)``); keep ``config`` and ``bucket`` small."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from latentmill.stages.families import family_class
    from latentmill.trainer.adapters import get_adapter

    adapter = get_adapter(family)
    cls = adapter.diffusers_class(adapter.transformer_class)
    shapes = family_class(family).sample_shapes(lambda name: {}, bucket, max_sequence_length)

    class Guidance:  # what the adapters' forward reads of the trainer config
        guidance_scale = 3.5

    # the loader's masks of the trimmed text streams, every token real (the estimate's longest text); made real,
    # outside the fake mode, so that their values are known in it
    masks = {f"{stream.name}_mask": torch.ones(batch, shapes[stream.name][0], dtype=torch.bool)
             for stream in family_class(family).STREAMS if stream.pad == "mask"}
    with _fake_mode(FakeTensorMode) if fake else contextlib.nullcontext():
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # FSDP2's bf16 gathered parameters
        try:
            model = cls.from_config(config)
        finally:
            torch.set_default_dtype(default)
        if checkpointing:
            model.enable_gradient_checkpointing()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        inputs = {name: torch.randn(batch, *shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
        inputs.update({name: _known(mask) if fake else mask for name, mask in masks.items()})
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker, warnings.catch_warnings():
            # the tracker names each None it meets among a module's outputs (Diffusers returns some)
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            out = adapter.forward(model, inputs["latents"].clone(), torch.rand(batch), inputs, Guidance())
            out = out[0] if isinstance(out, tuple) else out
            out.float().pow(2).mean().backward()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    return sum(v for k, v in peak.items() if k == "Total") - sum(
        v for k, v in peak.items() if str(getattr(k, "value", k)) in ("Parameter", "Buffer"))
