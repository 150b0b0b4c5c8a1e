"""Validation samples during training: the stock Diffusers pipeline around the in-training transformer.

The prompts come as embeddings the prep encoded with the captions' text encoders (``cached_prompts``: the
snapshot's ``validation_prompts`` file), so training never loads a text encoder (T5-XXL or UMT5-XXL: 10-12 GB
of host memory per rank). The pipeline is built with every text encoder and tokenizer set to None and is given
``prompt_embeds`` and the family's other text streams (``ModelAdapter.pipeline_prompt_kwargs``). A family whose
pipeline cannot take what the cache stores (LTX-2) still loads its text encoder and passes ``prompt=``.

The VAE and scheduler are not part of training (the loop reads cached latents only). A ``Validator``, created
once per run, loads them from ``pretrained`` at its first validation and keeps them in host memory between
validations; a validation moves them to the device, samples, and moves
them back (the GPU holds them only while it samples). Sampling uses a fixed seed, so two validations differ
only by the weights, and it runs inside ``torch.random.fork_rng`` so the training RNG streams (and with them
an exact resume) do not depend on whether or when validation ran. Under FSDP2 every rank runs the pipeline
(the sharded transformer's forward is collective); rank 0 writes the grid.

Dtypes on CUDA (``component_dtypes``): the VAE and text encoders in the dtypes the cache stage encoded with
(``latentmill.stages.families.compute_dtypes``: the Wan VAE in float32, the rest bf16), the transformer's
forward under bf16 autocast; the VAE decodes outside autocast, in its own dtype. On CPU everything is
float32 and nothing is autocast.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from latentmill.stages.families import compute_dtypes
from latentmill.trainer.adapter import ModelAdapter, pipeline_index
from latentmill.trainer.loader import manifest_streams
from safetensors.torch import load as load_safetensors
from torch import nn

from latentmill.core.config import ConfigError
from latentmill.core.hashing import sha256_bytes

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


def grid_frames(frames: list[Any]) -> list[Any]:
    """The frames of one video a validation grid shows: the first, the last and two between."""
    return [frames[i] for i in sorted({round(i * (len(frames) - 1) / 3) for i in range(4)})]


def video_path(grid: Path) -> Path:
    """The animated GIF a video validation writes beside its grid ``step-N.png``."""
    return grid.with_suffix(".gif")


def save_video(rows: list[list[Any]], path: Path, frame_ms: int = 125) -> Path:
    """Every frame of the validation videos as one animated GIF (each frame: the prompts' frames side by side),
    written whole under a temporary name first."""
    frames = [image_grid([[row[i] for row in rows]]) for i in range(min(len(row) for row in rows))]
    tmp = path.with_suffix(".gif.tmp")
    frames[0].save(tmp, format="GIF", save_all=True, append_images=frames[1:], duration=frame_ms, loop=0)
    os.replace(tmp, path)
    return path


def component_dtypes(family: str, device: torch.device | str) -> dict[str, torch.dtype]:
    """The dtype of each part of a validation pipeline of ``family`` on ``device``: ``vae`` and ``text`` (every
    other loaded component: text encoders) as the cache stage ran them (``compute_dtypes``), ``transformer``
    the autocast dtype of the in-training transformer's forward (float32: no autocast)."""
    device = torch.device(device)
    dtypes = compute_dtypes(family, device)
    return {
        "vae": dtypes["vae"],
        "text": dtypes["text"],
        "transformer": torch.bfloat16 if device.type == "cuda" else torch.float32,
    }


def decode_in_own_dtype(vae: nn.Module) -> None:
    """Make ``vae.decode`` run outside autocast, on latents cast to the VAE's dtype.

    The pipelines call ``self.vae.decode`` inside the caller's bf16 autocast (there for the transformer),
    which would run the VAE's convolutions in bf16 whatever its weights' dtype: the Wan VAE must decode in
    float32, the dtype the cache encoded with. The ``Validator`` owns this VAE, so the override is its own.
    """
    decode = vae.decode

    @functools.wraps(decode)
    def decode_outside_autocast(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(z.device.type, enabled=False):
            return decode(z.to(vae.dtype), *args, **kwargs)

    vae.decode = decode_outside_autocast


@dataclass(frozen=True)
class CachedPrompts:
    """Prompt embeddings of a snapshot: each prompt's text streams as stored, and each trimmed token stream's
    padded length (the loader's: ``pad_to`` of the cache's text, or a stream's own; none when stored padded)."""

    streams: dict[str, dict[str, torch.Tensor]]  # prompt -> stream name -> tensor
    pad_to: dict[str, int]


def cached_prompts(manifest: dict[str, Any], cache_dir: Path, prompts: list[str], where: str) -> CachedPrompts:
    """The embeddings of ``prompts`` in the snapshot (``manifest["validation_prompts"]``, checked against its
    sha256); a one-line ConfigError saying to re-run prep when any is missing (a snapshot made before the prep
    encoded validation prompts, or with other prompts)."""
    entry = manifest.get("validation_prompts") or {}
    keys = entry.get("keys") or {}
    missing = [p for p in prompts if p not in keys]
    if missing:
        raise ConfigError(f"trainer.validation_prompts: the snapshot {where} has no embeddings of {missing[0]!r}"
                          f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} (validation takes them "
                          "from the prep, never loads a text encoder); re-run `latentmill prep` with this recipe")
    path = Path(cache_dir) / entry["path"]
    data = path.read_bytes()
    if sha256_bytes(data) != entry["sha256"]:
        raise ValueError(f"{path}: sha256 differs from the manifest's validation_prompts entry; re-run prep")
    tensors = load_safetensors(data)
    streams = {p: {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == keys[p]}
               for p in prompts}
    text = manifest.get("text") or {}
    pad_to = {s["name"]: int(s.get("pad_to") or text["pad_to"]) for s in manifest_streams(manifest)
              if s["component"] == "text" and s.get("pad", "none") != "none" and text.get("trimmed")}
    return CachedPrompts(streams, pad_to)


class Validator:
    """Validation grids of one training run; the pipeline's other components loaded once.

    ``run`` samples ``cfg.validation_prompts`` with the in-training transformer. The first call loads the
    VAE and scheduler (and, without ``prompts``, the text encoders and tokenizers) with
    ``pipeline_cls.from_pretrained(pretrained, transformer=...)`` (the user's loading path) in
    ``component_dtypes``; between calls they stay on the CPU. ``prompts``: the prompts' cached embeddings
    (``cached_prompts``, with the adapter's negative prompt); the pipeline then has no text encoder.
    """

    def __init__(self, adapter: ModelAdapter, pretrained: str, device: torch.device | str,
                 component: str = "transformer", prompts: CachedPrompts | None = None) -> None:
        self.adapter, self.pretrained, self.device = adapter, pretrained, torch.device(device)
        self.component = component  # the pipeline's slot of the in-training model (an expert's)
        self.slots: set[str] = {component}  # the slots of every in-training model (run's ``others`` too)
        self.dtypes = component_dtypes(adapter.family, self.device)
        self.prompts = prompts
        self.pipe: Any = None  # loaded by the first run
        self.rows: list[list[Any]] = []

    def _text_components(self) -> dict[str, None]:
        """None for every text encoder and tokenizer of the pipeline folder, when the prompts come cached."""
        if self.prompts is None:
            return {}
        return {name: None for name in pipeline_index(self.pretrained)
                if name.startswith(("text_encoder", "tokenizer"))}

    def _prompt_kwargs(self, prompts: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The pipeline's keyword arguments of ``prompts`` and of the negative prompt (one per prompt), on the
        device: cached embeddings, or the texts for a pipeline that encodes them itself (``prompt=``,
        ``negative_prompt=``)."""
        if self.prompts is None:
            return {"prompt": prompts}, {"negative_prompt": [self.adapter.negative_prompt] * len(prompts)}
        streams, pad_to = self.prompts.streams, self.prompts.pad_to
        text = self.adapter.pipeline_prompt_kwargs([streams[p] for p in prompts], pad_to)
        negative = self.adapter.pipeline_prompt_kwargs([streams[self.adapter.negative_prompt]] * len(prompts), pad_to)
        return _to(text, self.device), {f"negative_{k}": v for k, v in _to(negative, self.device).items()}

    def _pipeline(self, transformer: nn.Module, others: dict[str, nn.Module] | None = None) -> Any:
        """The pipeline around the in-training ``transformer`` (and ``others`` by slot); its other components
        loaded on first use, on the CPU."""
        models = {self.component: transformer, **(others or {})}
        self.slots = set(models)
        if self.pipe is None:
            pipeline_cls = self.adapter.diffusers_class(self.adapter.pipeline_class)
            vae, text = self.dtypes["vae"], self.dtypes["text"]
            # torch_dtype only when not the default (diffusers 0.42 deprecates the name, older releases lack
            # `dtype`); a dict: the VAE in its own dtype, every other loaded component in the text encoders'
            extra = {"torch_dtype": {"vae": vae, "default": text}} if (vae, text) != (torch.float32,) * 2 else {}
            self.pipe = pipeline_cls.from_pretrained(self.pretrained, **models, **self._text_components(), **extra)
            self.pipe.set_progress_bar_config(disable=True)
            for component in self._components():
                component.eval()
            if getattr(self.pipe, "vae", None) is not None:
                decode_in_own_dtype(self.pipe.vae)
        else:
            self.pipe.register_modules(**models)
        return self.pipe

    def _components(self) -> list[nn.Module]:
        """The pipeline's modules other than the transformer (VAE, text encoders)."""
        return [c for name, c in self.pipe.components.items() if isinstance(c, nn.Module) and name not in self.slots]

    def _move(self, device: torch.device) -> None:
        for component in self._components():
            component.to(device)

    def run(
        self,
        transformer: nn.Module,
        *,
        cfg: Any,
        step: int,
        train_dir: Path,
        max_sequence_length: int,
        is_main: bool = True,
        others: dict[str, nn.Module] | None = None,
    ) -> Path | None:
        """Generate ``cfg.validation_prompts`` with ``transformer``; save ``<train_dir>/validation/step-N.png`` (a
        video family: four frames of each video, and every frame in ``step-N.gif`` beside it, ``video_path``).

        ``others``: further in-training models by pipeline slot (``transformer_2`` of a run of both experts).
        Returns the PNG path on the main rank (None elsewhere). Every rank calls it (FSDP2: collective).
        """
        device, cuda = self.device, self.device.type == "cuda"
        pipe = self._pipeline(transformer, others)
        models = {self.component: transformer, **(others or {})}
        was_training = {slot: model.training for slot, model in models.items()}
        for model in models.values():
            model.eval()
        autocast = torch.autocast("cuda", dtype=self.dtypes["transformer"]) if cuda else nullcontext()
        try:
            self._move(device)
            text, negative = self._prompt_kwargs(list(cfg.validation_prompts))
            with torch.random.fork_rng(devices=[device] if cuda else []), torch.no_grad(), autocast:
                rows = self.adapter.validation_images(
                    pipe,
                    text,
                    negative,
                    size=list(cfg.validation_size),
                    steps=cfg.validation_steps,
                    generator=torch.Generator("cpu").manual_seed(cfg.validation_seed),
                    max_sequence_length=max_sequence_length,
                    guidance_scale=cfg.guidance_scale,
                )
        finally:
            for slot, model in models.items():
                model.train(was_training[slot])
            self._move(torch.device("cpu"))
            pipe.register_modules(**dict.fromkeys(models))  # the pipeline does not keep the training model alive
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if not is_main:
            return None
        self.rows = rows  # the last validation's images, each prompt's row (its CLIP score)
        video = any(len(row) > 1 for row in rows)  # a video family: every frame of each video
        grid = image_grid([grid_frames(row) for row in rows] if video else rows)
        out_dir = train_dir / "validation"
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"step-{step:06d}.png"
        if video:
            save_video(rows, video_path(path))
        tmp = path.with_suffix(".png.tmp")
        grid.save(tmp, format="PNG")
        os.replace(tmp, path)
        log.info("validation samples at step %d: %s", step, path)
        return path

    def close(self) -> None:
        """Free the loaded components (host memory)."""
        self.pipe = None
        gc.collect()


def _to(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors (and lists of tensors: Z-Image's prompts) of pipeline keyword arguments on ``device``, embeddings in
    float32 as the training loader hands them out (a cache may store bf16; masks keep their dtype)."""

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, torch.float32) if t.is_floating_point() else t.to(device)

    return {k: [to(t) for t in v] if isinstance(v, list) else to(v) for k, v in kwargs.items()}


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
) -> Path | None:
    """One validation with a one-off ``Validator`` (loads the components from disk each call: a training
    run keeps one ``Validator`` instead). Returns the PNG path on the main rank (None elsewhere)."""
    validator = Validator(adapter, pretrained, device)
    try:
        return validator.run(
            transformer,
            cfg=cfg,
            step=step,
            train_dir=train_dir,
            max_sequence_length=max_sequence_length,
            is_main=is_main,
        )
    finally:
        validator.close()
