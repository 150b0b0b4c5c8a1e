"""Cache stage on the tiny Qwen-Image-Edit models: the cached streams of an edit pair are what
``QwenImageEditPipeline`` computes for the instruction and the source image.

* ``prompt_embeds``: ``encode_prompt(instruction, image=...)`` with the image ``__call__`` hands it (the source
  resized to ``calculate_dimensions(1024 * 1024, ratio)``), through the pipeline's own ``Qwen2VLProcessor``:
  the Edit template's 64-token prefix dropped, the source image's tokens kept;
* ``reference_latents``: ``prepare_latents``' image path (``_encode_vae_image``, ``argmax``: the mean,
  ``(z - mean) / std``) on the source image as the bucket crops it to the target's bucket;
* ``latents``: the target, as Qwen-Image's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache import CacheConfig, load_pixels
from latentmill.stages.families import FAMILIES, PIPELINE_FAMILIES
from latentmill.stages.ingest import REFERENCE_MEMBER, IngestConfig
from latentmill.stages.pixels import decode_rgb
from latentmill.stages.tarshard import read_shard
from PIL import Image
from safetensors.torch import load as load_tensors

from latentmill.models import ModelConfig
from latentmill.recipe import Recipe
from tests.helpers import prep_in_process, qwen2vl_processor

MAX_LEN = 64  # the source image's tokens (at most 16 + 2 markers), the instruction and the template's end


def write_pairs(folder: Path) -> list[str]:
    """Three edit pairs (sidecar layout) of three shapes; the sources' sizes differ from their targets'."""
    folder.mkdir(parents=True)
    instructions = ["invert the colours", "invert the colours and add a white mark", "add a mark"]
    for i, (size, colour) in enumerate([((96, 64), (200, 30, 30)), ((64, 96), (30, 160, 60)), ((80, 80), (40, 60, 200))]):
        target = Image.new("RGB", size, colour)
        target.paste((250, 250, 250), (8, 8, 24, 24))
        target.save(folder / f"p{i}.png")
        Image.new("RGB", (size[0] + 16 * i, size[1]), tuple(255 - c for c in colour)).save(folder / f"p{i}.src.png")
        (folder / f"p{i}.txt").write_text(instructions[i] + "\n")
    return instructions



@pytest.fixture(scope="module")
def cached(tiny_qwen_image_edit, tmp_path_factory):
    root = tmp_path_factory.mktemp("edit-prep")
    write_pairs(root / "pairs")
    model = ModelConfig(pretrained=str(tiny_qwen_image_edit))
    recipe = Recipe(output_dir=str(root / "out"), model=model, ingest=IngestConfig(source=str(root / "pairs"), edit=True),
                    bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]),
                    cache=CacheConfig(dtype="float32", batch_size=3, max_sequence_length=MAX_LEN))
    sd, manifest, _ = prep_in_process(recipe)["cache"]
    bucket_dir = sd.root.parent / "bucket"
    raw = {s["__key__"]: s for b in json.loads((bucket_dir / "manifest.json").read_text())["shards"]
           for s in read_shard(bucket_dir / b["path"])}
    samples = [(s, raw[s["__key__"]]) for shard in manifest["shards"] for s in read_shard(sd.root / shard["path"])]
    return model, manifest, samples


def test_family_is_registered_with_its_streams():
    family = FAMILIES["qwen-image-edit"]
    assert PIPELINE_FAMILIES["QwenImageEditPipeline"] == "qwen-image-edit"
    assert [(s.name, s.pad, s.from_reference) for s in family.STREAMS] == [
        ("latents", "none", False), ("prompt_embeds", "mask", False), ("reference_latents", "none", True)]
    assert family.TEXT_SEES_REFERENCE and family.needs_reference() and family.TEMPLATE_START_IDX == 64
    shapes = family.sample_shapes(lambda name: {}, [1024, 768], 2048)
    assert shapes == {"latents": (16, 96, 128), "reference_latents": (16, 96, 128), "prompt_embeds": (2048, 3584)}


@pytest.mark.slow
def test_cached_streams_equal_the_edit_pipelines(cached):
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    model, manifest, samples = cached
    assert manifest["family"] == "qwen-image-edit" and manifest["counts"] == {"in": 3, "out": 3, "quarantined": 0}
    assert [s["name"] for s in manifest["streams"]] == ["latents", "prompt_embeds", "reference_latents"]
    pipe = QwenImageEditPipeline.from_pretrained(model.pretrained, processor=qwen2vl_processor(model.pretrained))
    lengths = set()
    for sample, raw in samples:
        meta = json.loads(sample["json"])
        vae, text = load_tensors(sample["vae.safetensors"]), load_tensors(sample["text.safetensors"])
        # the text: the instruction and the source image as __call__ hands them to encode_prompt
        source = decode_rgb(raw[REFERENCE_MEMBER])
        width, height, _ = calculate_dimensions(1024 * 1024, source.size[0] / source.size[1])
        expected, mask = pipe.encode_prompt(meta["caption"], image=pipe.image_processor.resize(source, height, width))
        assert mask is None and expected.shape[1] == text["prompt_embeds"].shape[0] < MAX_LEN
        torch.testing.assert_close(text["prompt_embeds"], expected[0], atol=1e-5, rtol=1e-5)
        lengths.add(expected.shape[1])
        # the reference: prepare_latents' image path on the source as the bucket cropped it
        W, H = meta["bucket"][:2]
        pixels = load_pixels(raw[REFERENCE_MEMBER], meta[REFERENCE_MEMBER]["crop"], meta["bucket"])[None, :, None]
        with torch.no_grad():
            _, packed = pipe.prepare_latents(pixels, 1, 16, H, W, torch.float32, torch.device("cpu"),
                                             torch.Generator().manual_seed(0))
        unpacked = QwenImageEditPipeline._unpack_latents(packed, H, W, 8)[:, :, 0]
        assert vae["reference_latents"].shape == vae["latents"].shape == (16, H // 8, W // 8)
        torch.testing.assert_close(vae["reference_latents"], unpacked[0], atol=1e-5, rtol=1e-5)
        assert (vae["reference_latents"] - vae["latents"]).abs().mean() > 0.1  # the source, not the target
    assert len(lengths) == 3  # instructions of three lengths after the same number of image tokens


@pytest.mark.slow
def test_a_new_source_image_reencodes_the_text(tiny_qwen_image_edit, tmp_path):
    """The text encoder sees the source: one instruction with two sources gives two different streams."""
    from latentmill.stages.families import get_encoders

    encoders = get_encoders(ModelConfig(pretrained=str(tiny_qwen_image_edit)), "qwen-image-edit", torch.device("cpu"))
    images = [Image.new("RGB", (64, 64), (200, 0, 0)), Image.new("RGB", (64, 64), (0, 0, 200))]
    out = encoders.encode_text(["make it green"] * 2, MAX_LEN, images=images)
    assert out["lengths"][0] == out["lengths"][1]
    assert (out["prompt_embeds"][0] - out["prompt_embeds"][1]).abs().max() > 1e-3


@pytest.mark.slow
def test_tiny_set_is_reproducible_and_its_template_prefix_is_the_pipelines(tiny_qwen_image_edit, tmp_path):
    import hashlib

    from diffusers import QwenImageEditPipeline
    from latentmill.stages.family_qwen_image_edit import EDIT_TEMPLATE_START_IDX

    from latentmill.tiny_qwen_image import build_tiny_qwen_image_edit

    def hashes(folder: Path) -> dict[str, str]:
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    again = build_tiny_qwen_image_edit(tmp_path / "again", seed=0)
    assert hashes(again) == hashes(tiny_qwen_image_edit) and "processor/preprocessor_config.json" in hashes(again)
    pipe = QwenImageEditPipeline.from_pretrained(again, processor=None)
    assert EDIT_TEMPLATE_START_IDX == pipe.prompt_template_encode_start_idx == 64
    tokens = pipe.tokenizer.convert_ids_to_tokens(pipe.tokenizer(pipe.prompt_template_encode.format("x")).input_ids)
    # the real Qwen2.5-VL tokenizer's split: the dropped prefix ends with the user turn's header
    assert tokens[61:67] == ["<|im_start|>", "user", "Ċ", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    config = pipe.text_encoder.config
    assert config.image_token_id == pipe.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(pipe.tokenizer) == config.text_config.vocab_size == 1024
