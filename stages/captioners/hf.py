"""The ``transformers`` captioner: any Hugging Face image-to-text / image-text-to-text model.

``caption.model`` is a hub id (``Salesforce/blip-image-captioning-large``, ``Qwen/Qwen2.5-VL-7B-Instruct``,
``florence-community/Florence-2-large``) or a local folder; it loads through ``AutoProcessor.from_pretrained``
and the model class the checkpoint's config declares (``architectures``; with ``trust_remote_code`` the
class of its ``auto_map``; ``AutoModelForImageTextToText`` as the fallback), once per worker process, on
the GPU when there is one. Three families are handled:

* captioning models without a chat template (BLIP, BLIP-2, Florence-2): the prompt is passed as text
  (a caption prefix for BLIP, a task token such as ``<MORE_DETAILED_CAPTION>`` for Florence-2);
* chat VLMs (Qwen2-VL / Qwen2.5-VL, LLaVA...): the prompt becomes a user turn with the image through the
  processor's chat template, batches are left-padded;
* video: chat VLMs whose processor has a video processor get the K sampled frames as one video; other
  models caption every frame, and the sample gets one caption per frame (middle frame first, the primary).

The caption is the generated continuation only: the prompt a model echoes back is cut off before decoding.
Inputs of one ``generate`` call share the media kind and the prompt and never exceed ``caption.batch_size``;
on a CUDA out-of-memory error the batch is halved and retried.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from latentmill.stages import pixels
from latentmill.stages.captioners import CaptionItem, CaptionResult
from latentmill.stages.captioners.media import load_media

from latentmill.core.fingerprints import ComponentSource, component_fingerprint
from latentmill.core.hashing import stable_hash
from latentmill.models import LoadedOnce

DEFAULT_INSTRUCTION = "Describe this {media} in one or two sentences."
# Prompts for models that need one and are given none: Florence-2 only captions when asked with a task token.
DEFAULT_TASK_PROMPTS = {"florence2": "<MORE_DETAILED_CAPTION>"}
# Frames and images are shrunk to the processor's fixed input size, or to this longer side when the
# processor resizes dynamically (Qwen2-VL): bounds memory and the number of vision tokens.
DEFAULT_MAX_SIDE = 768


# ---------------------------------------------------------------------------------------------------------
# Resolving and fingerprinting the model
# ---------------------------------------------------------------------------------------------------------

_resolved: dict[tuple[str, str | None], str] = {}
_resolved_lock = threading.Lock()


def resolve_model(model: str, revision: str | None = None) -> str:
    """Local folder of ``model``: itself if it is a folder, else its hub snapshot (downloaded once)."""
    if Path(model).is_dir():
        return str(Path(model))
    with _resolved_lock:
        if (model, revision) not in _resolved:
            from huggingface_hub import snapshot_download

            _resolved[(model, revision)] = snapshot_download(model, revision=revision)
        return _resolved[(model, revision)]


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """Hash of the model's config, weight, tokenizer and processor files (names and bytes)."""
    return component_fingerprint(ComponentSource(resolve_model(model, revision), None))


def resolve_device(device: str) -> str:
    """``caption.device`` made concrete: ``auto`` is ``cuda`` when a GPU is visible, else ``cpu``; ``cuda``
    in a numbered process-pool worker is that worker's own GPU (``latentmill.stages.workers``), not every worker's
    ``cuda:0``."""
    import torch
    from latentmill.stages.workers import worker_gpu

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        own = worker_gpu(torch.cuda.device_count())
        if own is not None:
            return f"cuda:{own}"
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """``caption.dtype`` made concrete: ``auto`` is bf16 on GPU, float32 on CPU (slow, inexact CPU bf16)."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def model_class(config: Any, trust_remote_code: bool) -> Any:
    """The class to load ``config``'s checkpoint with: the one it declares, else the image-text auto class."""
    import transformers

    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and auto_map:
        for name in ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModelForCausalLM",
                     "AutoModelForSeq2SeqLM"):
            if name in auto_map and hasattr(transformers, name):
                return getattr(transformers, name)
    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForImageTextToText


def _input_side(processor: Any) -> int:
    """Longer side of the processor's fixed input size, or DEFAULT_MAX_SIDE for dynamic resizing."""
    size = getattr(getattr(processor, "image_processor", None), "size", None)
    if isinstance(size, dict) and size.get("height") and size.get("width"):
        return int(max(size["height"], size["width"]))
    return DEFAULT_MAX_SIDE


class LoadedModel:
    """A processor and model on one device; ``lock`` serialises ``generate`` between threads."""

    def __init__(self, path: str, dtype: str, device: str, trust_remote_code: bool):
        import torch
        from transformers import AutoConfig, AutoProcessor

        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        cls = model_class(self.config, trust_remote_code)
        model = cls.from_pretrained(path, dtype=self.dtype, trust_remote_code=trust_remote_code)
        self.model = model.to(self.device).eval()
        self.class_name = type(self.model).__name__
        self.model_type = getattr(self.config, "model_type", "")
        text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.encoder_decoder = bool(getattr(self.config, "is_encoder_decoder", False)
                                    or getattr(text_config, "is_encoder_decoder", False))
        self.chat = bool(getattr(self.processor, "chat_template", None))
        self.video = self.chat and getattr(self.processor, "video_processor", None) is not None
        self.max_side = _input_side(self.processor)
        tokenizer = getattr(self.processor, "tokenizer", None)
        if self.chat and not self.encoder_decoder and tokenizer is not None:
            tokenizer.padding_side = "left"  # decoder-only generation continues from the right end
        self.lock = threading.Lock()


_models = LoadedOnce()


def release_models() -> int:
    """Forget every captioning model this process loaded; returns how many there were."""
    return _models.release()


def get_model(path: str, fingerprint: str, dtype: str, device: str, trust_remote_code: bool) -> LoadedModel:
    """Load a model once per process (threads of one worker share it); a changed folder loads anew."""
    return _models.get((path, fingerprint, dtype, device, trust_remote_code),
                       lambda: LoadedModel(path, dtype, device, trust_remote_code))


# ---------------------------------------------------------------------------------------------------------
# The captioner
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Request:
    """One model input: an image, or a video as a list of frames, with its prompt."""

    item: int
    kind: str  # "image" | "video"
    media: Any  # PIL image or list of PIL images
    prompt: str | None
    provenance: dict[str, Any]


class TransformersCaptioner:
    """Captions from a Hugging Face vision-language model (see the module docstring)."""

    name = "transformers"

    def __init__(self, model: str, *, revision: str | None = None, prompts: list[str | None] | None = None,
                 max_new_tokens: int = 64, min_new_tokens: int = 0, num_beams: int = 1,
                 generate_kwargs: dict[str, Any] | None = None, batch_size: int = 8, dtype: str = "auto",
                 device: str = "auto", frames: int = 8, trust_remote_code: bool = False,
                 background: tuple[int, int, int] = pixels.WHITE):
        self.model_id = model
        self.background = tuple(background)
        self.revision = revision
        self.prompts = list(prompts) if prompts else [None]
        self.generation = {"max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens,
                           "num_beams": num_beams, "do_sample": False, **(generate_kwargs or {})}
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = device
        self.frames = frames
        self.trust_remote_code = trust_remote_code
        self._batches: list[int] = []
        self._seconds = 0.0
        self._loaded: LoadedModel | None = None
        self._fingerprint: str | None = None

    def fingerprint(self) -> dict[str, Any]:
        # The model counts by content (config, weights, tokenizer, processor files), not by where it lives or
        # its name; batch_size and device are left out: they change how fast captions come, not what they say.
        return {"captioner": self.name, "version": 1,
                "model_fingerprint": model_fingerprint(self.model_id, self.revision), "prompts": self.prompts,
                "generation": self.generation, "dtype": self.dtype, "frames": self.frames,
                "trust_remote_code": self.trust_remote_code,
                "pixels": {"rules": pixels.RULES_VERSION, "background": list(self.background)}}

    def stats(self) -> dict[str, Any]:
        loaded = self._loaded
        return {"model": self.model_id, "device": str(loaded.device) if loaded else None,
                "generate_calls": len(self._batches), "batch_sizes": self._batches,
                "generated": sum(self._batches), "generate_seconds": round(self._seconds, 3)}

    def load(self) -> LoadedModel:
        """The model and processor (loaded on first use, then shared by every captioner in the process)."""
        if self._loaded is None:
            device = resolve_device(self.device)
            path = resolve_model(self.model_id, self.revision)
            self._fingerprint = model_fingerprint(self.model_id, self.revision)
            self._loaded = get_model(path, self._fingerprint, resolve_dtype(self.dtype, device), device,
                                     self.trust_remote_code)
        return self._loaded

    def _prompt(self, loaded: LoadedModel, prompt: str | None, kind: str) -> str | None:
        if prompt is not None:
            return prompt
        if loaded.chat:
            return DEFAULT_INSTRUCTION.format(media=kind)
        return DEFAULT_TASK_PROMPTS.get(loaded.model_type)

    def _provenance(self, loaded: LoadedModel, prompt: str | None) -> dict[str, Any]:
        prov = {"captioner": self.name, "model": self.model_id, "model_fingerprint": self._fingerprint,
                "model_class": loaded.class_name, "prompt": prompt, "generation": self.generation,
                "dtype": str(loaded.dtype).removeprefix("torch.")}
        if self.revision:
            prov["revision"] = self.revision
        return prov

    def caption(self, items: list[CaptionItem]) -> list[CaptionResult]:
        loaded = self.load()
        results = [CaptionResult() for _ in items]
        requests: list[_Request] = []
        for i, item in enumerate(items):
            try:
                kind, images, indices = load_media(item.sample, item.meta, self.frames, loaded.max_side,
                                                     self.background)
            except Exception as err:  # any decoder error: this sample's media is unusable, not the model
                results[i].error = f"cannot decode media: {type(err).__name__}: {err}"
                continue
            for prompt in self.prompts:
                text = self._prompt(loaded, prompt, kind)
                prov = self._provenance(loaded, text)
                if kind == "image":
                    requests.append(_Request(i, "image", images[0], text, prov))
                elif loaded.video:
                    requests.append(_Request(i, "video", images, text,
                                             {**prov, "frames": indices, "video_input": "video"}))
                else:
                    # An image-only model captions each frame; the middle frame's caption comes first.
                    middle = len(images) // 2
                    for f in [middle] + [f for f in range(len(images)) if f != middle]:
                        requests.append(_Request(i, "image", images[f], text,
                                                 {**prov, "frames": indices, "frame": indices[f],
                                                  "video_input": "frames"}))
        for request, text in zip(requests, self._generate_all(loaded, requests)):
            results[request.item].texts.append(text)
            results[request.item].provenance.append(request.provenance)
        return results

    def _generate_all(self, loaded: LoadedModel, requests: list[_Request]) -> list[str]:
        """Texts for every request, in order, in batches of one media kind and prompt."""
        texts: list[str | None] = [None] * len(requests)
        groups: dict[tuple[str, str | None], list[int]] = {}
        for n, request in enumerate(requests):
            groups.setdefault((request.kind, request.prompt), []).append(n)
        for (kind, prompt), members in groups.items():
            size, start = self.batch_size, 0
            while start < len(members):
                chunk = members[start : start + size]
                try:
                    out = self._generate(loaded, kind, prompt, [requests[n].media for n in chunk])
                except Exception as err:
                    if size == 1 or not _is_oom(err):
                        raise
                    _free_cuda()
                    size = max(1, size // 2)
                    continue
                for n, text in zip(chunk, out):
                    texts[n] = text
                start += len(chunk)
        return texts  # type: ignore[return-value]

    def _generate(self, loaded: LoadedModel, kind: str, prompt: str | None, media: list[Any]) -> list[str]:
        import torch

        inputs = self._inputs(loaded, kind, prompt, media)
        inputs = {k: (v.to(loaded.device, loaded.dtype) if v.is_floating_point() else v.to(loaded.device))
                  if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        start = time.perf_counter()
        with loaded.lock, torch.inference_mode():
            # Seeded from the inputs: sampling (generate_kwargs do_sample=true) is reproducible too.
            torch.manual_seed(int(stable_hash([prompt, len(media)])[:8], 16))
            out = loaded.model.generate(**inputs, **self._generate_kwargs())
        self._seconds += time.perf_counter() - start
        self._batches.append(len(media))
        new = out[:, self._echo_length(loaded, out, inputs.get("input_ids")):]
        decoded = loaded.processor.batch_decode(new.cpu(), skip_special_tokens=True)
        return [text.strip() for text in decoded]

    def _generate_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.generation)
        if not kwargs.get("min_new_tokens"):
            kwargs.pop("min_new_tokens", None)
        return kwargs

    def _inputs(self, loaded: LoadedModel, kind: str, prompt: str | None, media: list[Any]) -> dict[str, Any]:
        processor = loaded.processor
        if loaded.chat:
            content = [{"type": kind}, {"type": "text", "text": prompt or ""}]
            text = processor.apply_chat_template([{"role": "user", "content": content}],
                                                 add_generation_prompt=True, tokenize=False)
            media_key = "videos" if kind == "video" else "images"
            return dict(processor(text=[text] * len(media), **{media_key: media}, padding=True,
                                  return_tensors="pt"))
        kwargs: dict[str, Any] = {"images": media, "return_tensors": "pt"}
        if prompt:
            kwargs["text"] = [prompt] * len(media)
        return dict(processor(**kwargs))

    @staticmethod
    def _echo_length(loaded: LoadedModel, out: Any, input_ids: Any) -> int:
        """How many leading output tokens repeat the prompt rather than continue it."""
        if loaded.model_type == "blip":
            # BLIP decodes from its bos token followed by the prompt without its final [SEP].
            return 1 if input_ids is None else input_ids.shape[1] - 1
        if input_ids is None or loaded.encoder_decoder:
            return 0
        n = input_ids.shape[1]
        prefix = out[:, :n].to(input_ids.device)
        return n if out.shape[1] >= n and bool((prefix == input_ids).all()) else 0


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _free_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

