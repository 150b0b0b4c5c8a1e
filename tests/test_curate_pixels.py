"""What the curate stage decodes: a sample it cannot decode is quarantined there, and a transparent picture is
scored on its opaque pixels (not on the background it is composited over)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from latentmill.stages import bucket, caption, curate, ingest
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.caption import CaptionConfig
from latentmill.stages.curate import CurateConfig
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir, stage_report
from latentmill.stages.tarshard import read_shard

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
