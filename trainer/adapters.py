"""The model families the trainer knows, by the ``family`` name of the cache manifest.

Adding a family (SD3, HunyuanVideo, LTX...) is one module with a ``latentmill.trainer.adapter.ModelAdapter`` subclass
and one line here; the training loop does not change.
"""

from __future__ import annotations

from latentmill.trainer.adapter import ModelAdapter
from latentmill.trainer.flux import FluxAdapter
from latentmill.trainer.flux2 import Flux2Adapter, Flux2KleinAdapter
from latentmill.trainer.qwen_image import QwenImageAdapter, QwenImageEditAdapter
from latentmill.trainer.wan import WanAdapter
from latentmill.trainer.zimage import ZImageAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {"flux": FluxAdapter, "wan": WanAdapter, "z-image": ZImageAdapter,
                                            "qwen-image": QwenImageAdapter, "qwen-image-edit": QwenImageEditAdapter,
                                            "flux2": Flux2Adapter,
                                            "flux2-klein": Flux2KleinAdapter}


def get_adapter(family: str) -> ModelAdapter:
    """The adapter of ``family`` (``flux`` | ``wan`` | ``flux2`` | ``flux2-klein``); ``ValueError`` lists the known families otherwise."""
    try:
        return ADAPTERS[family]()
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(sorted(ADAPTERS))}") from None
