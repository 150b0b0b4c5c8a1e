"""Caption stage without models: post-processing rules, policies, the template captioner, config errors."""

from __future__ import annotations

import json

import pytest
from latentmill.stages import caption, ingest
from latentmill.stages.caption import CaptionConfig, combine
from latentmill.stages.captioners import CaptionItem, CaptionResult
from latentmill.stages.captioners.media import frame_indices
from latentmill.stages.captioners.postprocess import CaptionRules, Cleaned
from latentmill.stages.captioners.template import TemplateCaptioner
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard

from latentmill.core.config import ConfigError, from_dict


def _run(cfg, upstream, root):
    sd = StageDir(root, "caption").ensure()
    records = [sd.run_unit(u, lambda unit, out: caption.process(cfg, unit, out)) for u in caption.plan(cfg, upstream)]
    sd.write_manifest(records, caption.manifest_header(cfg))
    samples = [json.loads(s["json"]) | {"_txt": s["txt"].decode()}
               for r in records for shard in r.shards for s in read_shard(sd.root / shard.path)]
    return records, {m["source"]: m for m in samples}


@pytest.fixture()
def ingested(demo_images, tmp_path):
    """The demo images in a folder tree (style/ and photos/), img_004 without a caption, ingested."""
    (demo_images / "style").mkdir()
    (demo_images / "photos").mkdir()
    for name in ("img_000.png", "img_000.txt", "img_001.jpg", "img_001.txt"):
        (demo_images / name).rename(demo_images / "style" / name)
    for name in ("img_002.jpg", "img_002.txt"):
        (demo_images / name).rename(demo_images / "photos" / name)
    (demo_images / "img_004.txt").unlink()
    (demo_images / "broken.jpg").unlink()
    (demo_images / "broken.txt").unlink()
    cfg = IngestConfig(source=str(demo_images), shard_size=8)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg)]
    sd.write_manifest(records, {"fingerprint": "test"})
    return demo_images, sd


# --------------------------------------------------------------------------------------------------------
# Post-processing


@pytest.mark.parametrize("raw, expected", [
    ("The image shows a red cat.", "a red cat."),
    ("  this IMAGE shows:   a cat\n on a\tmat ", "a cat on a mat"),
    ("In this image, the image shows two dogs", "two dogs"),  # repeated prefixes
    ("A picture of a dog", "a dog"),
    ("A pictures of a dog", "A pictures of a dog"),  # only at a word boundary
    ("a cat, watermark, on grass", "a cat, on grass"),  # blocklisted phrase deleted, separators tidied
    ("Watermark a cat", "a cat"),
    ("watermark: The image shows a cat", "a cat"),  # a deleted phrase does not hide a prefix
    ("a cat,  ", "a cat"),
])
def test_rules_clean_captions(raw, expected):
    rules = CaptionRules(blocklist=("watermark",))
    assert rules.apply(raw) == (expected, None)


def test_rules_limits_and_rejects():
    rules = CaptionRules(max_chars=12, min_chars=4, reject=("I'm sorry",))
    assert rules.apply("a cat on a red mat") == ("a cat on a", None)  # cut on a word boundary
    assert rules.apply("abcdefghijklmnop") == ("abcdefghijkl", None)  # one overlong word is cut anyway
    assert rules.apply("cat") == ("", "caption 'cat' is shorter than caption.min_chars=4")
    assert rules.apply("   ")[1] == "empty caption"
    assert rules.apply(None)[1] == "empty caption"
    assert "rejected phrase" in rules.apply("I'm sorry, I can't")[1]
    assert rules.apply("The image shows")[1] == "empty caption"  # nothing left after the prefix


def test_rules_change_the_fingerprint():
    base = CaptionConfig()
    prints = {json.dumps(caption.fingerprint(c), sort_keys=True) for c in (
        base, CaptionConfig(blocklist=["x"]), CaptionConfig(max_chars=10), CaptionConfig(strip_prefixes=[]),
        CaptionConfig(reject=["x"]), CaptionConfig(min_chars=2), CaptionConfig(policy="replace"))}
    assert len(prints) == 7
    # Settings of captioners that do not run leave it alone: changing the prompt of an unused model does not.
    assert caption.fingerprint(CaptionConfig(prompt="x", batch_size=3)) == caption.fingerprint(base)


# --------------------------------------------------------------------------------------------------------
# Policies and the template captioner


def test_combine_policies():
    old = [("a cat", {"captioner": "sidecar"})]
    new = [("tag1", {"captioner": "template"}), ("tag2", {"captioner": "template"})]
    assert [t for t, _ in combine("keep", old, new, ", ")] == ["a cat"]
    assert [t for t, _ in combine("keep", [], new, ", ")] == ["tag1", "tag2"]
    assert [t for t, _ in combine("replace", old, new, ", ")] == ["tag1", "tag2"]
    assert [t for t, _ in combine("extend", old, new, ", ")] == ["a cat", "tag1", "tag2"]
    appended = combine("append", old, new[:1], " | ")
    assert appended == [("a cat | tag1", {"captioner": "template", "appended_to": {"captioner": "sidecar"}})]
    assert [t for t, _ in combine("append", old, [], ", ")] == ["a cat"]
    assert [t for t, _ in combine("append", [], new, ", ")] == ["tag1", "tag2"]


def test_template_fields():
    meta = {"source": "style/sub/img_7.png", "width": 64, "height": 32, "kind": "image", "tags": ["red", "flat"]}
    item = CaptionItem("k", meta, {}, existing=["a cat", "a feline"])
    templates = ["trtcrd, {caption}", "{folder}|{folders}|{name}|{filename}|{ext}|{width}x{height}|{tags}"]
    (result,) = TemplateCaptioner(templates).caption([item])
    assert result.texts == ["trtcrd, a cat", "trtcrd, a feline", "sub|style/sub|img_7|img_7.png|png|64x32|red, flat"]
    assert result.provenance[0] == {"captioner": "template", "template": "trtcrd, {caption}"}
    with pytest.raises(KeyError, match=r"field \{nope\} is not in the metadata of style/sub/img_7.png"):
        TemplateCaptioner(["{nope}"]).caption([item])


def test_template_trigger_token_stage(ingested, tmp_path):
    images, upstream = ingested
    cfg = CaptionConfig(captioner="template", template="trtcrd, {caption}", policy="replace")
    records, metas = _run(cfg, upstream, tmp_path / "caption")
    assert sum(r.samples_out for r in records) == 25 and not any(r.quarantined for r in records)
    sidecar = (images / "style" / "img_001.txt").read_text().strip()
    assert metas["style/img_001.jpg"]["caption"] == f"trtcrd, {sidecar}" == metas["style/img_001.jpg"]["_txt"]
    assert metas["img_004.jpg"]["captions"] == ["trtcrd"]  # no existing caption: the trigger alone
    prov = metas["style/img_001.jpg"]["caption_provenance"]
    assert prov == [{"captioner": "template", "template": "trtcrd, {caption}", "policy": "replace"}]


def test_template_append_and_keep(ingested, tmp_path):
    _, upstream = ingested
    append = CaptionConfig(captioner="template", template="{folder}", policy="append", separator=", style ")
    _, metas = _run(append, upstream, tmp_path / "append")
    assert metas["style/img_000.png"]["caption"].endswith(", style style")
    assert metas["photos/img_002.jpg"]["caption"].endswith(", style photos")
    # Top-level files have no folder: nothing to append, the caption stays; img_004 had none: quarantined.
    assert metas["img_003.png"]["caption"] == metas["img_003.png"]["sidecar_caption"]
    assert "img_004.jpg" not in metas

    keep = CaptionConfig(captioner="template", template="a photo from {folder}, {name}", policy="keep")
    _, metas = _run(keep, upstream, tmp_path / "keep")
    assert metas["img_004.jpg"]["captions"] == ["a photo from, img_004"]  # only the uncaptioned sample
    assert metas["img_003.png"]["caption_provenance"][0]["captioner"] == "sidecar"
    assert metas["img_003.png"]["caption"] == metas["img_003.png"]["sidecar_caption"]

    same = CaptionConfig(captioner="template", template="{caption}", policy="extend")
    _, metas = _run(same, upstream, tmp_path / "same")
    assert metas["img_003.png"]["captions"] == [metas["img_003.png"]["sidecar_caption"]]  # no duplicates

    extend = CaptionConfig(captioner="template", template=["{name}", "{folder}"], policy="extend")
    _, metas = _run(extend, upstream, tmp_path / "extend")
    assert metas["style/img_001.jpg"]["captions"][1:] == ["img_001", "style"]
    assert metas["style/img_001.jpg"]["caption"] == metas["style/img_001.jpg"]["sidecar_caption"]
    assert [p["captioner"] for p in metas["style/img_001.jpg"]["caption_provenance"]] == [
        "sidecar", "template", "template"]


def test_missing_caption_keep_empty(ingested, tmp_path):
    _, upstream = ingested
    records, metas = _run(CaptionConfig(on_missing="keep_empty"), upstream, tmp_path / "c")
    assert metas["img_004.jpg"]["caption"] == "" and metas["img_004.jpg"]["captions"] == [""]
    assert metas["img_004.jpg"]["caption_provenance"][0]["empty"] .startswith("ingest found no caption")
    records, metas = _run(CaptionConfig(blocklist=["background"], min_chars=42), upstream, tmp_path / "q")
    reasons = {q["source"]: q["reason"] for r in records for q in r.quarantined}
    # "a blue stripes on a green background, square picture" loses "background": 41 characters left.
    assert "'a blue stripes on a green, square picture' is shorter than caption.min_chars=42" in reasons["img_005.jpg"]
    assert metas and not any("background" in m["caption"] for m in metas.values())
    assert reasons["img_004.jpg"].startswith("no caption from captioner 'sidecar'")


def test_rerun_reuses_and_records_time_outside_the_shards(ingested, tmp_path):
    _, upstream = ingested
    cfg = CaptionConfig(captioner="template", template="{name}", policy="replace")
    first, _ = _run(cfg, upstream, tmp_path / "c")
    again, _ = _run(cfg, upstream, tmp_path / "c")
    assert all(r.reused for r in again) and [r.unit_id for r in again] == [r.unit_id for r in first]
    assert "captioned_at" in first[0].extra
    other, _ = _run(cfg, upstream, tmp_path / "other")  # a fresh run later: same bytes
    assert [s.sha256 for r in other for s in r.shards] == [s.sha256 for r in first for s in r.shards]


# --------------------------------------------------------------------------------------------------------
# Config and frame sampling


@pytest.mark.parametrize("data, message", [
    ({"captioner": "blip"}, "caption.captioner: 'blip' is not one of 'sidecar', 'transformers', 'template'"),
    ({"policy": "merge"}, "caption.policy: 'merge' is not one of 'auto', 'keep', 'replace', 'append', 'extend'"),
    ({"captioner": "transformers"}, "caption.model: must be set when caption.captioner is 'transformers'"),
    ({"captioner": "template"}, "caption.template: must be set"),
    ({"captioner": "template", "template": "{a.b}"}, "caption.template: '{a.b}': field {a.b} must be a plain"),
    ({"batch_size": 0}, "caption.batch_size: must be >= 1"),
    ({"frames": 0}, "caption.frames: must be >= 1"),
    ({"policy": "append"}, "caption.policy: 'append' needs a captioner that makes new text"),
    ({"dtype": "fp8"}, "caption.dtype: 'fp8' is not one of 'auto', 'float32', 'bfloat16', 'float16'"),
])
def test_config_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(CaptionConfig, data, prefix="caption")
    assert message in str(err.value)


def test_config_accepts_lists():
    cfg = from_dict(CaptionConfig, {"captioner": "transformers", "model": "m", "prompt": ["a", "b"],
                                    "generate_kwargs": {"repetition_penalty": 1.2}}, prefix="caption")
    assert cfg.prompts == ["a", "b"] and cfg.generate_kwargs == {"repetition_penalty": 1.2}


def test_frame_indices_cover_the_clip_window():
    assert frame_indices(100, 0, None, 4) == [12, 37, 62, 87]
    assert frame_indices(24, 4, 16, 4) == [6, 10, 14, 18]
    assert frame_indices(10, 8, 50, 2) == [8, 9]  # window cut at the end of the video
    assert frame_indices(3, 0, None, 5) == [0, 0, 1, 2, 2]  # more frames asked than there are
    with pytest.raises(ValueError, match="start_frame 30 is outside"):
        frame_indices(24, 30, None, 4)


def test_template_formats_existing_captions_by_default_and_an_explicit_keep_is_reported(ingested, tmp_path):
    images, upstream = ingested
    # The trap a user met: template + sidecar captions under policy keep changed nothing, silently.
    cfg = CaptionConfig(captioner="template", template="trtcrd, {caption}")
    assert cfg.policy == "auto" and cfg.resolved_policy == "replace"
    records, metas = _run(cfg, upstream, tmp_path / "auto")
    sidecar = (images / "style" / "img_001.txt").read_text().strip()
    assert metas["style/img_001.jpg"]["captions"] == [f"trtcrd, {sidecar}"]
    assert all(m["caption"].startswith("trtcrd") for m in metas.values())
    report = caption.report(cfg, records)
    # every caption changed, no warning; img_004 has no caption: "trtcrd, " lost its trailing separator
    assert report == {"changed": 25, "sent_to_captioner": 25, "rewritten_by_rule": {"normalise": 1}}

    keep = CaptionConfig(captioner="template", template="trtcrd, {caption}", policy="keep")
    records, metas = _run(keep, upstream, tmp_path / "keep")
    report = caption.report(keep, records)
    # img_004 (no sidecar) is the only one the captioner saw and changed: nothing to warn about.
    assert report == {"changed": 1, "sent_to_captioner": 1, "rewritten_by_rule": {"normalise": 1}}
    (images / "img_004.txt").write_text("a caption for img_004\n")
    _, upstream2 = _reingest(images, tmp_path / "ingest2")
    records, metas = _run(keep, upstream2, tmp_path / "keep2")
    assert all(not m["caption"].startswith("trtcrd") for m in metas.values())
    report = caption.report(keep, records)
    assert report["changed"] == 0 and report["sent_to_captioner"] == 0
    assert report["warning"] == (
        "captioner 'template' changed 0 of 25 captions: caption.policy is 'keep' and every sample already had a "
        "caption; set caption.policy=replace (or append, extend) to caption them with it")
    # The sidecar captioner is what keeps captions: it never warns.
    records, _ = _run(CaptionConfig(), upstream2, tmp_path / "sidecar")
    assert "warning" not in caption.report(CaptionConfig(), records)


def _reingest(images, root):
    cfg = IngestConfig(source=str(images), shard_size=8)
    sd = StageDir(root, "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg)]
    sd.write_manifest(records, {"fingerprint": "test"})
    return records, sd


def test_append_of_a_template_that_uses_the_caption_is_refused():
    with pytest.raises(ConfigError, match=r"caption.policy: 'append' with a caption.template that uses \{caption\}"):
        from_dict(CaptionConfig, {"captioner": "template", "template": "x, {caption}", "policy": "append"},
                  prefix="caption")
    assert CaptionConfig(captioner="transformers", model="m").resolved_policy == "keep"
    assert CaptionConfig(captioner="template", template="{name}", policy="extend").resolved_policy == "extend"


def test_the_run_summary_prints_the_warning(capsys):
    from latentmill.cli import _print_summary

    row = {"in": 3, "out": 3, "quarantined": 0, "processed": 3, "reused": 0, "seconds": 0.1}
    _print_summary({"stages": {"caption": {**row, "warning": "captioner 'template' changed 0 of 3 captions: x"}}},
                   None)
    assert "WARNING caption: captioner 'template' changed 0 of 3 captions: x" in capsys.readouterr().out


def test_an_empty_sidecar_is_named_in_the_reason(ingested, tmp_path):
    images, _ = ingested
    (images / "img_004.txt").write_text("  \n")
    (images / "img_006.json").write_text('{"tags": ["x"]}')
    (images / "img_006.txt").unlink()
    _, upstream = _reingest(images, tmp_path / "ingest2")
    records, _ = _run(CaptionConfig(), upstream, tmp_path / "c")
    reasons = {q["source"]: q["reason"] for r in records for q in r.quarantined}
    assert reasons["img_004.jpg"].startswith(
        "no caption from captioner 'sidecar': its caption sidecar gave no caption: img_004.txt is empty")
    assert "img_006.json has no non-empty caption field" in reasons["img_006.png"]


# --------------------------------------------------------------------------------------------------------
# Whose captions the rules rewrite, and the count of what they changed


def test_prefixes_are_stripped_from_model_captions_only():
    rules = CaptionRules()
    hand = "A picture of colourful ellipses number 1"
    assert rules.clean(hand, by_model=False) == Cleaned(hand, None, ())
    assert rules.clean(hand) == Cleaned("colourful ellipses number 1", None, ("strip_prefixes",))
    assert rules.apply(hand) == ("colourful ellipses number 1", None)  # apply: a model caption
    every = CaptionRules(strip_prefixes_from="all")  # scraped alt text: strip them everywhere
    assert every.clean(hand, by_model=False).text == "colourful ellipses number 1"
    # The other rules apply to every caption and name themselves when they change one.
    strict = CaptionRules(blocklist=("watermark",), max_chars=15)
    assert strict.clean(" a  cat,\n", by_model=False) == Cleaned("a cat", None, ("normalise",))
    assert strict.clean("A picture of a cat, watermark", by_model=False) == Cleaned(
        "A picture of a", None, ("blocklist", "max_chars"))  # "A picture of a cat" cut at 15


class _FakeModel:
    """A captioner that answers as a VLM does ("The image shows ..."), with a model's provenance."""

    name = "transformers"

    def fingerprint(self):
        return {"captioner": self.name, "model": "fake-vlm"}

    def caption(self, items):
        return [CaptionResult([f"The image shows {item.meta['source']}"], [{"captioner": self.name, "model": "fake"}])
                for item in items]

    def stats(self):
        return {}


def _hand_captioned(root):
    """Three PNGs with hand-written sidecars (two open with a prefix a VLM would write), one without, ingested."""
    from PIL import Image

    images = root / "images"
    images.mkdir(parents=True)
    captions = {"ellipses": "a picture of colourful ellipses number 1", "photo": "The photo shows a red door",
                "plain": "a blue square"}
    for i, name in enumerate([*captions, "bare"]):
        Image.new("RGB", (32, 24), (40 * i, 90, 200 - 40 * i)).save(images / f"{name}.png")
        if name in captions:
            (images / f"{name}.txt").write_text(captions[name] + "\n")
    _, upstream = _reingest(images, root / "ingest")
    return captions, upstream


def _run_with(cfg, upstream, root, captioner=None):
    sd = StageDir(root, "caption").ensure()
    records = [sd.run_unit(u, lambda unit, out: caption.process(cfg, unit, out, captioner))
               for u in caption.plan(cfg, upstream, captioner)]
    sd.write_manifest(records, caption.manifest_header(cfg, captioner))
    metas = {m["source"]: m for r in records for shard in r.shards
             for m in (json.loads(s["json"]) for s in read_shard(sd.root / shard.path))}
    return records, metas


def test_sidecar_captions_are_kept_as_written_and_model_captions_cleaned(tmp_path, capsys):
    captions, upstream = _hand_captioned(tmp_path)
    records, metas = _run_with(CaptionConfig(), upstream, tmp_path / "sidecar")
    assert {s: m["caption"] for s, m in metas.items()} == {f"{n}.png": c for n, c in captions.items()}
    assert caption.report(CaptionConfig(), records)["rewritten_by_rule"] == {}
    # The old scope, asked for: the two prefixed sidecars lose their prefix, and the summary says so.
    every = CaptionConfig(strip_prefixes_from="all")
    records, metas = _run_with(every, upstream, tmp_path / "all")
    assert metas["ellipses.png"]["caption"] == "colourful ellipses number 1"
    assert metas["photo.png"]["caption"] == "a red door"
    assert caption.report(every, records)["rewritten_by_rule"] == {"strip_prefixes": 2}

    # A model caption loses its boilerplate; appended to a sidecar, only the model's part does.
    model = CaptionConfig(captioner="transformers", model="fake", policy="append")
    records, metas = _run_with(model, upstream, tmp_path / "model", _FakeModel())
    assert metas["ellipses.png"]["captions"] == ["a picture of colourful ellipses number 1, ellipses.png"]
    assert metas["bare.png"]["captions"] == ["bare.png"]
    prov = metas["photo.png"]["caption_provenance"][0]
    assert prov == {"captioner": "transformers", "model": "fake", "policy": "append",
                    "appended_to": {"captioner": "sidecar", "origin": "sidecar:photo.txt"}}  # no rule bookkeeping
    report = caption.report(model, records)
    assert report["rewritten_by_rule"] == {"strip_prefixes": 4}  # every model caption, once each

    from latentmill.cli import _print_summary
    from latentmill.inspect import inspect_path

    row = {"in": 4, "out": 4, "quarantined": 0, "processed": 4, "reused": 0, "seconds": 0.1}
    _print_summary({"stages": {"caption": {**row, **report}}}, None)
    assert "caption: rewritten by rule: strip_prefixes 4" in capsys.readouterr().out
    inspect_path(tmp_path / "model")
    assert "captions rewritten by rule: strip_prefixes 4" in capsys.readouterr().out


def test_the_scope_of_the_rules_is_in_the_fingerprint(tmp_path):
    base = caption.fingerprint(CaptionConfig())
    assert base["rules"]["version"] == 2  # v1 stripped sidecars: its caption units are not reused
    assert caption.fingerprint(CaptionConfig(strip_prefixes_from="all")) != base
    with pytest.raises(ConfigError, match="caption.strip_prefixes_from: 'some' is not one of 'model', 'all'"):
        from_dict(CaptionConfig, {"strip_prefixes_from": "some"}, prefix="caption")
