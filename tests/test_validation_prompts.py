"""Validation prompts encoded at prep (issue 34, item 3): the grid from cached embeddings is the pipeline's own, a
training run with validation loads no text encoder, a changed prompt list encodes only its new prompts."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from diffusers import ModelMixin
from latentmill.stages import cache
from latentmill.stages.cache_config import CacheConfig
from latentmill.stages.shardio import StageDir
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.validation import Validator, cached_prompts
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig
from tests.trainer_helpers import add_validation_prompts, torch_threads, write_fake_cache

PROMPTS = ["a red square", "a blue circle on a green field"]  # two lengths: a masked batch pads one of them

pytestmark = pytest.mark.slow  # tiny models built, pipelines run


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture()
def loads(monkeypatch) -> Counter:
    """Class name -> ``from_pretrained`` calls of Transformers / Diffusers models and tokenizers (each a real load)."""
    counts: Counter = Counter()
    for base in (PreTrainedModel, ModelMixin, PreTrainedTokenizerBase):
        original = base.__dict__["from_pretrained"].__func__

        def counting(cls, *args, _original=original, **kwargs):
            counts[cls.__name__] += 1
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(base, "from_pretrained", classmethod(counting))
    return counts


def _prep_prompts(tmp_path, pretrained: str, family: str, prompts: list[str]) -> tuple[dict, StageDir]:
    """The cache stage's manifest header with ``prompts`` (and the family's negative) encoded, float32."""
    stage_dir = StageDir(tmp_path / "cache", "cache").ensure()
    cfg = CacheConfig(dtype="float32", max_sequence_length=16, device="cpu")
    texts = [*prompts, get_adapter(family).negative_prompt]
    header = cache.manifest_header(cfg, ModelConfig(pretrained=pretrained), stage_dir, [], prompts=texts)
    return header, stage_dir


@pytest.mark.parametrize("family, fixture, size", [
    ("flux", "tiny_flux", [32, 48]),
    ("wan", "tiny_wan", [32, 32, 5]),  # classifier-free guidance against the cached empty prompt
    pytest.param("qwen-image", "tiny_qwen_image", [32, 32], marks=pytest.mark.heavy),  # a masked stream, padded to
    # the longer prompt; true CFG on " " (heavy: a third family beside FLUX.1 and Wan)
    pytest.param("z-image", "tiny_zimage", [32, 32], marks=pytest.mark.heavy),  # a list of each prompt's tokens
    pytest.param("flux2-klein", "tiny_flux2_klein", [32, 32], marks=pytest.mark.heavy),
    pytest.param("hunyuanvideo1.5", "tiny_hunyuan_video15", [32, 32, 5], marks=pytest.mark.heavy),  # two streams
])
def test_grid_from_cached_embeddings_is_the_pipelines_own(request, family, fixture, size, tmp_path):
    pretrained = str(request.getfixturevalue(fixture))
    adapter = get_adapter(family)
    header, stage_dir = _prep_prompts(tmp_path, pretrained, family, PROMPTS)
    prompts = cached_prompts(header, stage_dir.root, [*PROMPTS, adapter.negative_prompt], "here")
    transformer = adapter.diffusers_class(adapter.transformer_class).from_pretrained(pretrained, subfolder="transformer")
    cfg = TrainerConfig(validation_prompts=PROMPTS, validation_steps=2, validation_size=size, validation_seed=3,
                        guidance_scale=3.5)

    cached = Validator(adapter, pretrained, "cpu", prompts=prompts)
    grid = np.asarray(Image.open(cached.run(transformer, cfg=cfg, step=1, train_dir=tmp_path / "c",
                                            max_sequence_length=16)))
    text_parts = {n: c for n, c in cached.pipe.components.items() if n.startswith(("text_encoder", "tokenizer"))}
    assert text_parts and set(text_parts.values()) == {None}  # the pipeline was built without any

    own = Validator(adapter, pretrained, "cpu")  # the pipeline's own text encoders, prompt=
    reference = np.asarray(Image.open(own.run(transformer, cfg=cfg, step=1, train_dir=tmp_path / "o",
                                              max_sequence_length=16)))
    assert grid.shape == reference.shape and grid.shape[0] == 2 * size[1]
    assert np.array_equal(grid, reference)  # bit for bit: every pixel of every prompt


@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory, tiny_flux):
    root = tmp_path_factory.mktemp("valprompts-cache")
    write_fake_cache(root, {(32, 32, 1): 4}, seq_len=16, smooth=True)
    # stored in bf16 as a default cache stores text: validation hands them to the float32 CPU model as float32
    add_validation_prompts(root, str(tiny_flux), ["a cat"], max_sequence_length=16, dtype="bfloat16")
    return root


def test_training_with_validation_loads_no_text_encoder(tiny_flux, fake_cache, loads, tmp_path):
    cfg = TrainerConfig(max_steps=2, batch_size=2, save_every=0, export=False, validate_every=2,
                        validation_prompts=["a cat"], validation_steps=1, validation_size=[32, 32])
    loads.clear()
    summary = train(cfg, cache_dir=fake_cache, pretrained=str(tiny_flux), train_dir=tmp_path / "t", progress=False)
    assert len(summary["validation"]) == 1
    # the trained transformer, and validation's VAE: no CLIP, T5 or tokenizer
    assert dict(loads) == {"FluxTransformer2DModel": 1, "AutoencoderKL": 1}


def test_prompts_missing_from_the_snapshot_say_to_rerun_prep(tiny_flux, fake_cache, tmp_path):
    cfg = TrainerConfig(max_steps=1, batch_size=2, save_every=0, export=False, validate_every=1,
                        validation_prompts=["a cat", "a dog"], validation_steps=1, validation_size=[32, 32])
    with pytest.raises(ConfigError, match=r"^trainer.validation_prompts: .* no embeddings of 'a dog' .*re-run "
                                          r"`latentmill prep`"):
        train(cfg, cache_dir=fake_cache, pretrained=str(tiny_flux), train_dir=tmp_path / "t", progress=False)
    manifest = json.loads((fake_cache / "manifest.json").read_text())
    del manifest["validation_prompts"]  # a snapshot made before the prep encoded them
    with pytest.raises(ConfigError, match=r"no embeddings of 'a cat' and 1 more"):
        cached_prompts(manifest, fake_cache, ["a cat", "a dog"], "old")


def _prep(root, tiny_flux, prompts: list[str]):
    """A prep of the demo images in this process, with ``prompts`` as the recipe's validation prompts."""
    from latentmill.stages.bucket import BucketConfig
    from latentmill.stages.curate import CurateConfig
    from latentmill.stages.ingest import IngestConfig

    from latentmill.recipe import Recipe
    from tests.conftest import DEMO_IMAGES
    from tests.helpers import prep_in_process

    recipe = Recipe(output_dir=str(root), model=ModelConfig(pretrained=str(tiny_flux)),
                    ingest=IngestConfig(source=str(DEMO_IMAGES), shard_size=8), curate=CurateConfig(max_exposure=0.5),
                    bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]),
                    cache=CacheConfig(dtype="float32", max_sequence_length=16),
                    trainer=TrainerConfig(validation_prompts=prompts))
    return prep_in_process(recipe)["cache"]


def test_a_changed_prompt_list_encodes_only_its_new_prompts_and_reuses_every_unit(tiny_flux, tmp_path):
    from latentmill.pipelines.snapshot import publish

    stage_dir, first, records = _prep(tmp_path, tiny_flux, ["a cat", "a dog"])
    one = publish(tmp_path, stage_dir.root)
    entry = first["validation_prompts"]
    assert sorted(entry["keys"]) == ["", "a cat", "a dog"]  # the flux family's negative: the empty prompt
    text = cache.component_report(records)["components"]["text"]
    assert text["processed"] > 0
    # mark the stored "a cat": a copy keeps the mark, an encode would not
    path = stage_dir.root / entry["path"]
    tensors = load_file(path)
    cat = entry["keys"]["a cat"]
    tensors[f"{cat}.pooled_prompt_embeds"] = torch.full_like(tensors[f"{cat}.pooled_prompt_embeds"], 7.0)
    save_file(tensors, path)

    _, second, records = _prep(tmp_path, tiny_flux, ["a cat", "a bird"])
    assert all(r.reused for r in records)  # every cache unit, captions and latents alike
    assert cache.component_report(records)["components"]["text"] == {"processed": 0, "reused": sum(text.values())}
    new = second["validation_prompts"]
    assert new["path"] != entry["path"] and new["keys"]["a cat"] == cat
    stored = load_file(stage_dir.root / new["path"])
    assert sorted({k.split(".")[0] for k in stored}) == sorted({cat, new["keys"]["a bird"], new["keys"][""]})
    assert bool((stored[f"{cat}.pooled_prompt_embeds"] == 7.0).all())  # copied, not encoded again
    # the new prompt is what a prep of it alone stores
    alone, _ = _prep_prompts(tmp_path / "alone", str(tiny_flux), "flux", ["a bird"])
    bird = load_file(tmp_path / "alone" / "cache" / alone["validation_prompts"]["path"])
    bird_key = new["keys"]["a bird"]
    assert {k: v for k, v in bird.items() if k.startswith(bird_key)}.keys() == \
        {k for k in stored if k.startswith(bird_key)}
    for name in bird:
        if name.startswith(bird_key):
            torch.testing.assert_close(stored[name], bird[name], rtol=0, atol=1e-6)
    # a new snapshot of the same shards, whose manifest names the new prompts' file (read from the snapshot's folder)
    two = publish(tmp_path, stage_dir.root)
    assert two["new"] and two["name"] != one["name"]
    snapshot = json.loads((tmp_path / "snapshots" / two["name"] / "manifest.json").read_text())
    assert snapshot["shards"] == json.loads((tmp_path / "snapshots" / one["name"] / "manifest.json").read_text())["shards"]
    read = cached_prompts(snapshot, tmp_path / "snapshots" / two["name"], ["a cat", "a bird", ""], "new")
    assert bool((read.streams["a cat"]["pooled_prompt_embeds"] == 7.0).all())
    assert torch.equal(read.streams["a bird"]["prompt_embeds"], stored[f"{bird_key}.prompt_embeds"])
    # nothing but the prompts' entry differs between the two manifests
    assert second["stage_fingerprint"] == first["stage_fingerprint"]
    assert {k: v for k, v in second.items() if k not in ("validation_prompts", "units", "created")} == \
        {k: v for k, v in first.items() if k not in ("validation_prompts", "units", "created")}
