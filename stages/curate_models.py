"""The curate stage's model scorers (``aesthetic``, ``clip_score``) and its video ``motion`` score.

* ``aesthetic``: the LAION "improved aesthetic predictor" v2 recipe. An image embedding model (CLIP or
  SigLIP, ``curate.aesthetic_model``: a hub id or a folder, loaded by ``from_pretrained``) gives the
  L2-normalised image embedding; a small MLP head (``curate.aesthetic_head``, safetensors, the LAION key
  names ``layers.{0,2,4,6,7}.{weight,bias}``) maps it to a score (about 1..10 with the real LAION head).
* ``clip_score``: 100 x the cosine similarity of the image embedding and the caption's text embedding, same
  model (``curate.clip_model``, default ``curate.aesthetic_model``) - CLIPScore's scale, not clamped at 0.
* ``motion`` (video only; an image has none): the mean absolute difference of consecutive grey frames
  among the K frames already decoded for scoring, in grey levels 0..255. No model, no extra decode.

A video's model score is the mean of its frames' scores, like every curate score. The model class is chosen
by the folder's ``config.json`` ``model_type``: ``clip`` -> ``CLIPModel``, ``clip_vision_model`` ->
``CLIPVisionModelWithProjection`` (images only: no ``clip_score``), ``siglip`` / ``siglip2`` ->
``AutoModel``. Models load once per process (threads share them; a lock serialises forwards), on the GPU
when there is one (``curate.device``), in bf16 there (``curate.dtype``), and are dropped by
:func:`release_models` (``pipelines.prep.release_prep_models``). Forwards take ``curate.batch_size``
images (frames) or captions at a time.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from latentmill.core.config import ConfigError
from latentmill.core.fingerprints import file_fingerprint
from latentmill.models import LoadedOnce

if TYPE_CHECKING:
    from latentmill.stages.curate import CurateConfig

MODEL_SCORERS = ("aesthetic", "clip_score")
MODEL_CLASSES = {"clip": "CLIPModel", "clip_vision_model": "CLIPVisionModelWithProjection",
                 "siglip": "AutoModel", "siglip2": "AutoModel"}
CLIP_SCORE_SCALE = 100.0  # CLIPScore's scale (torchmetrics); CLIP ViT-L/14 gives ~15..35 for a fit caption
# Forward calls of every scorer model in this process, by input: what tests and benchmarks count.
FORWARDS = {"image": 0, "text": 0}


def scorer_model(cfg: "CurateConfig", name: str) -> str | None:
    """The model id or folder scorer ``name`` uses (None when unset)."""
    return cfg.aesthetic_model if name == "aesthetic" else cfg.clip_model or cfg.aesthetic_model


# ---------------------------------------------------------------------------------------------------------
# Motion (numpy)
# ---------------------------------------------------------------------------------------------------------


def motion(greys: list[np.ndarray]) -> float:
    """Mean absolute difference of consecutive frames (grey levels 0..255); 0 for a single frame.

    The K frames are spread over the whole clip, so this measures how much the picture changes across the
    clip: a still shot scores its codec noise (< 1), a pan or moving subject tens of grey levels."""
    if len(greys) < 2:
        return 0.0
    return float(np.mean([np.mean(np.abs(b - a)) for a, b in zip(greys, greys[1:])]))


# ---------------------------------------------------------------------------------------------------------
# The embedding model
# ---------------------------------------------------------------------------------------------------------


def _features(out: Any, name: str) -> Any:
    """The embedding tensor of a ``get_*_features`` / projection-model call (a tensor, or an output whose
    ``pooler_output`` / ``image_embeds`` / ``text_embeds`` holds it, by transformers version)."""
    if hasattr(out, "shape"):
        return out
    for attr in (f"{name}_embeds", "pooler_output"):
        value = getattr(out, attr, None)
        if value is not None:
            return value
    raise TypeError(f"cannot find the {name} embedding in a {type(out).__name__}")


class EmbeddingModel:
    """A CLIP or SigLIP model and its processor on one device: L2-normalised image and text embeddings."""

    def __init__(self, model_id: str, path: str, dtype: str, device: str):
        import torch
        import transformers
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        self.model_id = model_id
        self.model_type = getattr(config, "model_type", "")
        if self.model_type not in MODEL_CLASSES:
            raise ValueError(f"{model_id}: model_type {self.model_type!r} is not an image embedding model "
                             f"the curate scorers load; allowed: {', '.join(MODEL_CLASSES)}")
        self.embed_dim = embed_dim(config)
        self.has_text = self.model_type != "clip_vision_model"
        self.siglip = self.model_type.startswith("siglip")
        if self.has_text:
            self.processor = transformers.AutoProcessor.from_pretrained(path)
            self.image_processor, self.tokenizer = self.processor.image_processor, self.processor.tokenizer
        else:
            self.image_processor, self.tokenizer = transformers.AutoImageProcessor.from_pretrained(path), None
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        cls = getattr(transformers, MODEL_CLASSES[self.model_type])
        self.model = cls.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.lock = threading.Lock()

    def _normalised(self, embeds: Any) -> np.ndarray:
        import torch

        embeds = embeds.float()
        return torch.nn.functional.normalize(embeds, dim=-1).cpu().numpy().astype(np.float32)

    def frame_embeddings(self, frames: list[Image.Image], batch_size: int = 16) -> np.ndarray:
        """One L2-normalised float32 row per image, ``batch_size`` images per forward."""
        import torch

        rows = [np.zeros((0, self.embed_dim), np.float32)]
        for start in range(0, len(frames), batch_size):
            pixels = self.image_processor(images=frames[start:start + batch_size], return_tensors="pt")
            pixel_values = pixels["pixel_values"].to(self.device, self.dtype)
            with self.lock, torch.inference_mode():
                FORWARDS["image"] += 1
                if self.has_text:
                    out = self.model.get_image_features(pixel_values=pixel_values)
                else:
                    out = self.model(pixel_values=pixel_values)
                rows.append(self._normalised(_features(out, "image")))
        return np.concatenate(rows)

    def image_embeddings(self, frames_per_sample: list[list[Image.Image]],
                         batch_size: int = 16) -> np.ndarray:
        """One L2-normalised float32 row per sample: an image's embedding, or the normalised mean of a
        video's frame embeddings (for near-duplicate search)."""
        flat = self.frame_embeddings([f for frames in frames_per_sample for f in frames], batch_size)
        rows, start = [], 0
        for frames in frames_per_sample:
            mean = flat[start:start + len(frames)].mean(axis=0)
            rows.append(mean / max(float(np.linalg.norm(mean)), 1e-12))
            start += len(frames)
        return np.asarray(rows, np.float32).reshape(len(frames_per_sample), self.embed_dim)

    def text_embeddings(self, texts: list[str], batch_size: int = 16) -> np.ndarray:
        """One L2-normalised float32 row per text (truncated to the tokenizer's length; SigLIP pads to it,
        as it was trained)."""
        import torch

        if self.tokenizer is None:
            raise ValueError(f"{self.model_id}: a vision-only model ({self.model_type}) embeds no text")
        rows = [np.zeros((0, self.embed_dim), np.float32)]
        for start in range(0, len(texts), batch_size):
            tokens = self.tokenizer(texts[start:start + batch_size], truncation=True, return_tensors="pt",
                                    padding="max_length" if self.siglip else True)
            tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
            if self.siglip:
                tokens.pop("attention_mask", None)  # SigLIP attends to its padding, as in training
            with self.lock, torch.inference_mode():
                FORWARDS["text"] += 1
                rows.append(self._normalised(_features(self.model.get_text_features(**tokens), "text")))
        return np.concatenate(rows)


def embed_dim(config: Any) -> int:
    """Size of the model's image embedding: the projection size (CLIP), the vision width (SigLIP)."""
    if getattr(config, "model_type", "").startswith("siglip"):
        return int(config.vision_config.hidden_size)
    return int(config.projection_dim)


# ---------------------------------------------------------------------------------------------------------
# The aesthetic head
# ---------------------------------------------------------------------------------------------------------


class AestheticHead:
    """The LAION v2 MLP: Linear layers ``layers.{i}`` in index order (the Dropouts between them hold no
    weights and do nothing at inference; LAION's head has no activations). Runs in float32 on the CPU."""

    def __init__(self, path: str, input_dim: int, model_id: str = "the image model"):
        from safetensors.torch import load_file

        state = load_file(path)
        self.layers = check_head(state, input_dim, path, model_id)

    def __call__(self, embeds_ND: np.ndarray) -> np.ndarray:
        """One score per row of L2-normalised embeddings."""
        import torch

        x = torch.from_numpy(np.ascontiguousarray(embeds_ND, np.float32))
        with torch.inference_mode():
            for weight, bias in self.layers:
                x = torch.nn.functional.linear(x, weight, bias)
        return x[:, 0].numpy().astype(np.float64)


def check_head(state: dict[str, Any], input_dim: int, path: str, model_id: str) -> list[tuple[Any, Any]]:
    """The head's ``(weight, bias)`` pairs in order, after checking the LAION layout and that its input size
    is the model's embedding size; ValueError naming both shapes when they do not fit."""
    where = f"curate.aesthetic_head: {path}"
    indices = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.count(".") == 2
                      and k.split(".")[1].isdigit()})
    expected = {f"layers.{i}.{p}" for i in indices for p in ("weight", "bias")}
    if not indices or set(state) != expected:
        raise ValueError(f"{where}: not a LAION-layout head (keys layers.<i>.weight / layers.<i>.bias); "
                         f"found {sorted(state)[:8]}")
    layers, width = [], input_dim
    for n, i in enumerate(indices):
        weight, bias = state[f"layers.{i}.weight"].float(), state[f"layers.{i}.bias"].float()
        if weight.ndim != 2 or weight.shape[1] != width or tuple(bias.shape) != (weight.shape[0],):
            fed = (f"the image model {model_id} gives {input_dim}-dim embeddings" if n == 0
                   else f"the layer before gives {width} values")
            raise ValueError(f"{where}: layers.{i}.weight has shape {tuple(weight.shape)} (bias "
                             f"{tuple(bias.shape)}), which takes {weight.shape[-1]} inputs, but {fed}")
        layers.append((weight, bias))
        width = weight.shape[0]
    if width != 1:
        raise ValueError(f"{where}: the last layer gives {width} values, not one score")
    return layers


def head_input_size(path: str) -> int | None:
    """The input size of a LAION-layout head file, read from its safetensors header (None if unknown)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        keys = sorted((k for k in f.keys() if k.startswith("layers.") and k.endswith(".weight")),
                      key=lambda k: int(k.split(".")[1]) if k.split(".")[1].isdigit() else 1 << 30)
        return int(f.get_slice(keys[0]).get_shape()[-1]) if keys else None


# ---------------------------------------------------------------------------------------------------------
# Loading once per process, fingerprints, checks
# ---------------------------------------------------------------------------------------------------------

_models = LoadedOnce()


def release_models() -> int:
    """Forget every scorer model and head this process loaded; returns how many there were."""
    return _models.release()


def _devices(cfg: "CurateConfig") -> tuple[str, str]:
    from latentmill.stages.captioners.hf import resolve_device, resolve_dtype

    device = resolve_device(cfg.device)
    return device, resolve_dtype(cfg.dtype, device)


def get_model(cfg: "CurateConfig", model_id: str) -> EmbeddingModel:
    """The embedding model ``model_id`` on the recipe's device, loaded once per process (a changed folder
    loads anew)."""
    from latentmill.stages.captioners.hf import model_fingerprint, resolve_model

    device, dtype = _devices(cfg)
    path = resolve_model(model_id)
    return _models.get(("model", path, model_fingerprint(model_id), dtype, device),
                       lambda: EmbeddingModel(model_id, path, dtype, device))


def get_head(cfg: "CurateConfig", model: EmbeddingModel) -> AestheticHead:
    """The aesthetic head for ``model``, loaded and checked once per process."""
    path = str(cfg.aesthetic_head)
    return _models.get(("head", path, file_fingerprint(path), model.embed_dim),
                       lambda: AestheticHead(path, model.embed_dim, model.model_id))


def embedding_model(cfg: "CurateConfig") -> EmbeddingModel:
    """The loaded model near-duplicate search embeds with: the aesthetic model, else the clip_score one."""
    model_id = cfg.aesthetic_model or cfg.clip_model
    if not model_id:
        raise ValueError("curate.aesthetic_model / curate.clip_model: no image embedding model is set")
    return get_model(cfg, model_id)


def image_embeddings(cfg: "CurateConfig", frames_per_sample: list[list[Image.Image]]) -> np.ndarray:
    """L2-normalised float32 embeddings, one row per sample (a video: the mean of its frames'), from
    :func:`embedding_model`, ``curate.batch_size`` frames per forward."""
    return embedding_model(cfg).image_embeddings(frames_per_sample, cfg.batch_size)


def fingerprint(cfg: "CurateConfig", name: str) -> dict[str, Any]:
    """What decides a model score besides the pixels: the model's weights (by content, hashed once per
    file and remembered), the head's for ``aesthetic``, the dtype setting, ``clip_score``'s scale."""
    from latentmill.stages.captioners.hf import model_fingerprint

    fp: dict[str, Any] = {"model": model_fingerprint(str(scorer_model(cfg, name))), "dtype": cfg.dtype}
    if name == "aesthetic":
        fp["head"] = file_fingerprint(str(cfg.aesthetic_head))
    else:
        fp["scale"] = CLIP_SCORE_SCALE
    return fp


def check_config(cfg: "CurateConfig", active: list[str]) -> None:
    """Fail before any work when a model scorer lacks its model or head, a local model is not a CLIP or
    SigLIP folder, or the head does not fit it (hub ids are checked when they load)."""
    import json

    if "aesthetic" in active:
        if not cfg.aesthetic_model:
            raise ConfigError("curate.aesthetic_model: the aesthetic scorer (curate.scorers or "
                              "curate.min_aesthetic) needs a CLIP or SigLIP model id or folder, e.g. "
                              "openai/clip-vit-large-patch14")
        if not cfg.aesthetic_head or not Path(cfg.aesthetic_head).is_file():
            raise ConfigError(f"curate.aesthetic_head: the aesthetic scorer needs the MLP head's safetensors "
                              f"file; got {cfg.aesthetic_head!r}, which is not a file")
    if "clip_score" in active and not scorer_model(cfg, "clip_score"):
        raise ConfigError("curate.clip_model: the clip_score scorer (curate.scorers or "
                          "curate.min_clip_score) needs a CLIP or SigLIP model id or folder (default: "
                          "curate.aesthetic_model, unset)")
    for name in (n for n in MODEL_SCORERS if n in active):
        model_id = str(scorer_model(cfg, name))
        config_file = Path(model_id) / "config.json"
        if not config_file.is_file():
            continue  # a hub id: checked when it loads
        config = json.loads(config_file.read_text())
        model_type = config.get("model_type", "")
        key = "curate.aesthetic_model" if name == "aesthetic" else "curate.clip_model"
        if model_type not in MODEL_CLASSES:
            raise ConfigError(f"{key}: {model_id} has model_type {model_type!r}; allowed: "
                              f"{', '.join(MODEL_CLASSES)}")
        if name == "clip_score" and model_type == "clip_vision_model":
            raise ConfigError(f"{key}: {model_id} is vision-only (clip_vision_model): clip_score needs its "
                              "text tower; allowed model types: clip, siglip, siglip2")
        if name == "aesthetic":
            from transformers import AutoConfig

            dim = embed_dim(AutoConfig.from_pretrained(model_id))
            width = head_input_size(str(cfg.aesthetic_head))
            if width != dim:
                raise ConfigError(f"curate.aesthetic_head: {cfg.aesthetic_head} takes {width}-dim "
                                  f"embeddings, but curate.aesthetic_model {model_id} gives {dim}-dim ones")


# ---------------------------------------------------------------------------------------------------------
# Scoring a batch of samples
# ---------------------------------------------------------------------------------------------------------


def model_scores(cfg: "CurateConfig", frames_per_sample: list[list[Image.Image]], captions: list[str],
                 needs: list[list[str]]) -> list[dict[str, float]]:
    """The model scores each sample needs (``needs[i]``, a subset of ``MODEL_SCORERS``), for a batch of
    samples: each model embeds the frames of the samples that need it once (``aesthetic`` and
    ``clip_score`` share one pass when they use the same model), ``curate.batch_size`` per forward."""
    results: list[dict[str, float]] = [{} for _ in needs]
    by_model: dict[str, list[str]] = {}
    for name in MODEL_SCORERS:
        if any(name in n for n in needs):
            by_model.setdefault(str(scorer_model(cfg, name)), []).append(name)
    for model_id, names in by_model.items():
        model = get_model(cfg, model_id)
        samples = [i for i, n in enumerate(needs) if set(n) & set(names)]
        lengths = [len(frames_per_sample[i]) for i in samples]
        flat = model.frame_embeddings([f for i in samples for f in frames_per_sample[i]], cfg.batch_size)
        starts = np.cumsum([0, *lengths])
        per_frame: dict[str, np.ndarray] = {}
        if "aesthetic" in names:
            per_frame["aesthetic"] = get_head(cfg, model)(flat)
        if "clip_score" in names:
            texts = model.text_embeddings([captions[i] for i in samples], cfg.batch_size)
            per_frame["clip_score"] = CLIP_SCORE_SCALE * np.einsum(
                "fd,fd->f", flat.astype(np.float64), np.repeat(texts, lengths, axis=0).astype(np.float64))
        for j, i in enumerate(samples):
            for name in names:
                if name in needs[i]:
                    results[i][name] = float(np.mean(per_frame[name][starts[j]:starts[j + 1]]))
    return results
