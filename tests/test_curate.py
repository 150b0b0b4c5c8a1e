"""The curate stage: model-free scores, thresholds applied after scoring (a threshold change recomputes no
score and re-encodes no kept sample), exact duplicates across a refresh, counts, the scores table."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from latentmill.stages import cache, curate, curate_scores
from latentmill.stages.shardio import sample_json, stage_report
from latentmill.stages.tarshard import read_shard
from PIL import Image, ImageFilter

from latentmill.recipe import load_recipe
from tests.conftest import DEMO_CONFIG
from tests.helpers import prep_in_process

pytestmark = pytest.mark.slow

SHARP_BLURRED_CUT = 100.0  # between every blurred picture below (< 1) and every sharp one (> 300)
LOOSE = 0.1  # below every blurred picture (> 0.15)


def checkerboard(size: int = 96, cell: int = 8, colours=((0, 0, 0), (255, 255, 255))) -> Image.Image:
    """A ``size``² checkerboard of ``cell``-pixel squares in two colours."""
    yy, xx = np.mgrid[:size, :size]
    board = ((yy // cell + xx // cell) % 2).astype(bool)
    rgb = np.empty((size, size, 3), np.uint8)
    rgb[~board], rgb[board] = colours[0], colours[1]
    return Image.fromarray(rgb)


def blurred(img: Image.Image) -> Image.Image:
    return img.filter(ImageFilter.GaussianBlur(6))


# ---------------------------------------------------------------------------------------------------------
# Score values
# ---------------------------------------------------------------------------------------------------------


def test_scores_of_synthetic_images():
    board = checkerboard()
    sharp = curate_scores.score_frames([board], ["sharpness", "exposure"])
    soft = curate_scores.score_frames([blurred(board)], ["sharpness", "exposure"])
    # The interior Laplacian of a 0/255 board: 0 inside a cell, ±255 (edges) and ±510 (corners) on borders;
    # recomputed here by the definition, from the same grey image.
    g = np.asarray(board.convert("L"), np.float64)
    lap = g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4 * g[1:-1, 1:-1]
    assert sharp["sharpness"] == pytest.approx(lap.var(), rel=1e-12)
    assert sharp["sharpness"] > 30000 and soft["sharpness"] < sharp["sharpness"] / 100
    assert sharp["exposure"] == 1.0  # every pixel of the board is 0 or 255
    assert soft["exposure"] < 0.05
    white = Image.new("RGB", (40, 30), (255, 255, 255))
    assert curate_scores.score_frames([white], ["sharpness", "exposure"]) == {"sharpness": 0.0, "exposure": 1.0}
    half = np.full((20, 20), 128, np.uint8)
    half[:5] = 0  # a quarter black, the rest mid grey
    assert curate_scores.score_frames([Image.fromarray(half)], ["exposure"]) == {"exposure": 0.25}


def _write_video(path: Path, frame_RGB: np.ndarray, frames: int = 9) -> Path:
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(8))
        stream.height, stream.width = frame_RGB.shape[:2]
        stream.pix_fmt, stream.options = "yuv420p", {"threads": "1", "crf": "1"}
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_RGB, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_video_is_scored_on_k_frames_through_the_frame_reader(tmp_path):
    board = np.asarray(checkerboard(64, 8))
    sharp = _write_video(tmp_path / "sharp.mp4", board)
    soft = _write_video(tmp_path / "soft.mp4", np.asarray(blurred(checkerboard(64, 8))))
    cfg = curate.CurateConfig(frames=3)
    scores = {}
    for path in (sharp, soft):
        meta = {"kind": "video", "source_uri": str(path), "frames": 9, "rotation": 0}
        scores[path.stem] = curate.score_media({"json": b"{}"}, meta, cfg, ["sharpness", "exposure"])
    image = curate_scores.score_frames([Image.fromarray(board)], ["sharpness"])["sharpness"]
    # H.264 at crf 1 keeps the board within a few grey levels: the video scores as its frames do
    assert scores["sharp"]["sharpness"] == pytest.approx(image, rel=0.05)
    assert scores["soft"]["sharpness"] < scores["sharp"]["sharpness"] / 100


# ---------------------------------------------------------------------------------------------------------
# The stage in the prep
# ---------------------------------------------------------------------------------------------------------


def _image_folder(root: Path) -> Path:
    """4 sharp boards, 2 blurred ones, an all-white picture, each with a sidecar caption; PNG, distinct
    bytes (colours differ)."""
    root.mkdir(parents=True)
    colours = [((30, 30, 30), (225, 225, 225)), ((200, 20, 20), (20, 20, 200)), ((20, 160, 40), (240, 240, 20)),
               ((90, 40, 140), (250, 150, 30))]
    for i, pair in enumerate(colours):
        checkerboard(96, 8 + 4 * i, pair).save(root / f"sharp_{i}.png")
    for i, pair in enumerate(colours[1:3]):
        blurred(checkerboard(96, 8, pair)).save(root / f"blurred_{i}.png")
    Image.new("RGB", (96, 64), (255, 255, 255)).save(root / "white.png")
    for path in root.glob("*.png"):
        path.with_suffix(".txt").write_text(f"a picture called {path.stem}\n")
    return root


def _prep(out: Path, images: Path, tiny_flux: Path, *overrides: str) -> dict:
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={out}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={images}", *overrides])
    result = prep_in_process(recipe)
    for stage, (_, _, records) in result.items():
        stage_report(stage, records, 0.0)  # raises when in != out + quarantined
    return result


class ScorerCalls:
    """Counts calls of the real scorer functions (wrapped, not replaced)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name, fn in dict(curate_scores.SCORE_FUNCTIONS).items():
            monkeypatch.setitem(curate_scores.SCORE_FUNCTIONS, name, self._wrap(fn))

    def _wrap(self, fn):
        def counted(grey_HW, *opaque_HW):
            self.calls += 1
            return fn(grey_HW, *opaque_HW)
        return counted

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def _sources(entries) -> set[str]:
    return {Path(q["source"]).name for q in entries}


def test_thresholds_quarantine_and_a_threshold_change_recomputes_nothing(tmp_path, tiny_flux, monkeypatch):
    images = _image_folder(tmp_path / "images")
    out = tmp_path / "out"
    calls = ScorerCalls(monkeypatch)

    first = _prep(out, images, tiny_flux, f"curate.min_sharpness={SHARP_BLURRED_CUT}")
    assert calls.take() == 2 * 7  # two scorers, seven samples, each decoded and scored once
    curate_dir, manifest, records = first["curate"]
    assert manifest["counts"] == {"in": 7, "out": 4, "quarantined": 3}
    quarantine = [json.loads(line) for line in curate_dir.quarantine_path.read_text().splitlines()]
    by_name = {Path(q["source"]).name: q for q in quarantine}
    assert set(by_name) == {"blurred_0.png", "blurred_1.png", "white.png"}  # demo recipe: max_exposure 0.5
    for name in ("blurred_0.png", "blurred_1.png"):
        assert by_name[name]["reason"] == f"sharpness beyond curate.min_sharpness={SHARP_BLURRED_CUT:g}"
        assert LOOSE < by_name[name]["scores"]["sharpness"] < 1
    # white: sharpness 0 and exposure 1, beyond both thresholds
    assert by_name["white.png"]["scores"] == {"sharpness": 0.0, "exposure": 1.0}
    assert by_name["white.png"]["reason"] == (f"sharpness beyond curate.min_sharpness={SHARP_BLURRED_CUT:g}; "
                                              "exposure beyond curate.max_exposure=0.5")
    # kept samples carry their scores in their json, as the records do
    kept = [sample_json(s) for shard in manifest["shards"] for s in read_shard(curate_dir.root / shard["path"])]
    assert sorted(Path(m["source"]).name for m in kept) == [f"sharp_{i}.png" for i in range(4)]
    assert all(m["scores"]["sharpness"] > 300 and m["scores"]["exposure"] < 1 for m in kept)
    assert cache.component_report(first["cache"][2])["components"]["vae"] == {"processed": 4, "reused": 0}

    # A threshold that keeps the same samples: the curate units re-run, score nothing, and the cache encodes
    # nothing (the kept samples' bytes are the same).
    second = _prep(out, images, tiny_flux, f"curate.min_sharpness={SHARP_BLURRED_CUT * 2}")
    assert calls.take() == 0
    report = curate.report(second["curate"][2])
    assert report["scored"] == 0 and report["scores_reused"] == 7
    assert second["curate"][1]["units"] != manifest["units"]  # the units did run again
    assert cache.component_report(second["cache"][2])["components"]["vae"]["processed"] == 0
    assert second["cache"][1]["counts"]["out"] == 4

    # Loosened: the blurred pair comes back in; scored 0 times, and only those two are encoded.
    third = _prep(out, images, tiny_flux, f"curate.min_sharpness={LOOSE}")
    assert calls.take() == 0
    assert _sources(q for r in third["curate"][2] for q in r.quarantined) == {"white.png"}
    vae = cache.component_report(third["cache"][2])["components"]["vae"]
    assert vae["processed"] == 2 and third["cache"][1]["counts"]["out"] == 6

    # Tightened again, then loosened again: no score, no encoding (the blurred pair's latents are cached).
    for threshold, cached in ((SHARP_BLURRED_CUT, 4), (LOOSE, 6)):
        again = _prep(out, images, tiny_flux, f"curate.min_sharpness={threshold}")
        assert calls.take() == 0
        assert cache.component_report(again["cache"][2])["components"]["vae"]["processed"] == 0
        assert again["cache"][1]["counts"]["out"] == cached

    # The scores table, rewritten from the last run's records: every scored sample, its status and scores.
    import pyarrow.parquet as pq

    table = pq.read_table(out / "prep" / "scores.parquet").to_pylist()
    assert len(table) == 7
    assert set(table[0]) == {"key", "source", "kind", "status", "threshold", "sharpness", "exposure"}
    rows = {Path(r["source"]).name: r for r in table}
    assert rows["white.png"]["status"] == "quarantined" and rows["white.png"]["threshold"] == "curate.min_sharpness,curate.max_exposure"
    assert rows["white.png"]["exposure"] == 1.0 and rows["white.png"]["kind"] == "image"
    assert rows["blurred_0.png"]["status"] == "kept" and rows["blurred_0.png"]["threshold"] is None
    kept_now = {m["key"]: m["scores"] for m in (sample_json(s) for shard in again["curate"][1]["shards"]
                                                for s in read_shard(out / "prep" / "curate" / shard["path"]))}
    assert {r["key"]: {"sharpness": r["sharpness"], "exposure": r["exposure"]}
            for r in table if r["status"] == "kept"} == kept_now


def test_exact_duplicates_within_a_run_and_across_a_refresh(tmp_path, tiny_flux, monkeypatch):
    images = _image_folder(tmp_path / "images")
    for path in images.glob("blurred_*"):
        path.unlink()
    shutil.copyfile(images / "sharp_0.png", images / "sharp_0_copy.png")  # same bytes, another name
    (images / "sharp_0_copy.txt").write_text("the same picture again\n")
    out = tmp_path / "out"
    first = _prep(out, images, tiny_flux)
    dups = [q for r in first["curate"][2] for q in r.quarantined if "duplicate_of" in q]
    assert len(dups) == 1
    pair = {"sharp_0.png", "sharp_0_copy.png"}
    assert Path(dups[0]["source"]).name in pair and dups[0]["reason"] == "exact duplicate (same content sha256)"
    curate_dir = first["curate"][0]
    kept = {Path(sample_json(s)["source"]).name: s["__key__"] for shard in first["curate"][1]["shards"]
            for s in read_shard(curate_dir.root / shard["path"])}
    (owner_name,) = pair & set(kept)
    assert dups[0]["duplicate_of"] == kept[owner_name]
    # the rule: the first in upstream order (caption manifest order, then shard order) is kept
    order = [Path(sample_json(s)["source"]).name for shard in first["caption"][1]["shards"]
             for s in read_shard(first["caption"][0].root / shard["path"])]
    assert owner_name == min(pair, key=order.index)

    # A refresh adds a re-named copy of an old picture and a new picture: the copy is a duplicate of the old
    # sample, found from the index, reading only the new caption shards.
    old_caption_shards = {s["path"] for s in first["caption"][1]["shards"]}
    shutil.copyfile(images / "sharp_2.png", images / "zz_refresh_copy.png")
    (images / "zz_refresh_copy.txt").write_text("an old picture under a new name\n")
    checkerboard(96, 6, ((10, 10, 10), (250, 250, 250))).save(images / "zz_new.png")
    (images / "zz_new.txt").write_text("a new picture\n")
    read = []
    real_read = curate.sample_hashes
    monkeypatch.setattr(curate, "sample_hashes", lambda tar, entry: (read.append(Path(tar)), real_read(tar, entry))[1])
    second = _prep(out, images, tiny_flux)
    assert read and not {p.relative_to(out / "prep" / "caption").as_posix() for p in read} & old_caption_shards
    refreshed = {Path(q["source"]).name: q for r in second["curate"][2] for q in r.quarantined}
    assert refreshed["zz_refresh_copy.png"]["duplicate_of"] == kept["sharp_2.png"]
    assert Path(refreshed[next(n for n in pair if n != owner_name)]["source"]).name in pair  # still dropped
    assert second["curate"][1]["counts"] == {"in": 8, "out": 5, "quarantined": 3}  # 2 duplicates + white
    # the duplicates reach neither the bucket nor the cache stage
    assert second["cache"][1]["counts"]["out"] == 5
