"""What the curate stage decodes: a sample it cannot decode is quarantined there, and a transparent picture is
scored on its opaque pixels (not on the background it is composited over)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from latentmill.stages import bucket, caption, curate, curate_scores, ingest, pixels
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.caption import CaptionConfig
from latentmill.stages.curate import CurateConfig
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir, stage_report
from latentmill.stages.tarshard import read_shard
from PIL import Image

from latentmill.core.hashing import stable_hash
from tests.conftest import DEMO_IMAGES


def _stage(module, cfg, root: Path, units, process) -> tuple[StageDir, list]:
    sd = StageDir(root, module.STAGE).ensure()
    records = [sd.run_unit(u, lambda unit, out: process(unit, out)) for u in units]
    sd.write_manifest(records, {"fingerprint": "test"})
    return sd, records


def _four_stages(images: Path, root: Path, curate_cfg: CurateConfig) -> dict[str, tuple[StageDir, list]]:
    """Ingest, caption, curate and bucket over ``images``, in this process: each stage's folder and records."""
    ing_cfg, cap_cfg, bkt_cfg = IngestConfig(source=str(images), shard_size=4), CaptionConfig(), BucketConfig()
    stages = {"ingest": _stage(ingest, ing_cfg, root / "ingest", ingest.plan(ing_cfg),
                               lambda u, o: ingest.process(ing_cfg, u, o))}
    up = stages["ingest"][0]
    stages["caption"] = _stage(caption, cap_cfg, root / "caption", caption.plan(cap_cfg, up),
                               lambda u, o: caption.process(cap_cfg, u, o))
    up = stages["caption"][0]
    stages["curate"] = _stage(curate, curate_cfg, root / "curate", curate.plan(curate_cfg, up),
                              lambda u, o: curate.process(curate_cfg, u, o))
    up = stages["curate"][0]
    stages["bucket"] = _stage(bucket, bkt_cfg, root / "bucket", bucket.plan(bkt_cfg, up),
                              lambda u, o: bucket.process(bkt_cfg, u, o))
    return stages


def _sources(sd: StageDir) -> set[str]:
    manifest = sd.read_manifest()
    return {json.loads(s["json"])["source"] for shard in manifest["shards"]
            for s in read_shard(sd.root / shard["path"])}


def test_a_picture_curate_cannot_decode_is_quarantined_there(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name in ("img_000.png", "img_001.jpg", "img_002.jpg", "truncated.jpg"):
        shutil.copy(DEMO_IMAGES / name, images / name)
        shutil.copy((DEMO_IMAGES / name).with_suffix(".txt"), images / Path(name).with_suffix(".txt").name)
    stages = _four_stages(images, tmp_path / "prep", CurateConfig())
    # ingest reads headers only: the truncated JPEG's header is whole, so it passes ingest and caption
    assert "truncated.jpg" in _sources(stages["caption"][0])
    curate_dir, records = stages["curate"]
    (entry,) = [q for r in records for q in r.quarantined]
    assert (entry["source"], entry["stage"]) == ("truncated.jpg", "curate")
    assert entry["reason"].startswith("cannot decode pixels: OSError: image file is truncated")
    assert curate_dir.read_manifest()["counts"] == {"in": 4, "out": 3, "quarantined": 1}
    report = curate.report(records)
    assert (report["scored"], report["unscored"]) == (3, 1)
    assert report["quarantined_by_reason"] == {entry["reason"]: 1}
    # never reaches the bucket stage (nor, so, the cache): every stage's counts conserve
    assert _sources(stages["bucket"][0]) == {"img_000.png", "img_001.jpg", "img_002.jpg"}
    for name, (sd, stage_records) in stages.items():
        counts = sd.read_manifest()["counts"]
        assert counts["in"] == counts["out"] + counts["quarantined"], name
        stage_report(name, stage_records, 0.0)  # raises when they do not
    assert stages["bucket"][0].read_manifest()["counts"] == {"in": 3, "out": 3, "quarantined": 0}


# ---------------------------------------------------------------------------------------------------------
# Transparency: scored on the opaque pixels


def _subject(size: int = 40) -> np.ndarray:
    """A mid-grey subject with some texture (greys 96..160, no pixel clipped): a checkerboard of 4-px cells."""
    yy, xx = np.mgrid[:size, :size]
    return np.where((yy // 4 + xx // 4) % 2 == 0, 96, 160).astype(np.uint8)


def _cutout(mode: str, under: int = 0) -> bytes:
    """A 96x80 PNG: the subject at (20, 24), opaque, on a fully transparent background whose colour
    channels hold ``under`` (what a transparent pixel hides varies between editors)."""
    grey_HW = np.full((80, 96), under, np.uint8)
    alpha_HW = np.zeros((80, 96), np.uint8)
    grey_HW[24:64, 20:60], alpha_HW[24:64, 20:60] = _subject(), 255
    if mode == "LA":
        img = Image.fromarray(np.stack([grey_HW, alpha_HW], -1), "LA")
    else:
        img = Image.fromarray(np.stack([grey_HW, grey_HW, grey_HW, alpha_HW], -1), "RGBA")
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _meta(data: bytes) -> dict:
    """What ingest records of an image (its decoding facts: ``alpha``...)."""
    return {"kind": "image", "sha256": hashlib.sha256(data).hexdigest(), **pixels.header(pixels.open_image(data))}


@pytest.mark.parametrize("mode, under", [("RGBA", 0), ("RGBA", 255), ("LA", 0)])
def test_a_transparent_cutout_is_scored_on_its_opaque_pixels(mode, under):
    data = _cutout(mode, under)
    meta = _meta(data)
    assert meta["alpha"] is True
    cfg = CurateConfig()
    scores = curate.score_media({"image": data}, meta, cfg, ["sharpness", "exposure"])
    # exactly the scores of the subject alone, as an opaque picture: whatever the background or the hidden colour
    alone = curate_scores.score_frames([Image.fromarray(_subject())], ["sharpness", "exposure"])
    assert scores == alone
    assert scores["exposure"] == 0.0 and scores["sharpness"] > 1000
    # what it scored before: composited over white, 79% of the picture was blown out
    shown = curate_scores.score_frames([pixels.decode_rgb(data)], ["exposure"])
    assert shown["exposure"] == pytest.approx(1 - 40 * 40 / (96 * 80))
    for background in ((0, 0, 0), (255, 255, 255), (30, 200, 90)):
        assert curate.score_media({"image": data}, meta, cfg, ["sharpness", "exposure"], background) == alone


def test_the_stage_keeps_a_cutout_that_max_exposure_dropped(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "cutout.png").write_bytes(_cutout("RGBA"))
    Image.new("RGB", (96, 80), (255, 255, 255)).save(images / "white.png")  # blown out, as shown and scored
    for name in ("cutout", "white"):
        (images / f"{name}.txt").write_text(f"a {name}\n")
    stages = _four_stages(images, tmp_path / "prep", CurateConfig(max_exposure=0.5))
    curate_dir, records = stages["curate"]
    assert {q["source"] for r in records for q in r.quarantined} == {"white.png"}
    row = next(row for r in records for row in curate_dir.unit_detail(r)["scores"].values()
               if row["source"] == "cutout.png")
    assert row["values"]["exposure"] == 0.0
    assert _sources(stages["bucket"][0]) == {"cutout.png"}


def test_an_opaque_image_scores_and_keys_as_before():
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (70, 90, 3), dtype=np.uint8), "RGB")
    cfg = CurateConfig()
    names = ["sharpness", "exposure"]
    before = curate_scores.score_frames([rgb], names)  # the pixels scored as they always were: every one
    for img in (rgb, rgb.convert("RGBA")):  # an alpha channel that is opaque everywhere changes nothing
        data = _png(img)
        assert curate.score_media({"image": data}, _meta(data), cfg, names) == before
    # an opaque image's score keys are those of before the rule: its stored scores stay valid
    fp = curate.scorer_fingerprint(cfg, "exposure", pixels.WHITE)
    meta = _meta(_png(rgb))
    assert meta["alpha"] is False
    assert curate_scores.score_key(fp, meta) == stable_hash({"scorer": fp, "sha256": meta["sha256"], "clip": None})
    cut = _meta(_cutout("RGBA"))
    assert curate_scores.score_key(fp, cut) == stable_hash({"scorer": fp, "sha256": cut["sha256"], "clip": None,
                                                     "opaque": curate_scores.OPAQUE_ALPHA})
    for scorer in ("sharpness", "exposure", "aesthetic"):  # the fast keyer agrees, opaque part or not
        scorer_fp = {**fp, "scorer": scorer}
        for m in (meta, cut):
            assert curate_scores.ScoreKeyer(scorer_fp)(m) == curate_scores.score_key(scorer_fp, m)
    assert curate_scores.score_key({**fp, "scorer": "aesthetic"}, cut) == stable_hash(
        {"scorer": {**fp, "scorer": "aesthetic"}, "sha256": cut["sha256"], "clip": None})  # a model sees it shown


def test_sharpness_and_exposure_on_a_mask():
    g = np.asarray(_subject(12), np.float64)
    everywhere = np.ones_like(g, bool)
    assert curate_scores.sharpness(g, everywhere) == curate_scores.sharpness(g)
    assert curate_scores.exposure(g, everywhere) == curate_scores.exposure(g)
    left = np.zeros_like(g, bool)
    left[:, :6] = True  # the stencil fits in columns 1..4: the interior of the 12x6 left half
    assert curate_scores.sharpness(g, left) == curate_scores.sharpness(g[:, :6])
    g[0, 0] = 255.0
    assert curate_scores.exposure(g, left) == 1 / 72
    assert curate_scores.sharpness(g, np.zeros_like(g, bool)) == 0.0
    assert curate_scores.opaque_mask(Image.new("L", (4, 4), 255)) is None  # all opaque: every pixel, as before
    assert curate_scores.opaque_mask(Image.new("L", (4, 4), 0)) is None  # all transparent: scored as shown
