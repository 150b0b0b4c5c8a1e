"""Pictures of a prep (``latentmill inspect --plots``, the prep flow's ``prep/plots`` and ``prep-plots``
artifact): the files written, that the bars are the scores table's counts, the threshold lines the manifest's
values, one tile per quarantined sample (capped), same data same bytes, and the extra named without
matplotlib."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from latentmill.pipelines.prep import run_prep
from latentmill.pipelines.report import write_prep_plots
from PIL import Image

from latentmill import plots
from latentmill.cli import main
from latentmill.recipe import load_recipe
from tests.conftest import DEMO_CONFIG, DEMO_IMAGES, REPO_ROOT

pytestmark = pytest.mark.slow

MIN_SHARPNESS = 5.0  # the demo's three smoothest pictures score below it (< 3.5), every other one above (> 6)
# a third of the demo: its three smoothest pictures, three others, the over-exposed, broken and truncated ones
PICTURES = ("img_013.jpg", "img_004.jpg", "img_009.png", "img_000.png", "img_001.jpg", "img_012.png",
            "overexposed_0.png", "overexposed_1.jpg", "broken.jpg", "truncated.jpg")


@pytest.fixture(scope="module")
def prepped(tiny_flux, tmp_path_factory) -> Path:
    """Part of the demo data (with its over-exposed, broken and truncated pictures) prepared by the Prefect
    flow, with a sharpness threshold on top of the demo's exposure one: an output_dir."""
    import shutil

    root = tmp_path_factory.mktemp("plots")
    (root / "images").mkdir()
    for name in PICTURES:
        for path in (DEMO_IMAGES / name, (DEMO_IMAGES / name).with_suffix(".txt")):
            shutil.copy(path, root / "images" / path.name)
    out = root / "out"
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={out}", f"model.pretrained={tiny_flux}",
                                       f"ingest.source={root / 'images'}", f"curate.min_sharpness={MIN_SHARPNESS}"])
    run_prep(recipe)
    return out


@pytest.fixture(scope="module")
def drawn(prepped, tmp_path_factory) -> tuple[Path, dict[str, plots.Plot]]:
    out = tmp_path_factory.mktemp("pictures")
    return out, {p.name: p for p in plots.write_plots(prepped / "prep", out)}


def _table(prepped: Path) -> dict[str, list]:
    import pyarrow.parquet as pq

    return pq.read_table(prepped / "prep" / "scores.parquet").to_pydict()


def _groups(prepped: Path) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for path in sorted((prepped / "prep").glob("*/quarantine.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            groups.setdefault((entry["stage"], entry["reason"]), []).append(entry)
    return groups


def test_inspect_plots_writes_every_picture(prepped, tmp_path, capsys):
    out = tmp_path / "pictures"
    assert main(["inspect", "--plots", str(out), str(prepped)]) == 0
    printed = capsys.readouterr().out
    groups = _groups(prepped)
    # the demo quarantines at ingest (broken) and curate (exposure, sharpness; truncated, which it cannot decode)
    assert {stage for stage, _ in groups} == {"ingest", "curate"}
    assert len([g for g in groups if g[0] == "curate"]) == 3
    sheets = {f"quarantine_{stage}-{plots.slug(reason)}.png" for stage, reason in groups}
    expected = {"score_sharpness.png", "score_exposure.png", "buckets.png", *sheets}
    assert {p.name for p in out.glob("*.png")} == expected
    index = (out / "index.md").read_text()
    for name in expected:
        assert f"({name})" in index and f"wrote {out / name}: " in printed
        with Image.open(out / name) as img:
            assert img.format == "PNG" and min(img.size) >= 200
    assert f"wrote {out / 'index.md'}: {len(expected)} pictures" in printed


def test_histogram_bars_are_the_tables_counts_and_lines_the_manifests_thresholds(prepped, drawn):
    _, found = drawn
    table = _table(prepped)
    status = np.asarray(table["status"])
    manifest = json.loads((prepped / "prep" / "curate" / "manifest.json").read_text())
    assert manifest["thresholds"] == {"min_sharpness": MIN_SHARPNESS, "max_exposure": 0.5}
    for name, threshold in (("sharpness", "min_sharpness"), ("exposure", "max_exposure")):
        data = found[f"score_{name}.png"].data
        values = np.asarray(table[name], np.float64)
        edges = np.asarray(data["edges"])
        assert edges[0] == values.min() and edges[-1] == values.max()
        assert data["kept"] == np.histogram(values[status == "kept"], edges)[0].tolist()
        assert data["quarantined"] == np.histogram(values[status == "quarantined"], edges)[0].tolist()
        assert sum(data["kept"]) == int((status == "kept").sum()) == 3
        assert sum(data["quarantined"]) == int((status == "quarantined").sum()) == 5
        assert data["thresholds"] == {threshold: manifest["thresholds"][threshold]}
    assert found["score_exposure.png"].summary.endswith("curate.max_exposure=0.5")


def test_contact_sheet_tiles_are_the_quarantined_samples(prepped, drawn):
    out, found = drawn
    for (stage, reason), entries in _groups(prepped).items():
        sheet = found[f"quarantine_{stage}-{plots.slug(reason)}.png"].data
        assert sheet["tiles"] == len(entries) and sheet["keys"] == [e["key"] for e in entries]
        assert sheet["more"] == 0
        # the broken and truncated files get a grey "cannot decode" tile; curate's threshold drops are decoded
        undecodable = stage == "ingest" or reason.startswith("cannot decode pixels")
        assert sheet["undecodable"] == (len(entries) if undecodable else 0)
    groups = _groups(prepped)
    stage, reason = next(g for g in groups if g[0] == "curate" and "exposure" in g[1])
    capped = plots.contact_sheet(stage, reason, groups[(stage, reason)], prepped / "prep", out / "cap", cap=1)
    assert (capped.data["tiles"], capped.data["more"]) == (1, len(groups[(stage, reason)]) - 1) == (1, 1)
    assert "(+1 more)" in capped.summary


def test_scores_come_from_the_records_without_pyarrow(prepped, monkeypatch):
    with_table = _table(prepped)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert plots.load_scores(prepped / "prep") == with_table


def test_same_prep_same_bytes(prepped, drawn, tmp_path):
    import matplotlib

    out, found = drawn
    # whatever the calling program set (a user's matplotlibrc, a notebook's style)
    with matplotlib.rc_context({"axes.facecolor": "red", "font.size": 20, "figure.dpi": 300}):
        again = plots.write_plots(prepped / "prep", tmp_path)
    assert [p.name for p in again] == list(found)
    for plot in again:
        assert plot.path.read_bytes() == (out / plot.name).read_bytes(), plot.name


def test_prep_flow_draws_the_pictures_and_the_artifact_shows_each(prepped):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    folder = prepped / "prep" / "plots"
    names = sorted(p.name for p in folder.glob("*.png"))
    assert "buckets.png" in names and len(names) == 3 + len(_groups(prepped))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prep-plots"])))
    markdown = max(found, key=lambda a: a.created).data
    for name in names:
        assert f"### {name}" in markdown and f"![{name}](data:image/png;base64," in markdown
    # past the inline budget the pictures are linked, by file
    linked = plots.artifact_markdown([plots.Plot(n, folder / n, "") for n in names], inline_bytes=0)
    assert all(f"[{n}]({(folder / n).resolve().as_uri()})" in linked for n in names)


def test_a_failed_picture_is_a_warning_not_a_failed_prep(tmp_path):
    warnings: list[str] = []
    (tmp_path / "curate").mkdir()
    (tmp_path / "curate" / "manifest.json").write_text("{not json")
    assert write_prep_plots(tmp_path, warnings.append) is None
    assert len(warnings) == 1 and warnings[0].startswith("prep plots not drawn: JSONDecodeError")


def test_without_matplotlib_the_error_names_the_extra(prepped, tmp_path):
    # the CLI names the extra (exit 2, as for a bad path); the prep flow's pictures are skipped without a word
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from latentmill.cli import main\n"
            "from latentmill.pipelines.report import write_prep_plots\n"
            f"w = []; print(write_prep_plots({str(prepped / 'prep')!r}, w.append), w)\n"
            f"sys.exit(main(['inspect', '--plots', {str(tmp_path / 'p')!r}, {str(prepped)!r}]))")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("latentmill: error: plots need matplotlib, which is not installed: "
                                   "pip install 'latentmill[plots]'")
    assert done.stdout.split() == ["None", "[]"]
    assert not (tmp_path / "p").exists()


def test_prep_plots_are_drawn_again_only_when_the_prep_changed(prepped, tmp_path):
    import shutil

    prep = tmp_path / "prep"
    shutil.copytree(prepped / "prep", prep, ignore=shutil.ignore_patterns("shards", "units", "*.sqlite", "plots"))
    folder = prep / "plots"
    first, drawn = plots.update_plots(prep, folder)
    saved = json.loads((folder / "plots.json").read_text())
    assert drawn and [p["name"] for p in saved["plots"]] == [p.name for p in first]
    again, drawn = plots.update_plots(prep, folder)
    assert not drawn and [(p.name, p.summary, p.data) for p in again] == [(p.name, p.summary, p.data) for p in first]
    # a reason gone (the truncated picture is no longer quarantined): drawn again, its old sheet removed
    curate_q = prep / "curate" / "quarantine.jsonl"
    lines = curate_q.read_text().splitlines()
    (gone,) = [json.loads(line) for line in lines if "cannot decode pixels" in line]
    curate_q.write_text("".join(line + "\n" for line in lines if "cannot decode pixels" not in line))
    sheet = f"quarantine_curate-{plots.slug(gone['reason'])}.png"
    assert (folder / sheet).is_file()
    third, drawn = plots.update_plots(prep, folder)
    assert drawn and sheet not in {p.name for p in third} and not (folder / sheet).exists()
    assert len(third) == len(first) - 1


def test_a_videos_thumbnail_is_its_first_frame_or_its_clips(tmp_path):
    from fractions import Fraction

    import av

    path = tmp_path / "clip.mp4"
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]  # 3 frames each: red, green, blue
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(8))
        stream.height, stream.width, stream.pix_fmt = 64, 96, "yuv420p"
        stream.options = {"threads": "1", "crf": "1"}
        for colour in colours:
            frame = av.VideoFrame.from_ndarray(np.full((64, 96, 3), colour, np.uint8), format="rgb24")
            for _ in range(3):
                for packet in stream.encode(frame):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    for meta, colour in (({"kind": "video", "source_uri": str(path)}, colours[0]),
                         ({"kind": "video", "source_uri": str(path), "clip": {"start_frame": 6}}, colours[2])):
        thumb = np.asarray(plots.thumbnail({}, meta, side=48), np.float64)
        assert thumb.shape == (32, 48, 3)
        assert np.abs(thumb.reshape(-1, 3).mean(0) - colour).max() < 12, (meta, thumb.reshape(-1, 3).mean(0))


def test_plots_find_the_prep_folder_from_any_path_inspect_takes(prepped, tmp_path):
    from latentmill.pipelines.snapshot import resolve_snapshot

    prep = prepped / "prep"
    for path in (prepped, prep, prep / "curate", prepped / "snapshots" / "LATEST", resolve_snapshot(prepped, "latest")):
        assert plots.prep_dir_of(path) == prep, path
    with pytest.raises(FileNotFoundError, match="no prep folder"):
        plots.prep_dir_of(tmp_path)


def test_quarantined_samples_are_read_from_the_nearest_stage_that_ran(prepped, tmp_path):
    import shutil

    prep = tmp_path / "prep"
    shutil.copytree(prepped / "prep", prep, ignore=shutil.ignore_patterns("plots"))
    # the truncated picture curate could not decode, as the caption stage wrote it
    (entry,) = [json.loads(line) for line in (prep / "curate" / "quarantine.jsonl").read_text().splitlines()
                if "cannot decode pixels" in line]
    assert plots.find_samples(prep, "curate", [entry["key"]])[entry["key"]]["__key__"] == entry["key"]
    wanted = json.loads((prep / "curate" / "quarantine.jsonl").read_text().splitlines()[0])["key"]
    # a prep made before the curate stage: the bucket stage read the caption stage's shards
    shutil.rmtree(prep / "curate")
    found = plots.find_samples(prep, "bucket", [wanted])
    assert set(found) == {wanted} and json.loads(found[wanted]["json"])["key"] == wanted
