"""Near-duplicate removal (issue 18): the model-free embedding on the demo images, the index's searches and
keep rule, persistence across processes, and the prep: copies caught within a run and across a refresh
(old data not read again), a threshold change that computes no embedding and encodes no kept sample."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from latentmill.stages import cache, curate, neardup
from latentmill.stages.shardio import sample_json
from latentmill.stages.tarshard import read_shard
from PIL import Image

from tests.conftest import DEMO_IMAGES, REPO_ROOT
from tests.test_curate import ScorerCalls
from tests.test_curate import _prep as curate_prep

STRIPES = {"img_000.png", "img_005.jpg", "img_006.png", "img_011.jpg", "img_012.png"}  # fine vertical stripes


def jpeg60(img: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=60)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def half(img: Image.Image) -> Image.Image:
    return img.resize((img.width // 2, img.height // 2), Image.LANCZOS)


def shift4(img: Image.Image) -> Image.Image:
    """The picture moved 4 px left and up (cropped by 4 px at the left and the top)."""
    return img.crop((4, 4, img.width, img.height))


def _demo() -> dict[str, Image.Image]:
    return {p.name: Image.open(p).convert("RGB") for p in sorted(DEMO_IMAGES.glob("img_*")) if p.suffix != ".txt"}


def _embed(img: Image.Image) -> np.ndarray:
    return neardup.thumbnail_embedding([img])


# ---------------------------------------------------------------------------------------------------------
# The embedding and the index (no prep)
# ---------------------------------------------------------------------------------------------------------


def test_embedding_catches_copies_and_keeps_distinct_pictures_apart():
    demo = _demo()
    assert len(demo) == 24
    vectors = {name: _embed(img) for name, img in demo.items()}
    assert all(v.shape == (768,) and v.dtype == np.float32 for v in vectors.values())
    assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in vectors.values())
    names = list(vectors)
    distinct = max(float(vectors[a] @ vectors[b]) for i, a in enumerate(names) for b in names[i + 1:])
    # measured 0.891: the default threshold leaves a margin above every pair of different demo pictures
    assert 0.85 < distinct < neardup.DEFAULT_THRESHOLD - 0.02
    for name, img in demo.items():
        assert float(_embed(jpeg60(img)) @ vectors[name]) > 0.999
        assert float(_embed(half(img)) @ vectors[name]) > 0.999
        shifted = float(_embed(shift4(img)) @ vectors[name])
        # a 4-px shift: >= 0.977 except the fine stripes (a shift of about half their period): >= 0.91
        assert shifted >= (0.91 if name in STRIPES else 0.97), (name, shifted)
    # colours count: flat red twice is a duplicate, flat red and flat green are not; flat grey is near nothing
    red, green = _embed(Image.new("RGB", (40, 30), (200, 10, 10))), _embed(Image.new("RGB", (64, 64), (10, 200, 10)))
    assert float(red @ _embed(Image.new("RGB", (90, 20), (200, 10, 10)))) > 0.999 and float(red @ green) < 0.5
    assert not _embed(Image.new("RGB", (40, 30), (128, 128, 128))).any()
    # why the default is off: two flat pictures of different (similar) colours are near duplicates
    assert float(_embed(Image.new("RGB", (9, 9), (0, 200, 90))) @ _embed(Image.new("RGB", (9, 9), (40, 170, 90)))) > 0.99
    assert curate.CurateConfig().dedup_threshold is None


def _planted(seed: int = 0, n: int = 3000, copies: int = 300, dim: int = 768):
    """``n`` random unit vectors, then ``copies`` vectors at cosine ~0.95 to ``copies`` of them."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    base = unit(rng.standard_normal((n, dim)))
    source = rng.choice(n, copies, replace=False)
    near = unit(base[source] * 0.95 + unit(rng.standard_normal((copies, dim))) * np.sqrt(1 - 0.95 ** 2))
    vectors = np.concatenate([base, near])
    keys = [f"k{i:05d}" for i in range(len(vectors))]
    expected = {keys[n + i]: keys[s] for i, s in enumerate(source)}
    return keys, vectors, expected


KINDS = ["exact", "lsh", pytest.param("usearch", marks=pytest.mark.skipif(not neardup.usearch_available(),
                                                                         reason="usearch not installed"))]


@pytest.mark.parametrize("kind", KINDS)
def test_searches_find_the_planted_copies_and_agree(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(neardup, "EXACT_BELOW", 0)  # lsh: hashed buckets even on a small index
    keys, vectors, expected = _planted()
    index = neardup.NearDupIndex(tmp_path / kind, 768, kind)
    index.enter(keys[:2000], vectors[:2000], [None] * 2000, ["u1"])
    index.enter(keys[2000:], vectors[2000:], [None] * (len(keys) - 2000), ["u2"])
    assert index.search_kind() == kind
    assert index.decide(0.92) == len(keys)
    found = index.duplicates(0.92, keys)
    # a refresh of one sample (a search of one query)
    index.enter(["one"], vectors[3000:3001], [None], ["u3"])
    assert index.decide(0.92) == 1
    one = index.duplicates(0.92, ["one"])
    index.close()
    owners = {k: owner for k, (owner, _) in found.items()}
    assert all(0.93 < cos < 0.97 for _, cos in found.values())
    if kind == "usearch":
        # HNSW is approximate (and its graph depends on thread timing): every pair it reports is a planted
        # copy with its right owner (candidates are re-checked exactly), and it finds nearly all of them
        assert all(expected.get(k) == owner for k, owner in owners.items())
        assert len(owners) >= 0.95 * len(expected)
        assert one.get("one", (expected[keys[3000]],))[0] == expected[keys[3000]]
        return
    # every planted copy, and nothing else, owned by the vector it was made from (random pairs: cosine ~0)
    assert one["one"][0] == expected[keys[3000]]
    assert owners == expected


def test_lsh_sorted_tables_merge_and_persist(tmp_path):
    """The LSH's sorted tables, merged batch by batch and saved, are those a full sort gives, and a new
    process reads them instead of sorting."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((3000, 768)).astype(np.float32)
    lsh = neardup.LshSearch(768, tmp_path / "codes.u32", lambda: vectors)
    for lo, hi in ((0, 1000), (1000, 1700), (1700, 3000)):
        lsh.add(np.arange(lo, hi), vectors[lo:hi])
        codes_TN, perm_TN = lsh._tables()
        assert (np.diff(codes_TN.astype(np.int64), axis=1) >= 0).all()  # each table sorted
        assert all((lsh.codes[perm_TN[t], t] == codes_TN[t]).all() for t in range(lsh.TABLES))
        assert all(sorted(perm_TN[t]) == list(range(hi)) for t in (0, lsh.TABLES - 1))  # each row once
    lsh.save()
    again = neardup.LshSearch(768, tmp_path / "codes.u32", lambda: vectors)
    calls = []
    real_argsort = np.argsort
    try:
        np.argsort = lambda *a, **k: (calls.append(1), real_argsort(*a, **k))[1]
        loaded = again._tables()
    finally:
        np.argsort = real_argsort
    assert not calls and (loaded[0] == codes_TN).all() and (loaded[1] == perm_TN).all()


def test_keep_rule_aesthetic_then_oldest_and_old_samples_win(tmp_path):
    rng = np.random.default_rng(1)
    a, b, c = (v / np.linalg.norm(v) for v in rng.standard_normal((3, 768)))

    def near(v, seed):
        w = v + 0.1 * np.random.default_rng(100 + seed).standard_normal(768) / np.sqrt(768)
        return w / np.linalg.norm(w)

    index = neardup.NearDupIndex(tmp_path / "idx", 768)
    # batch 1: a0, a1 (no aesthetic: the first is kept); b0 (aesthetic 4), b1 (aesthetic 6: kept although later)
    index.enter(["a0", "a1", "b0", "b1"], np.stack([a, near(a, 1), b, near(b, 2)]), [None, None, 4.0, 6.0], ["u1"])
    index.decide(0.92)
    first = index.duplicates(0.92, ["a0", "a1", "b0", "b1"])
    assert {k: o for k, (o, _) in first.items()} == {"a1": "a0", "b0": "b1"}
    # batch 2: a copy of b0 with a higher aesthetic: the old kept sample (b1) wins; c is new and kept
    index.enter(["b2", "c0"], np.stack([near(b, 3), c]), [9.0, None], ["u2"])
    index.decide(0.92)
    assert {k: o for k, (o, _) in index.duplicates(0.92, ["b2", "c0"]).items()} == {"b2": "b1"}
    # a new threshold decides the stored batches again, batch by batch, the same way
    assert index.decide(0.999) == 6 and index.duplicates(0.999, ["a1", "b0", "b2"]) == {}
    index.close()


_CHILD = """
import sys, numpy as np
from pathlib import Path
from latentmill.stages import neardup
rng = np.random.default_rng(2)
v = rng.standard_normal((50, 768)); v /= np.linalg.norm(v, axis=1, keepdims=True)
index = neardup.NearDupIndex(Path(sys.argv[1]), 768)
index.enter([f"old{i}" for i in range(50)], v.astype(np.float32), [None] * 50, ["u1"])
index.decide(0.92)
index.close()
"""


def test_index_persists_across_processes_and_cuts_uncommitted_vectors(tmp_path):
    folder = tmp_path / "idx"
    subprocess.run([sys.executable, "-c", _CHILD, str(folder)], check=True, cwd=REPO_ROOT,
                   env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    rng = np.random.default_rng(2)
    v = rng.standard_normal((50, 768))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    with open(folder / "vectors.f32", "ab") as fh:  # a killed write: vectors appended, rows not committed
        fh.write(np.zeros((3, 768), np.float32).tobytes())
    index = neardup.NearDupIndex(folder, 768)
    assert index.rows == 50 and (folder / "vectors.f32").stat().st_size == 50 * 768 * 4
    assert neardup.NearDupIndex.entered_units_in(index.folder) == {"u1"} and index.decided_rows(0.92) == 50
    copy = v[7] + 0.05 * rng.standard_normal(768) / np.sqrt(768)
    index.enter(["new"], (copy / np.linalg.norm(copy))[None].astype(np.float32), [None], ["u2"])
    assert index.decide(0.92) == 1  # only the new row
    ((key, (owner, cos)),) = index.duplicates(0.92, ["new"]).items()
    assert (key, owner) == ("new", "old7") and cos > 0.99
    index.close()


def test_bad_config_names_the_key():
    from latentmill.core.config import ConfigError

    with pytest.raises(ConfigError, match="curate.dedup_threshold"):
        curate.CurateConfig(dedup_threshold=1.5).validate()
    with pytest.raises(ConfigError, match="curate.dedup_index.*allowed: auto, usearch, lsh, exact"):
        curate.CurateConfig(dedup_index="faiss").validate()


# ---------------------------------------------------------------------------------------------------------
# The prep: within a run, across a refresh, a threshold change
# ---------------------------------------------------------------------------------------------------------

KEEP = ["img_001.jpg", "img_003.png", "img_008.jpg", "img_013.jpg", "img_017.jpg", "img_021.png"]


def _folder(root: Path) -> Path:
    root.mkdir(parents=True)
    for name in KEEP:
        shutil.copyfile(DEMO_IMAGES / name, root / name)
        shutil.copyfile((DEMO_IMAGES / name).with_suffix(".txt"), (root / name).with_suffix(".txt"))
    return root


def _add(root: Path, name: str, img: Image.Image) -> None:
    img.save(root / name, quality=60) if name.endswith(".jpg") else img.save(root / name)
    (root / name).with_suffix(".txt").write_text(f"a picture called {name}\n")


class Calls:
    """Counts calls of the real embedder (wrapped, not replaced)."""

    def __init__(self, monkeypatch):
        self.embeddings = 0
        real = neardup.thumbnail_embedding

        def counted(frames, side=neardup.THUMB_SIDE):
            self.embeddings += 1
            return real(frames, side)

        monkeypatch.setattr(neardup, "thumbnail_embedding", counted)
        self.updates: list[dict] = []
        real_update = neardup.update

        def update(*args, **kwargs):
            self.updates.append(real_update(*args, **kwargs))
            return self.updates[-1]

        monkeypatch.setattr(neardup, "update", update)

    def take(self) -> int:
        calls, self.embeddings = self.embeddings, 0
        return calls


def _prep(out: Path, images: Path, tiny_flux: Path, *overrides: str) -> dict:
    """The demo recipe on ``images`` with near duplicates on at the recommended threshold (unless overridden)."""
    return curate_prep(out, images, tiny_flux, f"curate.dedup_threshold={neardup.DEFAULT_THRESHOLD}", *overrides)


def _keys(result: dict, stage: str = "curate") -> dict[str, str]:
    """Source file name -> sample key, of the samples written by ``stage``."""
    stage_dir, manifest, _ = result[stage]
    return {Path(sample_json(s)["source"]).name: s["__key__"] for shard in manifest["shards"]
            for s in read_shard(stage_dir.root / shard["path"])}


def _near(result: dict) -> dict[str, dict]:
    """Source file name -> the bucket stage's near-duplicate quarantine entry."""
    return {Path(q["source"]).name: q for r in result["bucket"][2] for q in r.quarantined
            if q["reason"] == neardup.REASON}


@pytest.mark.slow
def test_near_duplicates_within_a_run_across_a_refresh_and_a_threshold_change(tmp_path, tiny_flux, monkeypatch):
    images = _folder(tmp_path / "images")
    demo = _demo()
    _add(images, "zz_img_001_q60.jpg", jpeg60(demo["img_001.jpg"]))  # re-encoded
    _add(images, "zz_img_003_half.png", half(demo["img_003.png"]))  # resized
    out = tmp_path / "out"
    calls = Calls(monkeypatch)

    first = _prep(out, images, tiny_flux)
    assert calls.take() == 8  # every sample embedded once
    keys = {**_keys(first), **_keys(first, "caption")}
    near = _near(first)
    # the rule without aesthetic scores: the first in upstream order (caption manifest order, then shard
    # order: as for exact duplicates) is kept
    order = [Path(sample_json(s)["source"]).name for shard in first["caption"][1]["shards"]
             for s in read_shard(first["caption"][0].root / shard["path"])]
    pairs = [("img_001.jpg", "zz_img_001_q60.jpg"), ("img_003.png", "zz_img_003_half.png")]
    expected = {max(p, key=order.index): min(p, key=order.index) for p in pairs}
    assert {name: q["duplicate_of"] for name, q in near.items()} == {k: keys[v] for k, v in expected.items()}
    assert all(q["cosine"] > 0.999 for q in near.values())
    assert first["bucket"][1]["counts"] == {"in": 8, "out": 6, "quarantined": 2}
    assert first["cache"][1]["counts"]["out"] == 6
    assert calls.updates[-1]["entered"] == 8 and calls.updates[-1]["new_near_duplicates"] == 2
    # embeddings live beside the curate shards, referenced with their sha256 from the records (not in JSON)
    (record,) = [r for r in first["curate"][2] if "embeddings" in r.extra][:1]
    emb = record.extra["embeddings"]
    assert np.load(first["curate"][0].root / emb["file"]).shape == (len(emb["keys"]), 768)

    # A refresh adds a shifted copy and a re-encoded copy of old pictures and a new picture: the copies are
    # near duplicates of the old keys; only the new curate unit's embeddings are read, nothing old again.
    _add(images, "zz_refresh_img_013_shift.png", shift4(demo["img_013.jpg"]))
    _add(images, "zz_refresh_img_017_q60.jpg", jpeg60(demo["img_017.jpg"]))
    _add(images, "zz_refresh_new.png", demo["img_022.jpg"])
    second = _prep(out, images, tiny_flux)
    assert calls.take() == 3  # the three new samples
    update = calls.updates[-1]
    assert (update["entered"], update["vectors_read"], update["decided"], update["indexed"]) == (3, 3, 3, 11)
    assert update["units_read"] == len([r for r in second["curate"][2] if not r.reused]) == 1
    near2 = _near(second)
    # the old sample is kept, whatever the order of the new shards
    assert near2["zz_refresh_img_013_shift.png"]["duplicate_of"] == keys["img_013.jpg"]
    assert near2["zz_refresh_img_017_q60.jpg"]["duplicate_of"] == keys["img_017.jpg"]
    assert 0.92 <= near2["zz_refresh_img_013_shift.png"]["cosine"] < 0.999
    assert set(near2) == set(near) | {"zz_refresh_img_013_shift.png", "zz_refresh_img_017_q60.jpg"}
    assert second["bucket"][1]["counts"] == {"in": 11, "out": 7, "quarantined": 4}
    assert cache.component_report(second["cache"][2])["components"]["vae"]["processed"] == 1  # the new one

    # A stricter threshold: no embedding computed, no curate unit re-run; the bucket units re-run (copying)
    # and the shifted copy (cosine < 0.999) comes back in: the cache encodes it and nothing else.
    third = _prep(out, images, tiny_flux, "curate.dedup_threshold=0.999")
    assert calls.take() == 0
    assert all(r.reused for r in third["curate"][2])
    assert calls.updates[-1]["entered"] == 0 and calls.updates[-1]["decided"] == 11
    assert set(_near(third)) == set(near2) - {"zz_refresh_img_013_shift.png"}
    assert third["bucket"][1]["units"] != second["bucket"][1]["units"]
    assert cache.component_report(third["cache"][2])["components"]["vae"]["processed"] == 1
    assert third["cache"][1]["counts"]["out"] == 8

    # Back to the default: decided before, nothing is computed, encoded or decided again.
    fourth = _prep(out, images, tiny_flux)
    assert calls.take() == 0 and calls.updates[-1]["decided"] == 0
    assert cache.component_report(fourth["cache"][2])["components"]["vae"]["processed"] == 0
    assert fourth["bucket"][1]["units"] == second["bucket"][1]["units"]

    # Off (the default): nothing dropped as a near duplicate
    off = _prep(out, images, tiny_flux, "curate.dedup_threshold=null")
    assert _near(off) == {} and off["bucket"][1]["counts"]["out"] == 11
    assert json.loads((out / "prep" / "curate" / "manifest.json").read_text())["counts"]["in"] == 11
    assert calls.take() == 0

    # On again with a changed score threshold: the curate units re-run and find every embedding and every
    # score by key (none computed); the decisions at 0.92 are the stored ones.
    scores = ScorerCalls(monkeypatch)
    again = _prep(out, images, tiny_flux, "curate.max_exposure=0.6")
    assert not any(r.reused for r in again["curate"][2])
    assert calls.take() == 0 and scores.calls == 0
    report = curate.report(again["curate"][2])
    assert (report["embedded"], report["embeddings_reused"], report["scored"]) == (0, 11, 0)
    assert {k: q["duplicate_of"] for k, q in _near(again).items()} == {k: q["duplicate_of"] for k, q in near2.items()}
    assert cache.component_report(again["cache"][2])["components"]["vae"]["processed"] == 0


def test_the_run_summary_prints_the_near_duplicate_counts(capsys):
    """The CLI's run summary says what the index decided (the bucket stage's table row counts them only as
    quarantined)."""
    from latentmill.cli import _print_summary

    stage = {"in": 8, "out": 8, "quarantined": 0, "processed": 8, "reused": 0, "seconds": 0.1}
    near = {"threshold": 0.92, "search": "exact", "indexed": 8, "new_near_duplicates": 2, "near_duplicates": 3}
    _print_summary({"stages": {"curate": {**stage, "scored": 8, "scores_reused": 0, "near_duplicates": near}}},
                   None)
    assert "near duplicates (cosine >= 0.92, exact search over 8 embeddings): 2 new, 3 in all" in capsys.readouterr().out
    _print_summary({"stages": {"curate": {**stage, "scored": 8, "scores_reused": 0, "near_duplicates": None}}}, None)
    assert "near duplicates" not in capsys.readouterr().out
