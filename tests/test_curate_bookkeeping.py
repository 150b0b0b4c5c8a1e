"""The curate stage's per-sample and per-batch bookkeeping: score keys built from a fingerprint encoded once
(the same keys as ``score_key``), model fingerprints taken again without opening the weight-hash store."""

from __future__ import annotations

import os
from pathlib import Path

from latentmill.stages import curate, curate_scores

from latentmill.core import filehashes, fingerprints


def test_score_keyer_gives_score_keys_byte_for_byte():
    """``ScoreKeyer`` encodes the scorer fingerprint once and hashes the rest around it: its keys must be
    ``score_key``'s (``stable_hash`` of the whole dict), or every stored score would be computed again."""
    fingerprints = [
        {"scorer": "sharpness", "version": 1, "side": 256, "frames": 4, "background": [255, 255, 255]},
        {"scorer": "clip_score", "version": 1, "frames": 4, "background": [0, 0, 0], "decode_side": 448,
         "model": "ab" * 32, "dtype": "auto", "scale": 100.0, "where": Path("/m/clip"), "z": {"b": 1, "a": None}},
    ]
    metas = [{"sha256": "cd" * 32}, {"sha256": "ef" * 32, "clip": {"start_frame": 3, "num_frames": 10, "fps": 23.976}},
             {}, {"sha256": None, "clip": None, "other": "ignored"}]
    texts = [None, "", "a cat", 'quotes " and \\ back\nslash', "caf\u00e9 \u4e2d\u6587 \U0001f600"]
    keys = set()
    for fp in fingerprints:
        keyer = curate_scores.ScoreKeyer(fp)
        for meta in metas:
            for text in texts:
                key = keyer(meta, text)
                assert key == curate_scores.score_key(fp, meta, text), (fp["scorer"], meta, text)
                keys.add(key)
    # every part is in the key ({} and null sha256 / clip are the same sample: one key)
    assert len(keys) == len(fingerprints) * (len(metas) - 1) * len(texts)


def test_a_model_fingerprint_taken_again_opens_no_store(tmp_path, monkeypatch):
    """A curate model scorer fingerprints its model and head once per batch (``get_model``, ``get_head``):
    digests this process has taken are reused by stat without opening the SQLite weight-hash store; a
    changed file is hashed again (through the store) and changes the fingerprint."""
    monkeypatch.setenv("LATENTMILL_HASH_STORE", str(tmp_path / "hashes.sqlite"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "clip"}')
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    head = tmp_path / "head.safetensors"
    head.write_bytes(b"head" * 10)
    for path in (folder / "config.json", folder / "model.safetensors", head):
        os.utime(path, (1_000_000_000, 1_000_000_000))  # old files: their digests are remembered
    opened = []
    real_init = filehashes.FileHashes.__init__

    def counted(self, *args, **kwargs):
        opened.append(args)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(filehashes.FileHashes, "__init__", counted)
    fingerprints._memo.clear()
    first = fingerprints.component_fingerprint(fingerprints.ComponentSource(str(folder), None))
    first_head = fingerprints.file_fingerprint(head)
    assert len(opened) == 2 and (tmp_path / "hashes.sqlite").is_file()
    for _ in range(3):
        assert fingerprints.component_fingerprint(fingerprints.ComponentSource(str(folder), None)) == first
        assert fingerprints.file_fingerprint(head) == first_head
    assert len(opened) == 2
    (folder / "model.safetensors").write_bytes(b"other weights" * 100)
    os.utime(folder / "model.safetensors", (1_000_000_100, 1_000_000_100))
    assert fingerprints.component_fingerprint(fingerprints.ComponentSource(str(folder), None)) != first
    assert len(opened) == 3
    fingerprints._memo.clear()  # a new process: the digests come from the store (no file is read)
    assert fingerprints.file_fingerprint(head) == first_head


def test_fit_within_takes_a_fitting_rgb_frame_as_it_is():
    """A decoded RGB frame that already fits is scored as it is, not copied (a copy per image was a tenth of
    the curate stage's per-image time); other modes are converted, larger frames shrunk, never in place."""
    from latentmill.stages.captioners.media import fit_within
    from PIL import Image

    rgb = Image.new("RGB", (200, 100), (10, 20, 30))
    assert fit_within(rgb, 256) is rgb and fit_within(rgb, None) is rgb
    grey = Image.new("L", (200, 100), 7)
    as_rgb = fit_within(grey, 256)
    assert as_rgb.mode == "RGB" and as_rgb.size == (200, 100) and as_rgb.getpixel((0, 0)) == (7, 7, 7)
    small = fit_within(rgb, 50)
    assert small is not rgb and small.size == (50, 25) and rgb.size == (200, 100)


def test_a_chunk_is_decoded_then_scored_and_a_broken_sample_goes_on_unscored(tmp_path, monkeypatch):
    """``_score_unit`` decodes a chunk of ``curate.batch_size`` samples, then scores them (alternating a
    decode and the numpy scores per sample cost ~15% more per image); a sample that cannot be decoded in
    the middle of a chunk comes through unscored with its error (``process`` quarantines it), the others are
    scored, in order."""
    import io
    import json

    from latentmill.stages.shardio import ShardSink, WorkUnit
    from PIL import Image

    def png(value: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (24, 16), (value, value, value)).save(buf, "PNG")
        return buf.getvalue()

    tar = tmp_path / "up.tar"
    sink = ShardSink(tar)
    for i in range(6):
        data = b"not an image" if i == 2 else png(40 * i)
        sink.write({"__key__": f"k{i}", "image": data,
                    "json": json.dumps({"kind": "image", "sha256": f"{i:064x}"}).encode()})
    sink.commit()
    calls: list[str] = []
    for name, tag in (("decode_media", "D"), ("score_frames", "S")):
        real = getattr(curate, name)

        def wrapped(*args, _real=real, _tag=tag, **kwargs):
            calls.append(_tag)
            return _real(*args, **kwargs)

        monkeypatch.setattr(curate, name, wrapped)
    cfg = curate.CurateConfig(batch_size=4)
    prints = {name: curate.scorer_fingerprint(cfg, name, (255, 255, 255)) for name in cfg.active_scorers()}
    unit = WorkUnit("u" * 64, [], {"shards": [str(tar)]}, 6)
    items = list(curate._score_unit(cfg, unit, prints, lambda key: None, set(),
                                    (255, 255, 255)))
    assert calls == ["D"] * 4 + ["S"] * 3 + ["D"] * 2 + ["S"] * 2  # k2's decode failed: nothing to score
    assert [item.sample["__key__"] for item in items] == [f"k{i}" for i in range(6)]
    assert items[2].error is not None and items[2].values == {}
    for i in (0, 1, 3, 4, 5):
        assert items[i].error is None and items[i].computed
        assert items[i].values["exposure"] == (1.0 if i == 0 else 0.0)  # k0 is black: every pixel clipped
        assert items[i].values["sharpness"] == 0.0  # flat images
