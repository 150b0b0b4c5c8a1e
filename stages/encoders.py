"""What a model family declares for the cache: its streams, and the encoders that fill them.

A cached sample is a set of named tensors, the family's *streams*. Each stream comes from one component of
the cache (``vae``: computed from the sample's pixels, stored in ``<key>.vae.safetensors``; ``text``:
computed from one caption, stored in ``<key>.text[.j].safetensors``), has a shape rule, a normalisation and
a padding rule, and is recorded in the cache manifest (``docs/cache-format.md``, "Streams"). The trainer
reads streams by name: a family's adapter names the streams its forward takes.

A family is one subclass of :class:`Encoders` in its own module (``stages/family_<name>.py``) (its streams, the
components it caches, how it encodes) plus one line in ``latentmill.stages.families.FAMILIES``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Literal

import torch

from latentmill.models import ModelConfig, component_source, tokenizer_source

# How a text stream's token axis is stored and batched:
#   keep:  every position the tokenizer padded to is stored (the model saw the padding: FLUX.1's T5);
#   zeros: the real tokens may be stored alone (``cache.trim_text``); the loader zero-pads to ``pad_to``,
#          which is what the pipeline feeds (Wan);
#   mask:  as ``zeros``, and the loader adds a ``<name>_mask`` column [B, pad_to] (bool, True on real tokens)
#          for a model that takes an attention mask.
Pad = Literal["none", "keep", "zeros", "mask"]


@dataclass(frozen=True)
class Stream:
    """One named tensor of a cached sample, as the manifest records it."""

    name: str  # the tensor's name in its member, and the batch column the trainer reads
    component: Literal["vae", "text"]  # vae: from the pixels; text: from one caption
    shape: str  # the shape of one sample, in the cache format's words: "[C, H/8, W/8]", "[L, D]"
    normalisation: str = ""  # what was applied to the encoder's output, as a formula over the config's names
    pad: Pad = "none"  # the token axis of a text stream (see ``Pad``); "none" for a tensor without one
    # a vae stream of an edit pair's source image (the sample's ``reference``, ingest.edit), encoded like the
    # target's ``latents`` (the distribution's mean) at the target's bucket
    from_reference: bool = False
    # a token stream's own padded length, whatever text.pad_to (cache.max_sequence_length): the pipeline's fixed
    # cap of a second encoder (HunyuanVideo 1.5's 256 ByT5 glyph tokens); None: text.pad_to
    pad_to: int | None = None
    # a vae stream computed by ``Encoders.encode_audio`` from the clip's sound (the source video's audio under the
    # clip's frames, stages/audio.py; silence without an audio track) and frame rate
    from_audio: bool = False

    def to_json(self) -> dict[str, Any]:
        # pad_to only where a family sets it: the other families' manifests stay as they were
        return {k: v for k, v in asdict(self).items() if k != "pad_to" or v is not None}


class Encoders(ABC):
    """A family's encoders for the cache stage, over unmodified Diffusers / Transformers components.

    Subclasses set the class attributes and implement ``__init__`` (load), :meth:`encode_pixels` and
    :meth:`encode_text`; the classmethods read configs only (no weights) and serve planning and manifests.
    """

    name: ClassVar[str]  # the family's id (``model.family``)
    PIPELINES: ClassVar[tuple[str, ...]]  # model_index.json ``_class_name`` values that mean this family
    # model_index.json values that tell this family from another of the same pipeline class (a missing key
    # reads as null): Wan 2.2 TI2V is a WanPipeline with ``expand_timesteps: true``
    PIPELINE_CONFIG: ClassVar[dict[str, Any]] = {}
    COMPONENTS: ClassVar[tuple[str, ...]]  # the components whose weights decide the cached streams
    # those of them whose weights decide the vae member (the streams computed from pixels): their fingerprints
    # key it, the others' the text members
    PIXEL_COMPONENTS: ClassVar[tuple[str, ...]] = ("vae",)
    STREAMS: ClassVar[tuple[Stream, ...]]
    # (module, class) pairs the encoders are built from: imported ahead by the CLI (import_encoder_classes)
    CLASS_IMPORTS: ClassVar[tuple[tuple[str, str], ...]] = ()
    VAE_FLOAT32: ClassVar[bool] = False  # the VAE runs in float32 even on a GPU
    # bucket sizes must be multiples of this many pixels: the VAE's spatial factor x the transformer's patch
    PIXEL_MULTIPLE: ClassVar[int] = 16
    # a video family's clip lengths are FRAME_STEP·k + 1 frames (its causal VAE's temporal compression: frame 0
    # alone, then FRAME_STEP frames per latent frame); None: an image family
    FRAME_STEP: ClassVar[int | None] = None
    # the text encoder sees the edit pair's source image: encode_text gets ``images`` (PIL, one per caption)
    # and a text component is keyed by the caption and that image's bytes
    TEXT_SEES_REFERENCE: ClassVar[bool] = False
    # the VAE's own temporal tiles (frames per tile, stride), which ``cache.vae_tiling`` turns on for longer clips;
    # None: the VAE has none (the key is then a no-op)
    VAE_TEMPORAL_TILE: ClassVar[tuple[int, int] | None] = None

    def __init__(self, model: ModelConfig, device: torch.device):
        self.model = model
        self.device = device
        self.compute_dtype = self.compute_dtypes(device)["text"]  # (and the VAE's, unless VAE_FLOAT32)
        self.lock = threading.Lock()  # one forward at a time per loaded model set
        self.audio_sample_rate: int | None = None  # with ``from_audio`` streams: the rate encode_audio takes
        self.vae_tiling = "auto"  # ``cache.vae_tiling``, which the cache stage sets from its recipe

    # --- declared without weights --------------------------------------------------------------------

    @classmethod
    def compute_dtypes(cls, device: torch.device) -> dict[str, torch.dtype]:
        """The dtype the ``vae`` and the ``text`` encoders run in on ``device``: bf16 on GPU, float32 on CPU
        (CPU bf16 matmuls are slow and less exact), the VAE in float32 everywhere with ``VAE_FLOAT32``."""
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"vae": torch.float32 if cls.VAE_FLOAT32 else dtype, "text": dtype}

    @classmethod
    def streams(cls, component: str | None = None) -> tuple[Stream, ...]:
        """The family's streams, or those of one component."""
        return tuple(s for s in cls.STREAMS if component is None or s.component == component)

    @classmethod
    def needs_reference(cls) -> bool:
        """Whether the family trains on edit pairs (a stream, or its text encoder, takes the source image)."""
        return cls.TEXT_SEES_REFERENCE or any(s.from_reference for s in cls.STREAMS)

    @classmethod
    def needs_audio(cls) -> bool:
        """Whether the family caches each clip's sound (a ``from_audio`` stream)."""
        return any(s.from_audio for s in cls.STREAMS)

    @classmethod
    def text_pad(cls) -> Pad:
        """The padding rule of the family's token-axis text stream ("keep" when it has none)."""
        return next((s.pad for s in cls.STREAMS if s.component == "text" and s.pad != "none"), "keep")

    @classmethod
    def tiles_clip(cls, frames: int, vae_tiling: str) -> bool:
        """Whether a clip of ``frames`` frames is encoded in the VAE's temporal tiles under ``cache.vae_tiling``:
        with ``auto``, a clip longer than one tile (a tile's frames plus the first, which the next tile shares); a
        clip of at most one tile is encoded whole, with the bytes it had before the key."""
        tile = cls.VAE_TEMPORAL_TILE
        return vae_tiling == "auto" and tile is not None and frames > tile[0] + 1

    @classmethod
    def describe_vae(cls, vae_config: dict[str, Any]) -> dict[str, Any]:
        """The VAE normalisation constants the manifest records beside the VAE's class and fingerprint."""
        return {}

    @classmethod
    @abstractmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        """Each stream's shape for one sample of ``bucket`` ``[W, H(, F)]`` with one caption at
        ``max_sequence_length`` tokens, from the components' configs (``config(name)``; {} when a component
        is not on this machine: use the real model's defaults). Only estimates shard bytes."""

    # --- with weights ---------------------------------------------------------------------------------

    def _load(self, cls, name: str, dtype: torch.dtype | None = None):
        src = component_source(self.model, name)
        module = cls.from_pretrained(src.path, **src.kwargs(), torch_dtype=dtype or self.compute_dtype)
        return module.to(self.device).eval()

    def _tokenizer(self, encoder: str):
        from transformers import AutoTokenizer

        src = tokenizer_source(self.model, encoder)
        return AutoTokenizer.from_pretrained(src.path, **src.kwargs())

    @abstractmethod
    def encode_pixels(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the normalised latent distribution of a batch of pixels in [-1, 1] (images
        [B, 3, H, W], clips [B, 3, F, H, W]): the ``vae`` stream named ``latents``, float32, on the CPU."""

    def encode_conditions(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The family's other ``vae`` streams of a batch of pixels (as :meth:`encode_pixels` takes them), by
        name, batch first, float32, on the CPU: conditioning computed from the pixels (Wan 2.1 I2V's first
        frame); none by default."""
        return {}

    def encode_audio(self, waveforms_BCN: torch.Tensor, frame_rates_B: torch.Tensor) -> dict[str, torch.Tensor]:
        """The family's ``from_audio`` streams of a batch of clips' sound (``[B, 2, N]`` float32 at
        ``audio_sample_rate``) and frame rates (``[B]``, frames per second), by name, batch first, float32, on
        the CPU; none by default."""
        return {}

    @abstractmethod
    def encode_text(self, captions: list[str], max_sequence_length: int, images: list | None = None) -> dict[str, Any]:
        """The ``text`` streams of ``captions`` (float32, on the CPU, batch first) and ``lengths``: per
        caption, its real token count (the stored length of a trimmed ``zeros`` / ``mask`` stream); a second
        token stream whose count differs gives its own as ``<name>_lengths``.
        ``images``: with ``TEXT_SEES_REFERENCE``, each caption's source image (PIL RGB, as ingested)."""
