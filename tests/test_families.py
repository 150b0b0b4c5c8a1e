"""The family registry: every ``stages/family_<name>.py`` is registered, and what each family declares holds
together (its streams, components and pipelines), without loading a model."""

from __future__ import annotations

from latentmill.stages.encoders import Encoders, Stream
from latentmill.stages.families import FAMILIES, PIPELINE_FAMILIES, index_family

from latentmill.models import known_families


def test_every_family_module_is_registered_under_its_name():
    assert sorted(FAMILIES) == known_families()
    for name, cls in FAMILIES.items():
        assert issubclass(cls, Encoders) and cls.name == name
        assert cls.__module__ == "latentmill.stages.family_" + name.replace("-", "_").replace(".", "_")
        assert all(index_family({"_class_name": p, **cls.PIPELINE_CONFIG}) == name for p in cls.PIPELINES)


def test_each_family_declares_one_latents_stream_and_named_text_streams():
    for name, cls in FAMILIES.items():
        streams = cls.STREAMS
        assert all(isinstance(s, Stream) for s in streams)
        assert [s.name for s in streams if s.component == "vae"][0] == "latents", name
        assert len({s.name for s in streams}) == len(streams), f"{name}: a stream name twice"
        assert {s.pad for s in streams if s.component == "vae"} <= {"none"}, name
        assert "vae" in cls.COMPONENTS and any(c != "vae" for c in cls.COMPONENTS), name
        # the vae member's key covers every model its streams come from, and those are cached components
        assert cls.PIXEL_COMPONENTS[0] == "vae" and set(cls.PIXEL_COMPONENTS) <= set(cls.COMPONENTS), name


def test_the_byte_estimate_covers_every_stream():
    """``sample_shapes`` gives a shape for exactly the declared streams (the cache's byte estimate sums them),
    from the real model's defaults when no config is on this machine."""
    for name, cls in FAMILIES.items():
        shapes = cls.sample_shapes(lambda component: {}, [512, 512, 17], 128)
        assert set(shapes) == {s.name for s in cls.STREAMS}, name
        assert all(all(d > 0 for d in shape) for shape in shapes.values()), (name, shapes)


def test_a_masked_text_stream_cannot_be_stored_untrimmed(tmp_path):
    """``cache.trim_text: never`` would store padding that a mask stream's mask column calls real: refused
    when the cache is planned, naming the key (a family whose padding is kept or zeroed is not concerned)."""
    import json

    import pytest
    from latentmill.stages.cache import CacheConfig, CachePlan

    from latentmill.core.config import ConfigError
    from latentmill.models import ModelConfig

    masked = [p for p, f in PIPELINE_FAMILIES.items() if FAMILIES[f].text_pad() == "mask"]
    assert masked  # Qwen-Image, Z-Image
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": masked[0]}))
    with pytest.raises(ConfigError, match="cache.trim_text: 'never' stores the padding as tokens"):
        CachePlan.of(CacheConfig(trim_text="never"), ModelConfig(pretrained=str(tmp_path)))
