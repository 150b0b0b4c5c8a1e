"""The per-process record indexes hold one entry per sample in arrays (``stages/keytable.py``), not dicts of
Python objects (figure 15: the prep's peak RSS at 10x the inputs).

- ``HexKeyTable``: lookups, overwrites and duplicate detection agree with a dict, across merges of the
  pending keys into the sorted arrays, including keys whose bytes end in zeros (numpy's bytes type drops
  trailing NUL bytes).
- The cache's ``ComponentIndex`` finds the same hits as before (oldest record first, a shared caption's
  text key, a component encoded elsewhere) and holds ~160 bytes a sample (its sample keys included), not
  the ~440 of tuples in dicts; curate's ``ScoreIndex`` ~70, not ~330.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tracemalloc
from pathlib import Path

import numpy as np
from latentmill.stages import keytable
from latentmill.stages.cache import UNKNOWN_DEVICE, VAE_MEMBER, ComponentIndex, text_member
from latentmill.stages.curate import ScoreIndex
from latentmill.stages.keytable import HexKeyTable
from latentmill.stages.shardio import ShardInfo, UnitRecord


def _key(n: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}{n}".encode()).hexdigest()


def test_the_table_agrees_with_a_dict_across_merges(monkeypatch):
    monkeypatch.setattr(keytable, "MIN_MERGE", 16)  # many merges on a small table
    table, truth = HexKeyTable(np.float64), {}
    rng = random.Random(0)
    zeros = ["00" * 32, "ab" + "00" * 31, "ab" + "00" * 30 + "01", "00" * 31 + "ab"]  # trailing NUL bytes
    keys = [_key(n) for n in range(3000)] + zeros
    for step in range(6000):
        key = rng.choice(keys)
        value = float(step)
        table.set(key, value)
        truth[key] = value
        if step % 97 == 0:
            probe = rng.choice(keys)
            assert table.get(probe) == truth.get(probe)
    assert all(table.get(k) == v for k, v in truth.items())
    assert all(table[k] == truth[k] for k in zeros)
    assert table.get(_key(99999)) is None and _key(99999) not in table and table.get("not hex") is None
    assert len(table) == len(truth)
    assert dict(table.items()) == truth  # every key back out, unchanged (trailing zeros included)


def test_add_new_reports_held_and_repeated_keys(monkeypatch):
    monkeypatch.setattr(keytable, "MIN_MERGE", 4)
    table = HexKeyTable()
    first = [bytes.fromhex(_key(n)) for n in range(10)]
    assert table.add_new(first, list(range(10))) == []
    batch = [bytes.fromhex(_key(n)) for n in (20, 3, 21, 20, 9)]  # 3 and 9 held, 20 repeated in the batch
    assert table.add_new(batch, [120, 103, 121, 999, 109]) == [1, 3, 4]
    assert [table.get(_key(n)) for n in (3, 9, 20, 21)] == [3, 9, 120, 121]  # held values kept


def _write_record(root: Path, name: str, samples: dict[str, dict], mtime_ns: int, **extra) -> None:
    record = UnitRecord(name, "cache", [], [ShardInfo(f"{name}.tar", f"shards/{name}.tar", "0" * 64, len(samples))],
                        [], len(samples), 0.0, {"components": samples, **extra})
    (root / "shards").mkdir(parents=True, exist_ok=True)
    (root / "shards" / f"{name}.tar").write_bytes(b"")
    path = root / "units" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.to_json()))
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_component_index_finds_the_oldest_hit_and_its_origin(tmp_path):
    root = tmp_path / "cache"
    caption = _key(0, "caption")  # one caption shared by every sample
    old = {f"s{n}": {"vae": _key(n, "vae"), "text": caption} for n in range(5)}
    new = {f"t{n}": {"vae": _key(n, "vae"), "text": [caption, _key(n, "t5")]} for n in range(3, 8)}
    _write_record(root, "b-new", new, 2_000_000_000, device={"key": "gpu-a"},
                  foreign={_key(7, "vae"): "gpu-b"})
    _write_record(root, "a-old", old, 1_000_000_000, device={"key": "cpu"})
    index = ComponentIndex(root).refresh()
    late = 3_000_000_000
    vae = index.find("vae", [_key(n, "vae") for n in range(9)], late)
    shard = lambda name: (root / "shards" / f"{name}.tar",)  # noqa: E731
    # 3 and 4 are in both records: the older one (committed first, though read second) is found
    assert vae == {**{_key(n, "vae"): (shard("a-old"), f"s{n}", VAE_MEMBER) for n in range(5)},
                   **{_key(n, "vae"): (shard("b-new"), f"t{n}", VAE_MEMBER) for n in range(5, 8)}}
    assert index.find("text", [caption], late) == {caption: (shard("a-old"), "s0", text_member(0))}
    assert index.find("text", [_key(4, "t5")], late) == {_key(4, "t5"): (shard("b-new"), "t4", text_member(1))}
    assert index.find("vae", [_key(3, "vae")], 1_500_000_000) == {_key(3, "vae"): (shard("a-old"), "s3", VAE_MEMBER)}
    assert index.find("vae", [_key(6, "vae")], 1_500_000_000) == {}  # committed after the cut-off
    assert [index.origin("vae", _key(n, "vae"), late) for n in (0, 6, 7)] == ["cpu", "gpu-a", "gpu-b"]
    assert index.origin("vae", _key(99, "vae"), late) == UNKNOWN_DEVICE
    (root / "shards" / "a-old.tar").unlink()  # gc removed the old record's shard: the newer one serves
    assert index.find("vae", [_key(3, "vae")], late) == {_key(3, "vae"): (shard("b-new"), "t3", VAE_MEMBER)}


def test_record_indexes_hold_far_less_than_a_dict_of_tuples(tmp_path):
    root = tmp_path / "cache"
    units, per_unit = 10, 2000
    for u in range(units):
        _write_record(root, f"u{u:02d}", {f"{u:02d}{n:06d}": {"vae": _key(n, f"vae{u}"), "text": _key(n, f"t{u}")}
                                          for n in range(per_unit)}, 1_000_000_000 + u, device={"key": "cpu"})
    curate = tmp_path / "curate" / "units"
    curate.mkdir(parents=True)
    for u in range(units):
        rows = {f"{u:02d}{n:06d}": {"keys": {"sharpness": _key(n, f"s{u}"), "exposure": _key(n, f"e{u}")},
                                    "values": {"sharpness": 1.5, "exposure": 0.5}} for n in range(per_unit)}
        (curate / f"u{u:02d}.json").write_text(json.dumps({"extra": {"scores": rows}}))
    samples = units * per_unit
    tracemalloc.start()
    try:
        components = ComponentIndex(root).refresh()
        held_components = tracemalloc.get_traced_memory()[0]
        scores = ScoreIndex(tmp_path / "curate").refresh()
        held_scores = tracemalloc.get_traced_memory()[0] - held_components
    finally:
        tracemalloc.stop()
    assert len(components.vae) == len(components.text) == samples and len(scores.values) == 2 * samples
    # tuples in dicts held ~440 bytes a sample (component index) and ~330 (score index, two scores)
    assert held_components / samples < 200, held_components / samples
    assert held_scores / samples < 120, held_scores / samples
