"""The curate stage's model scorers (aesthetic, clip_score) on a tiny CLIP built offline and loaded by folder
through the real from_pretrained path, a LAION-layout head in safetensors, and the video motion score."""

from __future__ import annotations

import io
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from latentmill.stages import curate, curate_models, curate_scores
from latentmill.stages.shardio import sample_json
from latentmill.stages.tarshard import read_shard
from PIL import Image

from latentmill.core.config import ConfigError
from latentmill.tiny_clip import TINY_CLIP, build_tiny_clip, build_tiny_siglip, save_head
from tests.test_curate import _image_folder, _prep, checkerboard


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny CLIPModel folder (seed 0) and a LAION-layout head of its projection size (seed 1)."""
    root = tmp_path_factory.mktemp("scorers")
    folder = build_tiny_clip(root / "tiny-clip", seed=0)
    return folder, save_head(root / "head.safetensors", TINY_CLIP["projection_dim"], seed=1)


def _cfg(tiny_clip, **kw) -> curate.CurateConfig:
    folder, head = tiny_clip
    cfg = curate.CurateConfig(aesthetic_model=str(folder), aesthetic_head=str(head),
                              scorers=["sharpness", "aesthetic", "clip_score"], **kw)
    cfg.validate()
    return cfg


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _pictures() -> list[Image.Image]:
    rng = np.random.RandomState(0)
    noise = Image.fromarray(rng.randint(0, 256, (60, 90, 3), np.uint8))
    board = checkerboard(64, 8, ((200, 20, 20), (20, 20, 200)))
    return [board, noise, Image.new("RGB", (50, 40), (30, 160, 90))]


class LaionMLP(torch.nn.Module):
    """The LAION improved-aesthetic-predictor v2 module, as its repository writes it (inference only)."""

    def __init__(self, input_size: int):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(input_size, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
            torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16),
            torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.layers(x)


def test_scores_equal_a_direct_forward_and_are_deterministic(tiny_clip):
    from safetensors.torch import load_file
    from transformers import CLIPModel, CLIPProcessor

    cfg = _cfg(tiny_clip, batch_size=2)
    pictures, captions = _pictures(), ["a red and blue board", "noise", "a green square"]
    samples = [({"png": _png(p), "txt": c.encode()}, {"kind": "image"}) for p, c in zip(pictures, captions)]
    curate_models.release_models()
    before = dict(curate_models.FORWARDS)
    # one sample at a time, then all three batched through the unit path's function (2 per forward)
    single = [curate.score_media(s, m, cfg, ["aesthetic", "clip_score"]) for s, m in samples]
    assert curate_models.FORWARDS["image"] - before["image"] == 3
    batched = curate_models.model_scores(cfg, [[p] for p in pictures], captions,
                                         [["aesthetic", "clip_score"]] * 3)
    assert curate_models.FORWARDS["image"] - before["image"] == 3 + 2  # ceil(3 / batch_size 2)
    assert curate_models.FORWARDS["text"] - before["text"] == 3 + 2
    curate_models.release_models()
    again = [curate.score_media(s, m, cfg, ["aesthetic", "clip_score"]) for s, m in samples]
    assert again == single  # reloaded from the folder: the same values, bit for bit

    # The reference: the model and processor loaded directly, the LAION module with the head's state dict.
    folder, head = tiny_clip
    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    mlp = LaionMLP(TINY_CLIP["projection_dim"]).eval()
    mlp.load_state_dict(load_file(str(head)))  # strict: the head's key names are LAION's
    with torch.no_grad():
        inputs = processor(images=pictures, text=captions, padding=True, return_tensors="pt")
        image = torch.nn.functional.normalize(model.get_image_features(pixel_values=inputs["pixel_values"])
                                              .pooler_output, dim=-1)
        text = torch.nn.functional.normalize(model.get_text_features(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).pooler_output, dim=-1)
        aesthetic = mlp(image)[:, 0].numpy()
        clip_score = 100 * (image * text).sum(-1).numpy()
    for got in (single, batched):
        assert max(abs(g["aesthetic"] - a) for g, a in zip(got, aesthetic)) < 1e-5
        assert max(abs(g["clip_score"] - c) for g, c in zip(got, clip_score)) < 1e-4
    assert len({round(s["aesthetic"], 6) for s in single}) == 3  # the pictures score apart

    # the embeddings near-duplicate search uses: normalised rows, a video is its frames' normalised mean
    rows = curate_models.image_embeddings(cfg, [[pictures[0]], pictures[1:]])
    assert rows.shape == (2, TINY_CLIP["projection_dim"]) and rows.dtype == np.float32
    assert np.allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-6)
    mean = image[1:].mean(0)
    assert np.abs(rows[1] - (mean / mean.norm()).numpy()).max() < 1e-5


@pytest.mark.slow  # builds a tiny SigLIP
def test_siglip_folder_loads_through_auto_model_and_scores_as_a_direct_forward(tmp_path):
    from transformers import AutoProcessor, SiglipModel

    folder = build_tiny_siglip(tmp_path / "tiny-siglip", seed=0)
    width = TINY_CLIP["vision_config"]["hidden_size"]  # SigLIP: the pooled vision output, no projection
    head = save_head(tmp_path / "head.safetensors", width, seed=3)
    cfg = _cfg((folder, head))
    pictures, captions = _pictures(), ["a board", "noise", "a green square"]
    got = curate_models.model_scores(cfg, [[p] for p in pictures], captions, [["aesthetic", "clip_score"]] * 3)
    assert curate_models.get_model(cfg, str(folder)).model_type == "siglip"
    model, processor = SiglipModel.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)
    with torch.no_grad():
        image = torch.nn.functional.normalize(model.get_image_features(
            **processor(images=pictures, return_tensors="pt")).pooler_output, dim=-1)
        tokens = processor.tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt")
        text = torch.nn.functional.normalize(model.get_text_features(input_ids=tokens["input_ids"])
                                             .pooler_output, dim=-1)
    head_scores = curate_models.AestheticHead(str(head), width)(image.numpy())
    assert max(abs(g["aesthetic"] - a) for g, a in zip(got, head_scores)) < 1e-5
    assert max(abs(g["clip_score"] - c) for g, c in zip(got, 100 * (image * text).sum(-1).numpy())) < 1e-4


def test_model_scores_are_keyed_by_the_model_and_the_caption(tiny_clip, tmp_path):
    cfg = _cfg(tiny_clip)
    white = (255, 255, 255)
    meta = {"sha256": "ab" * 32}
    fp = {name: curate.scorer_fingerprint(cfg, name, white)
          for name in ("aesthetic", "clip_score", "sharpness")}
    assert fp["aesthetic"]["model"] == fp["clip_score"]["model"]  # clip_model defaults to aesthetic_model
    other = build_tiny_clip(tmp_path / "other-clip", seed=1)
    cfg2 = _cfg((other, tiny_clip[1]))
    for name in ("aesthetic", "clip_score"):  # other weights: other keys
        other_key = curate_scores.score_key(curate.scorer_fingerprint(cfg2, name, white), meta)
        assert other_key != curate_scores.score_key(fp[name], meta)
    head2 = save_head(tmp_path / "head2.safetensors", TINY_CLIP["projection_dim"], seed=2)
    cfg3 = _cfg((tiny_clip[0], head2))
    assert curate.scorer_fingerprint(cfg3, "aesthetic", white) != fp["aesthetic"]
    assert curate.scorer_fingerprint(cfg3, "clip_score", white) == fp["clip_score"]  # the head is not its
    cat, dog = (curate_scores.score_key(fp["clip_score"], meta, text) for text in ("a cat", "a dog"))
    assert cat != dog
    # a model-free run's keys are what they were before model scorers existed (no decode_side in them)
    plain = curate.CurateConfig()
    assert curate.scorer_fingerprint(plain, "sharpness", white) == {
        "scorer": "sharpness", "version": 1, "side": 256, "frames": 4, "background": [255, 255, 255]}
    assert fp["sharpness"]["decode_side"] == 448


def test_head_that_does_not_fit_the_model_fails_naming_both(tiny_clip, tmp_path):
    folder, _ = tiny_clip
    wrong = save_head(tmp_path / "laion-l14.safetensors", 8)  # made for 8-dim embeddings, the model gives 16
    with pytest.raises(ConfigError, match=r"curate.aesthetic_head: .*laion-l14.safetensors takes 8-dim "
                                          r"embeddings, but curate.aesthetic_model .* gives 16-dim ones"):
        curate.CurateConfig(aesthetic_model=str(folder), aesthetic_head=str(wrong),
                            min_aesthetic=5).validate()
    with pytest.raises(ValueError, match=r"layers.0.weight has shape \(1024, 8\) .* takes 8 inputs, but the "
                                         r"image model .* gives 16-dim embeddings"):
        curate_models.AestheticHead(str(wrong), 16, str(folder))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(1, 16)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a LAION-layout head"):
        curate_models.AestheticHead(str(tmp_path / "other.safetensors"), 16)
    with pytest.raises(ConfigError, match="curate.aesthetic_model: the aesthetic scorer"):
        curate.CurateConfig(min_aesthetic=5).validate()
    with pytest.raises(ConfigError, match="curate.clip_model: the clip_score scorer"):
        curate.CurateConfig(scorers=["clip_score"]).validate()
    with pytest.raises(ConfigError, match="curate.max_motion: grey levels >= 0"):
        curate.CurateConfig(max_motion=-1).validate()


def _video(path: Path, frames_FHWC: np.ndarray) -> Path:
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(8))
        stream.height, stream.width = frames_FHWC.shape[1:3]
        stream.pix_fmt, stream.options = "yuv420p", {"threads": "1", "crf": "18"}
        for frame in frames_FHWC:
            image = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            for packet in stream.encode(image):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def moving_board(frames: int = 16, side: int = 64, step: int = 3) -> np.ndarray:
    """A checkerboard panning right by ``step`` pixels a frame."""
    board = np.asarray(checkerboard(side + frames * step, 8))
    return np.stack([board[:side, i * step:i * step + side] for i in range(frames)])


MOTION_CUT = 5.0  # grey levels: above every still video's codec noise, below the panning board's motion


def test_motion_of_a_still_and_a_moving_video_and_none_for_an_image(tmp_path):
    still = _video(tmp_path / "still.mp4", np.stack([np.asarray(checkerboard(64, 8))] * 16))
    moving = _video(tmp_path / "moving.mp4", moving_board())
    cfg = curate.CurateConfig(scorers=["sharpness", "motion"], max_motion=MOTION_CUT)
    cfg.validate()
    scores = {p.stem: curate.score_media({"json": b"{}"}, {"kind": "video", "source_uri": str(p)}, cfg,
                                         ["sharpness", "motion"]) for p in (still, moving)}
    assert scores["still"]["motion"] < 1.0 < MOTION_CUT < scores["moving"]["motion"]
    # the same frames by hand: mean |difference| of consecutive grey frames among the K = 4 read
    from latentmill.stages.captioners.media import load_media

    _, frames, _ = load_media({"json": b"{}"}, {"kind": "video", "source_uri": str(moving)}, 4, 256)
    greys = [np.asarray(f.convert("L"), np.float64) for f in frames]
    assert scores["moving"]["motion"] == pytest.approx(np.mean([np.abs(b - a).mean()
                                                                for a, b in zip(greys, greys[1:])]))
    image = curate.score_media({"png": _png(checkerboard())}, {"kind": "image"}, cfg, ["sharpness", "motion"])
    assert set(image) == {"sharpness"}  # an image has no motion score (absent, not 0)


@pytest.mark.slow
def test_prep_with_model_scorers_thresholds_and_no_recompute(tmp_path, tiny_flux, tiny_clip):
    import pyarrow.parquet as pq

    folder, head = tiny_clip
    images = _image_folder(tmp_path / "images")
    out = tmp_path / "out"
    models = [f"curate.aesthetic_model={folder}", f"curate.aesthetic_head={head}", "curate.batch_size=4",
              "curate.scorers=[sharpness, exposure, aesthetic, clip_score, motion]"]
    curate_models.release_models()
    start = curate_models.FORWARDS["image"]
    first = _prep(out, images, tiny_flux, *models)
    assert curate_models.FORWARDS["image"] > start
    table = {Path(r["source"]).name: r for r in pq.read_table(out / "prep" / "scores.parquet").to_pylist()}
    assert len(table) == 7  # every picture is scored (the all-white one is beyond the demo's max_exposure)
    assert all(r["motion"] is None for r in table.values())  # pictures: no motion (null, not 0)
    # the values are those of the scorer run on the sample alone, from the sample the stage read
    caption_dir, caption_manifest, _ = first["caption"]
    upstream = {Path(sample_json(s)["source"]).name: s for shard in caption_manifest["shards"]
                for s in read_shard(caption_dir.root / shard["path"])}
    cfg = _cfg(tiny_clip)
    for name in ("sharp_0.png", "blurred_1.png"):
        direct = curate.score_media(upstream[name], sample_json(upstream[name]), cfg,
                                    ["aesthetic", "clip_score"])
        assert table[name]["aesthetic"] == pytest.approx(direct["aesthetic"], abs=1e-6)
        assert table[name]["clip_score"] == pytest.approx(direct["clip_score"], abs=1e-5)

    # A threshold between the scores: the samples below it are quarantined with the reason and their
    # scores, and no model runs (nor is loaded).
    values = sorted(r["aesthetic"] for r in table.values())
    bound = round((values[2] + values[3]) / 2, 6)
    below = {n for n, r in table.items() if r["aesthetic"] < bound}
    assert len(below) == 3
    from latentmill.pipelines.prep import release_prep_models

    assert release_prep_models() >= 2 and curate_models.release_models() == 0  # model and head dropped
    calls = dict(curate_models.FORWARDS)
    second = _prep(out, images, tiny_flux, *models, f"curate.min_aesthetic={bound}")
    assert curate_models.FORWARDS == calls and curate_models.release_models() == 0
    report = curate.report(second["curate"][2])
    assert report["scored"] == 0 and report["scores_reused"] == 7
    quarantined = {Path(q["source"]).name: q for r in second["curate"][2] for q in r.quarantined}
    assert {n for n, q in quarantined.items() if "aesthetic" in q["reason"]} == below
    for name in below:
        assert f"aesthetic beyond curate.min_aesthetic={bound:g}" in quarantined[name]["reason"]
        assert quarantined[name]["scores"]["aesthetic"] == pytest.approx(table[name]["aesthetic"], abs=1e-6)
        assert "motion" not in quarantined[name]["scores"]
    assert second["cache"][1]["counts"]["out"] == 7 - len(below | {"white.png"})
    kept = [json.loads(s["json"]) for shard in second["curate"][1]["shards"]
            for s in read_shard(out / "prep" / "curate" / shard["path"])]
    assert all(m["scores"]["aesthetic"] >= bound and "clip_score" in m["scores"] for m in kept)


def test_a_video_scores_the_mean_over_its_frames(tiny_clip, tmp_path):
    from latentmill.stages.captioners.media import load_media

    video = _video(tmp_path / "moving.mp4", moving_board())
    cfg = _cfg(tiny_clip, frames=3)
    meta = {"kind": "video", "source_uri": str(video)}
    scores = curate.score_media({"json": b"{}", "txt": b"a moving board"}, meta, cfg,
                                ["aesthetic", "clip_score", "motion"])
    assert scores["motion"] > MOTION_CUT
    # the K = 3 frames the stage read (at the model decode side), scored one by one as images
    _, frames, _ = load_media({"json": b"{}"}, meta, 3, cfg.decode_side())
    per_frame = curate_models.model_scores(cfg, [[f] for f in frames], ["a moving board"] * 3,
                                           [["aesthetic", "clip_score"]] * 3)
    for name in ("aesthetic", "clip_score"):
        values = [s[name] for s in per_frame]
        assert len(set(values)) == 3  # the frames differ
        assert scores[name] == pytest.approx(np.mean(values), abs=1e-5)


@pytest.mark.slow
def test_near_duplicates_use_the_aesthetic_models_embeddings(tmp_path, tiny_flux, tiny_clip):
    """With ``aesthetic`` on, near-duplicate search embeds with that model (the issue's rule), not with the
    pixel thumbnail: the stored embeddings are the model's (its width, equal to a direct forward), and a
    JPEG copy of a picture is dropped as a near duplicate of it while the distinct pictures stay."""
    from latentmill.stages import neardup

    folder, head = tiny_clip
    images = _image_folder(tmp_path / "images")
    buf = io.BytesIO()
    Image.open(images / "sharp_1.png").convert("RGB").save(buf, format="JPEG", quality=95)
    (images / "zz_copy_sharp_1.jpg").write_bytes(buf.getvalue())
    (images / "zz_copy_sharp_1.txt").write_text("a copy\n")
    cfg = _cfg(tiny_clip)
    # the threshold between the copy's cosine and the closest pair of different pictures, from the model
    names = sorted(p.name for p in images.iterdir() if p.suffix != ".txt")
    frames = {n: curate.decode_frames({"png" if n.endswith("png") else "jpg": (images / n).read_bytes()},
                                      {"kind": "image"}, cfg) for n in names}
    vectors = dict(zip(names, curate_models.image_embeddings(cfg, [frames[n] for n in names])))
    copy = float(vectors["sharp_1.png"] @ vectors["zz_copy_sharp_1.jpg"])
    others = max(float(vectors[a] @ vectors[b]) for a in names for b in names
                 if a < b and {a, b} != {"sharp_1.png", "zz_copy_sharp_1.jpg"})
    assert copy > others
    bound = round((copy + others) / 2, 6)
    out = tmp_path / "out"
    result = _prep(out, images, tiny_flux, f"curate.aesthetic_model={folder}", f"curate.aesthetic_head={head}",
                   "curate.scorers=[sharpness, exposure, aesthetic]", f"curate.dedup_threshold={bound}")
    near = {Path(q["source"]).name: q for r in result["bucket"][2] for q in r.quarantined
            if q["reason"] == neardup.REASON}
    keys = {Path(sample_json(s)["source"]).name: s["__key__"] for shard in result["curate"][1]["shards"]
            for s in read_shard(out / "prep" / "curate" / shard["path"])}
    # the pair's higher aesthetic score is kept (the documented rule), the other is its near duplicate
    curate_dir = result["curate"][0]
    aesthetic = {Path(row["source"]).name: row["values"]["aesthetic"] for r in result["curate"][2]
                 for row in curate_dir.unit_detail(r)["scores"].values()}
    pair = ["sharp_1.png", "zz_copy_sharp_1.jpg"]
    kept, dropped = sorted(pair, key=lambda n: -aesthetic[n])
    assert aesthetic[kept] != aesthetic[dropped]
    assert set(near) == {dropped} and near[dropped]["duplicate_of"] == keys[kept]
    assert near[dropped]["cosine"] == pytest.approx(copy, abs=1e-4)
    # the stored embeddings are the model's: its width, the values of a direct forward
    written = [r.extra["embeddings"] for r in result["curate"][2] if r.extra.get("embeddings")]
    stored = np.concatenate([np.load(out / "prep" / "curate" / w["file"]) for w in written])
    order = [k for w in written for k in w["keys"]]
    assert stored.shape == (len(keys), curate_models.embedding_model(cfg).embed_dim)  # the kept samples
    assert stored.shape[1] != neardup.THUMB_SIDE ** 2 * 3
    by_name = {n: stored[order.index(keys[n])] for n in names if n in keys}
    assert max(float(np.abs(by_name[n] - vectors[n]).max()) for n in by_name) < 1e-5
