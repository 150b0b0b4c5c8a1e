"""The curate stage's per-sample and per-batch bookkeeping: score keys built from a fingerprint encoded once
(the same keys as ``score_key``), model fingerprints taken again without opening the weight-hash store."""

from __future__ import annotations

import os
from pathlib import Path

from latentmill.stages import curate, shardio

from latentmill import models


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
        keyer = curate.ScoreKeyer(fp)
        for meta in metas:
            for text in texts:
                key = keyer(meta, text)
                assert key == curate.score_key(fp, meta, text), (fp["scorer"], meta, text)
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
    real_init = shardio.FileHashes.__init__

    def counted(self, *args, **kwargs):
        opened.append(args)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(shardio.FileHashes, "__init__", counted)
    models._memo.clear()
    first = models.component_fingerprint(models.ComponentSource(str(folder), None))
    first_head = models.file_fingerprint(head)
    assert len(opened) == 2 and (tmp_path / "hashes.sqlite").is_file()
    for _ in range(3):
        assert models.component_fingerprint(models.ComponentSource(str(folder), None)) == first
        assert models.file_fingerprint(head) == first_head
    assert len(opened) == 2
    (folder / "model.safetensors").write_bytes(b"other weights" * 100)
    os.utime(folder / "model.safetensors", (1_000_000_100, 1_000_000_100))
    assert models.component_fingerprint(models.ComponentSource(str(folder), None)) != first
    assert len(opened) == 3
    models._memo.clear()  # a new process: the digests come from the store (no file is read)
    assert models.file_fingerprint(head) == first_head
