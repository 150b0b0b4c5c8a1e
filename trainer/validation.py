"""Validation samples during training: the stock Diffusers pipeline around the in-training transformer.

The VAE and text encoders are not part of training (the loop reads cached latents only); they are loaded
from ``pretrained`` for the duration of one validation and freed afterwards. Sampling uses a fixed seed, so
two validations differ only by the weights, and it runs inside ``torch.random.fork_rng`` so the training
RNG streams (and with them an exact resume) do not depend on whether or when validation ran. Under FSDP2
every rank runs the pipeline (the sharded transformer's forward is collective); rank 0 writes the grid.
"""

from __future__ import annotations

import gc
import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from latentmill.trainer.adapter import ModelAdapter
from torch import nn

log = logging.getLogger(__name__)


def image_grid(rows: list[list[Any]]) -> Any:
    """Paste rows of equally sized PIL images into one image (one row per prompt)."""
    from PIL import Image

    width, height = rows[0][0].size
    columns = max(len(row) for row in rows)
    grid = Image.new("RGB", (columns * width, len(rows) * height))
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            grid.paste(image.convert("RGB"), (c * width, r * height))
    return grid


def run_validation(
    adapter: ModelAdapter,
    transformer: nn.Module,
    *,
    pretrained: str,
    cfg: Any,
    step: int,
    train_dir: Path,
    device: torch.device,
    max_sequence_length: int,
    is_main: bool = True,
    tb_writer: Any = None,
) -> Path | None:
    """Generate ``cfg.validation_prompts`` with the in-training ``transformer``; save ``validation/step-N.png``.

    Returns the PNG path on the main rank (None elsewhere).
    """
    pipeline_cls = adapter.diffusers_class(adapter.pipeline_class)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    # torch_dtype only when not the default (diffusers 0.42 deprecates the name, older releases lack `dtype`)
    extra = {"torch_dtype": dtype} if dtype != torch.float32 else {}
    pipe = pipeline_cls.from_pretrained(pretrained, transformer=transformer, **extra)
    for component in pipe.components.values():
        if isinstance(component, nn.Module) and component is not transformer:
            component.to(device).eval()
    pipe.set_progress_bar_config(disable=True)
    was_training = transformer.training
    transformer.eval()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []), torch.no_grad(), autocast:
            rows = adapter.validation_images(
                pipe,
                list(cfg.validation_prompts),
                size=list(cfg.validation_size),
                steps=cfg.validation_steps,
                generator=torch.Generator("cpu").manual_seed(cfg.validation_seed),
                max_sequence_length=max_sequence_length,
                guidance_scale=cfg.guidance_scale,
            )
    finally:
        transformer.train(was_training)
        del pipe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if not is_main:
        return None
    grid = image_grid(rows)
    out_dir = train_dir / "validation"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"step-{step:06d}.png"
    tmp = path.with_suffix(".png.tmp")
    grid.save(tmp, format="PNG")
    os.replace(tmp, path)
    if tb_writer is not None:
        import numpy as np

        tb_writer.add_image("validation", np.asarray(grid), step, dataformats="HWC")
    log.info("validation samples at step %d: %s", step, path)
    return path
