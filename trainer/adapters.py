"""The model families the trainer knows, by the ``family`` name of the cache manifest.

Adding a family (SD3, HunyuanVideo, LTX...) is one module with a ``latentmill.trainer.adapter.ModelAdapter`` subclass
and one line here; the training loop does not change.
"""

from __future__ import annotations

from latentmill.trainer.adapter import ModelAdapter
from latentmill.trainer.flux import FluxAdapter
from latentmill.trainer.flux2 import Flux2Adapter, Flux2KleinAdapter
from latentmill.trainer.hunyuan_video15 import HunyuanVideo15Adapter
from latentmill.trainer.hunyuan_video15_i2v import HunyuanVideo15I2VAdapter
from latentmill.trainer.ltx2 import LTX2Adapter
from latentmill.trainer.qwen_image import QwenImageAdapter, QwenImageEditAdapter
from latentmill.trainer.wan import WanAdapter
from latentmill.trainer.wan21_i2v import WanI2VAdapter
from latentmill.trainer.wan22_i2v import WanI2VA14BAdapter
from latentmill.trainer.wan22_ti2v import WanTI2VAdapter
from latentmill.trainer.zimage import ZImageAdapter

from latentmill.core.config import ConfigError

ADAPTERS: dict[str, type[ModelAdapter]] = {"flux": FluxAdapter, "wan": WanAdapter, "z-image": ZImageAdapter,
                                            "qwen-image": QwenImageAdapter, "qwen-image-edit": QwenImageEditAdapter,
                                            "flux2": Flux2Adapter,
                                            "flux2-klein": Flux2KleinAdapter}
ADAPTERS["wan2.2-ti2v"] = WanTI2VAdapter
ADAPTERS["wan2.1-i2v"] = WanI2VAdapter
ADAPTERS["wan2.2-i2v"] = WanI2VA14BAdapter
ADAPTERS["hunyuanvideo1.5"] = HunyuanVideo15Adapter
ADAPTERS["hunyuanvideo1.5-i2v"] = HunyuanVideo15I2VAdapter
ADAPTERS["ltx2"] = LTX2Adapter


def get_adapter(family: str) -> ModelAdapter:
    """The adapter of ``family`` (``flux`` | ``wan`` | ``flux2`` | ``flux2-klein``); ``ValueError`` lists the known families otherwise."""
    try:
        return ADAPTERS[family]()
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(sorted(ADAPTERS))}") from None


def check_i2v(i2v_probability: float, family: str) -> None:
    """A ConfigError when ``trainer.i2v_probability`` asks for image-to-video of a family that cannot do it."""
    if i2v_probability > 0 and not get_adapter(family).first_frame_conditioning:
        able = sorted(f for f, cls in ADAPTERS.items() if cls.first_frame_conditioning)
        raise ConfigError(f"trainer.i2v_probability: {i2v_probability}, but family {family!r} does not condition on "
                          f"a first-frame image; set it to 0, or train one of {', '.join(able)}")


def check_validation(validate_every: int, family: str) -> None:
    """A ConfigError when ``trainer.validate_every`` asks for samples that ``family`` cannot draw from prompts."""
    if validate_every and not get_adapter(family).validates_from_prompts:
        raise ConfigError(f"trainer.validate_every: {validate_every}, but the {family} family samples from a source "
                          "image, which validation prompts do not give; set trainer.validate_every: 0 (sample the "
                          "export with its pipeline and an image instead)")
