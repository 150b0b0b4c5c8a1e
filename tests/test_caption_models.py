"""The transformers captioner on a tiny random BLIP (built from config, loaded with from_pretrained):
images, video clips (K frames), provenance, batch sizes, policies, and re-captioning only what changed."""

from __future__ import annotations

import hashlib
import io
import json
import shutil

import numpy as np
import pytest
from latentmill.pipelines.prep import STAGES
from latentmill.stages import cache, caption, ingest
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache import CacheConfig
from latentmill.stages.caption import CaptionConfig
from latentmill.stages.captioners.media import sample_frames, sample_frames_with_indices
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir, WorkUnit, stage_report
from latentmill.stages.tarshard import read_shard

from latentmill.core.fingerprints import ComponentSource, component_fingerprint
from latentmill.core.hashing import json_bytes
from latentmill.models import ModelConfig
from latentmill.recipe import Recipe
from tests.helpers import prep_in_process

N_IMAGES = 6


def _blip_cfg(model, **kw) -> CaptionConfig:
    defaults = dict(captioner="transformers", model=str(model), policy="replace", max_new_tokens=6,
                    min_new_tokens=3, batch_size=3)
    return CaptionConfig(**{**defaults, **kw})


def _caption(cfg, upstream, root):
    sd = StageDir(root, "caption").ensure()
    records = [sd.run_unit(u, lambda unit, out: caption.process(cfg, unit, out)) for u in caption.plan(cfg, upstream)]
    manifest = sd.write_manifest(records, caption.manifest_header(cfg))
    metas = {}
    for shard in manifest["shards"]:
        for s in read_shard(sd.root / shard["path"]):
            meta = json.loads(s["json"])
            assert s["txt"].decode() == meta["caption"] == meta["captions"][0]
            metas[meta["source"]] = meta
    return records, metas, manifest


@pytest.fixture(scope="module")
def few_images(tmp_path_factory):
    """Six demo images (img_004 without its caption) and truncated.jpg, ingested in shards of 4."""
    from tests.conftest import DEMO_IMAGES

    root = tmp_path_factory.mktemp("few")
    src = root / "images"
    src.mkdir()
    for i in range(N_IMAGES):
        for path in DEMO_IMAGES.glob(f"img_{i:03d}.*"):
            shutil.copy(path, src / path.name)
    shutil.copy(DEMO_IMAGES / "truncated.jpg", src)
    (src / "img_004.txt").unlink()
    cfg = IngestConfig(source=str(src), shard_size=4)
    sd = StageDir(root / "ingest", "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg)]
    sd.write_manifest(records, {"fingerprint": "test"})
    return src, sd


# --------------------------------------------------------------------------------------------------------
# The tiny model


def test_tiny_blip_is_reproducible_and_loads_like_a_hub_model(tiny_blip, tmp_path):
    from latentmill.stages.captioners.hf import model_class
    from transformers import AutoConfig, AutoProcessor, BlipForConditionalGeneration, BlipProcessor

    from latentmill.tiny_captioner import build_tiny_captioner

    again = build_tiny_captioner(tmp_path / "again", seed=0)
    files = sorted(p.name for p in tiny_blip.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (tiny_blip / name).read_bytes() == (again / name).read_bytes(), name
    assert isinstance(AutoProcessor.from_pretrained(tiny_blip), BlipProcessor)
    assert model_class(AutoConfig.from_pretrained(tiny_blip), False) is BlipForConditionalGeneration


def test_tiny_captioner_recipe_errors_name_the_key(tmp_path):
    from latentmill.tiny_captioner import DEFAULT_RECIPE_PATH, load_recipe
    from tests.helpers import assert_recipe_refused

    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["model"]["text_config"].update(encoder_hidden_size=48),
                          r"model.text_config.encoder_hidden_size: 48 != model.vision_config")
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["model"]["text_config"].update(vocab_size=10),
                          "model.text_config.vocab_size: set from the tokenizer")


# --------------------------------------------------------------------------------------------------------
# Images


def test_captions_images_with_provenance_and_batch_size(tiny_blip, few_images, tmp_path):
    _, upstream = few_images
    cfg = _blip_cfg(tiny_blip, prompt=[None, "a picture of"])
    records, metas, manifest = _caption(cfg, upstream, tmp_path / "a")

    assert manifest["counts"] == {"in": N_IMAGES + 1, "out": N_IMAGES, "quarantined": 1}
    (q,) = [q for r in records for q in r.quarantined]
    assert q["source"] == "truncated.jpg" and "cannot decode media: OSError" in q["reason"]
    fp = component_fingerprint(ComponentSource(str(tiny_blip), None))
    assert manifest["captioner"]["model_fingerprint"] == fp and manifest["captioner"]["model"] == str(tiny_blip)
    # The model counts by content: the same files elsewhere key the same units.
    moved = shutil.copytree(tiny_blip, tmp_path / "elsewhere")
    assert [u.unit_id for u in caption.plan(_blip_cfg(moved, prompt=[None, "a picture of"]), upstream)] == [
        r.unit_id for r in records]
    for meta in metas.values():
        assert len(meta["captions"]) == len(meta["caption_provenance"]) >= 1
        assert all(c.strip() for c in meta["captions"])
        prompts = [p.get("prompt") for p in meta["caption_provenance"]]
        assert set(prompts) <= {None, "a picture of"} and len(set(meta["captions"])) == len(meta["captions"])
        for prov in meta["caption_provenance"]:
            assert prov["captioner"] == "transformers" and prov["model"] == str(tiny_blip)
            assert prov["model_fingerprint"] == fp and prov["model_class"] == "BlipForConditionalGeneration"
            assert prov["generation"] == {"max_new_tokens": 6, "min_new_tokens": 3, "num_beams": 1,
                                          "do_sample": False}
            assert prov["dtype"] == "float32" and prov["policy"] == "replace"
        assert "captioned_at" not in json.dumps(meta)  # wall-clock time stays out of the shard bytes
    # Batch size: at most 3 inputs per generate call, one call per (prompt, <= 3 images); time in the record.
    for r in records:
        images = r.samples_in - (1 if any(q["source"] == "truncated.jpg" for q in r.quarantined) else 0)
        assert r.extra["generated"] == 2 * images == sum(r.extra["batch_sizes"])
        assert max(r.extra["batch_sizes"]) <= 3 and r.extra["device"] == "cpu"
        assert r.extra["captioned_at"].endswith("Z") and r.extra["generate_seconds"] >= 0

    # Deterministic: a fresh run writes the same bytes. The batch size is not in the fingerprint (it changes
    # speed, not captions), so a run with another batch size reuses these units.
    again, _, _ = _caption(cfg, upstream, tmp_path / "b")
    assert [s.sha256 for r in again for s in r.shards] == [s.sha256 for r in records for s in r.shards]
    one = _blip_cfg(tiny_blip, prompt=[None, "a picture of"], batch_size=1)
    assert [u.unit_id for u in caption.plan(one, upstream)] == [r.unit_id for r in records]


def test_policies_with_a_model(tiny_blip, few_images, tmp_path):
    src, upstream = few_images
    _, keep, _ = _caption(_blip_cfg(tiny_blip, policy="keep"), upstream, tmp_path / "keep")
    _, replace, _ = _caption(_blip_cfg(tiny_blip), upstream, tmp_path / "replace")
    _, append, _ = _caption(_blip_cfg(tiny_blip, policy="append", separator=" | "), upstream, tmp_path / "append")
    _, extend, _ = _caption(_blip_cfg(tiny_blip, policy="extend"), upstream, tmp_path / "extend")
    for name, meta in keep.items():
        sidecar = meta.get("sidecar_caption")
        generated = replace[name]["caption"]
        if name == "img_004.jpg":  # the one sample without a caption file gets a model caption
            assert sidecar is None and keep[name]["captions"] == [generated] == append[name]["captions"]
            assert keep[name]["caption_provenance"][0]["captioner"] == "transformers"
            continue
        assert sidecar == (src / name).with_suffix(".txt").read_text().strip()
        assert meta["captions"] == [sidecar] and meta["caption_provenance"][0]["captioner"] == "sidecar"
        assert append[name]["captions"] == [f"{sidecar} | {generated}"]
        assert append[name]["caption_provenance"][0]["appended_to"]["captioner"] == "sidecar"
        assert extend[name]["captions"] == [sidecar, generated]


# --------------------------------------------------------------------------------------------------------
# Video


def make_video(n_frames: int = 24, width: int = 64, height: int = 48, fmt: str = "mp4",
               codec: str = "mpeg4") -> bytes:
    """A small video whose frame i is a flat colour with red = 10 * i (so a frame's index can be read back)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.bit_rate = 2_000_000  # flat colours survive: frame colours stay within a few levels
        for i in range(n_frames):
            frame_HWC = np.zeros((height, width, 3), np.uint8)
            frame_HWC[..., 0], frame_HWC[..., 1] = 10 * i, 128
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_HWC, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("backend", ["decord", "pyav"])
@pytest.mark.parametrize("fmt, codec", [("mp4", "mpeg4"), ("webm", "libvpx")])
def test_sample_frames_reads_the_clip_window(backend, fmt, codec, tmp_path):
    data = make_video(fmt=fmt, codec=codec)
    frames, indices = sample_frames_with_indices(data, start_frame=4, num_frames=16, k=4, max_side=32,
                                                 backend=backend)
    assert indices == [6, 10, 14, 18]
    assert all(f.size == (32, 24) and f.mode == "RGB" for f in frames)
    reds = [np.asarray(f)[..., 0].mean() for f in frames]
    assert reds == pytest.approx([60, 100, 140, 180], abs=5)
    path = tmp_path / f"clip.{fmt}"
    path.write_bytes(data)  # paths work too; no window: the whole video
    assert len(sample_frames(path, k=3, backend=backend)) == 3


def _video_shard(root, samples):
    """A raw stage (as video ingest will write it) holding ``samples``: (name, video bytes, clip window)."""
    sd = StageDir(root, "ingest").ensure()

    def write(unit, out):
        for name, data, clip in samples:
            key = hashlib.sha256(name.encode()).hexdigest()[:16]
            meta = {"key": key, "source": name, "kind": "video", "sha256": hashlib.sha256(data).hexdigest(),
                    "width": 64, "height": 48, "sidecar_caption": None}
            if clip:
                meta["clip"] = clip
            out.add({"__key__": key, "mp4": data, "json": json_bytes(meta)})

    unit = WorkUnit("videos", ["videos"], {}, len(samples))
    sd.write_manifest([sd.run_unit(unit, write)], {"fingerprint": "test"})
    return sd


def test_captions_video_clips_from_k_frames(tiny_blip, tmp_path):
    video = make_video()
    upstream = _video_shard(tmp_path / "ingest", [
        ("clips/a.mp4", video, {"start_frame": 4, "num_frames": 16}),
        ("clips/b.mp4", video, None),
        ("clips/broken.mp4", video[: len(video) // 3], None),
    ])
    records, metas, manifest = _caption(_blip_cfg(tiny_blip, frames=4, batch_size=3), upstream, tmp_path / "c")
    assert manifest["counts"] == {"in": 3, "out": 2, "quarantined": 1}
    (q,) = records[0].quarantined
    assert q["source"] == "clips/broken.mp4" and "cannot decode media" in q["reason"]
    # An image-only model captions each of the K frames; the middle frame's caption is the primary one.
    a = metas["clips/a.mp4"]
    assert {p["video_input"] for p in a["caption_provenance"]} == {"frames"}
    assert all(p["frames"] == [6, 10, 14, 18] for p in a["caption_provenance"])
    assert a["caption_provenance"][0]["frame"] == 14
    assert all(p["frames"] == [3, 9, 15, 21] for p in metas["clips/b.mp4"]["caption_provenance"])
    assert records[0].extra["generated"] == 2 * 4 and max(records[0].extra["batch_sizes"]) <= 3


def test_captions_videos_from_ingest_references(tiny_blip, tmp_path):
    """Ingest keeps a video as a reference (source_uri); the captioner reads its frames from there."""
    src = tmp_path / "media"
    (src / "clips").mkdir(parents=True)
    (src / "clips" / "walk.mp4").write_bytes(make_video())
    (src / "clips" / "walk.txt").write_text("a person walking")
    cfg = IngestConfig(source=str(src), shard_size=4)
    upstream = StageDir(tmp_path / "ingest", "ingest").ensure()
    upstream.write_manifest([upstream.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out))
                             for u in ingest.plan(cfg)], {"fingerprint": "test"})
    _, metas, manifest = _caption(_blip_cfg(tiny_blip, frames=4, policy="extend"), upstream, tmp_path / "c")
    meta = metas["clips/walk.mp4"]
    assert meta["kind"] == "video" and meta["captions"][0] == "a person walking"
    assert meta["caption_provenance"][0]["captioner"] == "sidecar"
    generated = meta["caption_provenance"][1:]
    assert generated and all(p["frames"] == [3, 9, 15, 21] for p in generated)  # uniform over 24 frames


class _FakeVideoVLM:
    """Stands in for a chat VLM with a video processor (Qwen2-VL class needs torchvision for its video
    processor, which the test environment lacks): records what the captioner hands it."""

    def __init__(self):
        import threading

        import torch

        self.device, self.dtype, self.lock = torch.device("cpu"), torch.float32, threading.Lock()
        self.class_name, self.model_type, self.encoder_decoder = "FakeVideoVLM", "fake", False
        self.chat, self.video, self.max_side = True, True, 32
        self.calls: list[dict] = []
        self.processor, self.model = self, self

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return json.dumps(messages)

    def __call__(self, text, videos=None, images=None, padding=False, return_tensors=None):
        import torch

        self.calls.append({"text": text, "videos": videos, "images": images})
        return {"input_ids": torch.ones(len(text), 4, dtype=torch.long)}

    def generate(self, input_ids, **kwargs):
        import torch

        new = torch.arange(len(input_ids)).unsqueeze(1) + torch.tensor([[10, 20]])
        return torch.cat([input_ids, new], dim=1)  # echoes the prompt, like decoder-only models

    def batch_decode(self, ids, skip_special_tokens):
        return [" ".join(f"t{int(i)}" for i in row) for row in ids]


def test_video_vlms_get_the_frames_as_one_video(tiny_blip, tmp_path, monkeypatch):
    from latentmill.stages.captioners import hf

    fake = _FakeVideoVLM()
    monkeypatch.setattr(hf, "get_model", lambda *args: fake)
    video = make_video()
    upstream = _video_shard(tmp_path / "ingest", [(f"clips/{n}.mp4", video, None) for n in "abc"])
    records, metas, _ = _caption(_blip_cfg(tiny_blip, frames=4, batch_size=2), upstream, tmp_path / "c")
    assert [len(c["videos"]) for c in fake.calls] == [2, 1] and all(c["images"] is None for c in fake.calls)
    for call in fake.calls:
        for frames in call["videos"]:
            assert len(frames) == 4 and all(max(f.size) <= 32 for f in frames)
        (message,) = json.loads(call["text"][0])
        assert message["content"] == [{"type": "video"},
                                      {"type": "text", "text": "Describe this video in one or two sentences."}]
    assert metas["clips/b.mp4"]["captions"] == ["t11 t21"]  # the echoed prompt is cut off
    prov = metas["clips/b.mp4"]["caption_provenance"][0]
    assert prov["video_input"] == "video" and prov["frames"] == [3, 9, 15, 21] and "frame" not in prov
    assert records[0].extra["batch_sizes"] == [2, 1]


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    from latentmill.tiny_captioner import LLAVA_RECIPE_PATH, build_tiny_captioner

    return build_tiny_captioner(tmp_path_factory.mktemp("models") / "tiny-llava", LLAVA_RECIPE_PATH, seed=0)


def test_chat_vlm_captions_through_its_chat_template(tiny_llava, few_images, tmp_path):
    from latentmill.stages.captioners.hf import TransformersCaptioner
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    _, upstream = few_images
    cfg = _blip_cfg(tiny_llava, prompt="Describe the image.", max_new_tokens=8, min_new_tokens=4)
    records, metas, _ = _caption(cfg, upstream, tmp_path / "c")
    assert len(metas) == N_IMAGES and max(b for r in records for b in r.extra["batch_sizes"]) <= 3
    for meta in metas.values():
        (prov,) = meta["caption_provenance"]
        assert prov["model_class"] == "LlavaForConditionalGeneration" and prov["prompt"] == "Describe the image."
        assert meta["caption"] and "user" not in meta["caption"] and "Describe" not in meta["caption"]
    loaded = TransformersCaptioner(str(tiny_llava)).load()
    assert loaded.chat and not loaded.video and loaded.processor.tokenizer.padding_side == "left"

    # The caption is exactly what the model generates after the chat prompt, as a user would decode it.
    processor = AutoProcessor.from_pretrained(tiny_llava)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    from latentmill.stages.captioners.media import load_image

    src, _ = few_images
    inputs = processor(text=[text], images=[load_image((src / "img_001.jpg").read_bytes(), 32)],
                       return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=4, do_sample=False)
    expected = processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]
    assert metas["img_001.jpg"]["caption"] == " ".join(expected.split())


# --------------------------------------------------------------------------------------------------------
# End to end: changing the prompt re-captions, re-running does nothing


def _prep(recipe):
    """Run the four prep stages in this process; per-stage reports and unit ids, and the cache's records."""
    stages = prep_in_process(recipe)
    report = {name: stage_report(name, records, 0.0) for name, (_, _, records) in stages.items()}
    units = {name: sorted(r.unit_id for r in records) for name, (_, _, records) in stages.items()}
    report["cache"].update(cache.component_report(stages["cache"][2]))
    return report, units


def _captions(recipe, stage):
    sd = StageDir(recipe.stage_dir(stage), stage)
    return {json.loads(s["json"])["source"]: json.loads(s["json"])["caption"]
            for shard in sd.read_manifest()["shards"] for s in read_shard(sd.root / shard["path"])}


def test_changed_prompt_recaptions_and_rerun_reuses(tiny_flux, tiny_blip, few_images, tmp_path):
    src, _ = few_images

    def recipe(prompt):
        return Recipe(output_dir=str(tmp_path / "out"), model=ModelConfig(pretrained=str(tiny_flux)),
                      ingest=IngestConfig(source=str(src), shard_size=4),
                      # byte targets of 1: every shard its own unit and every sample its own downstream shard,
                      # so that a changed caption can be seen to re-run only the cache unit that holds it
                      caption=_blip_cfg(tiny_blip, policy="keep", prompt=prompt, shard_bytes=1),
                      bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333], shard_bytes=1),
                      cache=CacheConfig(dtype="float32", batch_size=4, max_sequence_length=16, shard_bytes=1))

    first, units_a = _prep(recipe("a picture of"))
    # truncated.jpg has no caption file: the model is asked, cannot decode it, and it is quarantined.
    assert first["caption"]["processed"] == N_IMAGES + 1 and first["caption"]["quarantined"] == 1
    captions_a = _captions(recipe("a picture of"), "caption")

    again, units_again = _prep(recipe("a picture of"))
    assert units_again == units_a
    for name in STAGES:
        assert again[name]["processed"] == 0 and again[name]["reused"] == again[name]["in"], name

    changed, units_b = _prep(recipe("a cartoon drawing of a"))
    assert changed["ingest"]["processed"] == 0
    assert changed["caption"]["processed"] == N_IMAGES + 1 and not set(units_b["caption"]) & set(units_a["caption"])
    captions_b = _captions(recipe("a cartoon drawing of a"), "caption")
    # Policy keep: only img_004 (no caption file) has a model caption, and only it changes with the prompt.
    assert {k for k in captions_a if captions_a[k] != captions_b[k]} == {"img_004.jpg"}
    assert _captions(recipe("a cartoon drawing of a"), "cache")["img_004.jpg"] == captions_b["img_004.jpg"]
    # Only the shard holding img_004 re-runs in the cache, and inside it only that caption is re-encoded.
    assert 0 < changed["cache"]["processed"] < changed["cache"]["in"]
    assert changed["cache"]["components"]["text"]["processed"] == 1
    assert changed["cache"]["components"]["vae"]["processed"] == 0
