"""Where a cache was encoded: the device class and library versions in each unit record and in the manifest,
a refresh on another device class shown as such (manifest, run summary, ``latentmill inspect``), and the
deterministic mode the encoders run in on CUDA (set while encoding, restored after).

A second machine class is played with ``LATENTMILL_DEVICE_CLASS`` (``latentmill.stages.families``): it
replaces the class this process reports, nothing else.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from latentmill.stages import cache
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache import UNKNOWN_DEVICE, CacheConfig, encoded_on_total
from latentmill.stages.families import (
    DETERMINISTIC,
    DEVICE_CLASS_ENV,
    deterministic_encoding,
    deterministic_flags,
    device_description,
    encoded_on_key,
    get_encoders,
)
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir, UnitRecord

from latentmill.models import ModelConfig
from latentmill.recipe import Recipe
from tests.conftest import DEMO_IMAGES
from tests.helpers import prep_in_process

pytestmark = pytest.mark.slow  # four small preps on the tiny models (~25 s on 2 cores)

AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse2 avx fma avx2 bmi2

processor\t: 1
vendor_id\t: AuthenticAMD
"""
INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8
"""


def _images(dst, names):
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        for path in DEMO_IMAGES.glob(f"{name}.*"):  # the image (.png or .jpg) and its caption
            shutil.copy(path, dst / path.name)
    return dst


def _recipe(src, root, model, **cache_kw):
    return Recipe(output_dir=str(root), model=model, ingest=IngestConfig(source=str(src), shard_size=4),
                  bucket=BucketConfig(resolution=64, aspect_ratios=[1.0]),
                  cache=CacheConfig(dtype="float32", batch_size=4, max_sequence_length=16, **cache_kw))


def test_cpu_identity_names_vendor_and_isa():
    amd = device_description(torch.device("cpu"), cpuinfo=AMD)
    intel = device_description(torch.device("cpu"), cpuinfo=INTEL)
    assert (amd["vendor"], amd["model"], amd["isa"]) == ("AuthenticAMD", "AMD EPYC 7763 64-Core Processor",
                                                         ["avx2", "fma"])
    assert intel["isa"] == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                            "amx_int8"]
    assert amd["class"].startswith("cpu AuthenticAMD ") and amd["class"].endswith("[avx2 fma]")
    assert amd["class"] != intel["class"]  # the EPYC vs Xeon demo snapshots of issue 19 would not mix silently
    assert amd["torch"] == torch.__version__ and "cudnn" not in amd
    assert encoded_on_key(amd) == f"{amd['class']} | torch {torch.__version__}"
    assert encoded_on_key({"class": "cuda NVIDIA H100 sm_90", "torch": "2.13.0+cu126", "cudnn": 91002}) == \
        "cuda NVIDIA H100 sm_90 | torch 2.13.0+cu126 | cudnn 91002"


def test_deterministic_encoding_sets_every_flag_and_restores_them(monkeypatch):
    before = deterministic_flags()
    torch.backends.cudnn.benchmark = True  # a trainer's setting that the cache stage must leave as it found
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        changed = deterministic_flags()
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        with deterministic_encoding(True) as on:
            assert on is True and deterministic_flags() == DETERMINISTIC
            with deterministic_encoding(True):  # a second unit in another thread of the same worker
                assert deterministic_flags() == DETERMINISTIC
            assert deterministic_flags() == DETERMINISTIC  # the inner exit did not restore early
        assert deterministic_flags() == changed
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # CUDA not initialised yet: set in time
        with deterministic_encoding(False) as on:
            assert on is False and deterministic_flags() == changed
        with pytest.raises(RuntimeError), deterministic_encoding(True):
            raise RuntimeError("an encoder failed")
        assert deterministic_flags() == changed  # restored on the way out of an error too
    finally:
        torch.backends.cudnn.benchmark = before["cudnn_benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = before["matmul_tf32"]
        torch.set_float32_matmul_precision(before["float32_matmul_precision"])


def _watch_encoders(model):
    """Forward pre-hooks on the real encoders the cache stage uses: the flags each forward call ran with."""
    enc = get_encoders(model, "flux", torch.device("cpu"))
    seen: list[dict] = []
    handles = [m.register_forward_pre_hook(lambda *_: seen.append(deterministic_flags()))
               for m in (enc.vae.encoder, enc.text_encoder, enc.text_encoder_2)]
    return seen, handles


@pytest.mark.parametrize("mode", [True, "auto"])
def test_cache_stage_encodes_in_deterministic_mode_when_asked(mode, tiny_flux, tmp_path):
    model = ModelConfig(pretrained=str(tiny_flux))
    before = deterministic_flags()
    seen, handles = _watch_encoders(model)
    try:
        prep_in_process(_recipe(_images(tmp_path / "src", ["img_000", "img_001"]), tmp_path / "out", model,
                                deterministic=mode))
    finally:
        for h in handles:
            h.remove()
    # the VAE encoder, CLIP and T5 for the samples' batch, CLIP and T5 for the empty prompt
    assert len(seen) >= 5
    if mode is True:
        assert all(flags == DETERMINISTIC for flags in seen)
    else:  # auto: deterministic on CUDA only; this CPU run leaves every setting as it was
        assert all(flags == before for flags in seen)
    assert deterministic_flags() == before  # restored: a training in this process keeps its own settings


def test_device_class_in_records_manifest_and_a_refresh_from_another_class(tiny_flux, tmp_path, monkeypatch,
                                                                           capsys):
    model = ModelConfig(pretrained=str(tiny_flux))
    src = _images(tmp_path / "src", [f"img_{i:03d}" for i in range(4)])
    recipe = _recipe(src, tmp_path / "out", model, shard_bytes=1 << 30)  # one cache unit: a refresh re-runs it
    monkeypatch.setenv(DEVICE_CLASS_ENV, "cpu machine-A")
    sd, manifest, records = prep_in_process(recipe)["cache"]
    here = device_description(torch.device("cpu"))
    key_a = encoded_on_key({**here, "class": "cpu machine-A"})
    (record,) = records
    assert record.extra["device"]["class"] == "cpu machine-A" and record.extra["device"]["key"] == key_a
    assert record.extra["device"]["torch"] == torch.__version__
    assert record.extra["device"]["vendor"] == here["vendor"] and record.extra["device"]["deterministic"] is False
    assert record.extra["encoded_on"] == {key_a: {"vae": 4, "text": 4}} and "foreign" not in record.extra
    assert manifest["encoded_on"] == {key_a: {"vae": 4, "text": 4}}
    assert manifest["format_version"] == 3  # unchanged
    assert "warning" not in cache.component_report(records)

    # the cache moves to machine B, which adds 2 images: a new unit encodes them there, A's unit is reused
    _images(src, ["img_004", "img_005"])
    monkeypatch.setenv(DEVICE_CLASS_ENV, "cpu machine-B")
    key_b = encoded_on_key({**here, "class": "cpu machine-B"})
    sd, manifest, records = prep_in_process(recipe)["cache"]
    assert sorted(r.reused for r in records) == [False, True]
    assert manifest["encoded_on"] == {key_a: {"vae": 4, "text": 4}, key_b: {"vae": 2, "text": 2}}
    report = cache.component_report(records)
    assert report["encoded_on"] == manifest["encoded_on"]
    assert report["warning"].startswith("mixed device classes: ")
    assert key_a in report["warning"] and key_b in report["warning"]
    capsys.readouterr()
    from latentmill.inspect import inspect_path

    assert inspect_path(sd.root) == 0
    shown = capsys.readouterr().out
    assert f"encoded on {key_a}: vae 4, text 4" in shown and f"encoded on {key_b}: vae 2, text 2" in shown
    assert "WARNING mixed device classes: " in shown

    # on machine C with nothing new, every unit is reused whole: the provenance is the records', not C's
    monkeypatch.setenv(DEVICE_CLASS_ENV, "cpu machine-C")
    sd, again, records = prep_in_process(recipe)["cache"]
    assert all(r.reused for r in records) and again["encoded_on"] == manifest["encoded_on"]

    # C changes one caption of A's unit: the unit re-runs on C, copies A's 4 latents and 3 embeddings (still
    # counted as A's) and encodes 1 embedding
    (src / "img_000.txt").write_text("a changed caption")
    key_c = encoded_on_key({**here, "class": "cpu machine-C"})
    sd, manifest, records = prep_in_process(recipe)["cache"]
    (rerun,) = [r for r in records if not r.reused]
    assert rerun.extra["counts"] == {"vae": {"encoded": 0, "reused": 4}, "text": {"encoded": 1, "reused": 3}}
    assert rerun.extra["encoded_on"] == {key_a: {"vae": 4, "text": 3}, key_c: {"vae": 0, "text": 1}}
    assert set(rerun.extra["foreign"].values()) == {key_a} and len(rerun.extra["foreign"]) == 7
    assert manifest["encoded_on"] == {key_a: {"vae": 4, "text": 3}, key_b: {"vae": 2, "text": 2},
                                      key_c: {"vae": 0, "text": 1}}


def test_records_written_before_the_field_count_as_unknown():
    old = UnitRecord("u1", "cache", [], [], [], 3, 0.1, extra={"counts": {"vae": {"encoded": 3, "reused": 0},
                                                                          "text": {"encoded": 2, "reused": 1}}})
    new = UnitRecord("u2", "cache", [], [], [], 1, 0.1, extra={"encoded_on": {"cpu x | torch 2": {"vae": 1,
                                                                                                  "text": 1}}})
    assert encoded_on_total([old, new]) == {"cpu x | torch 2": {"vae": 1, "text": 1},
                                            UNKNOWN_DEVICE: {"vae": 3, "text": 3}}
    assert cache.mixed_devices_warning(encoded_on_total([old, new])) is None  # unknown is not a second class
    assert json.loads(json.dumps(encoded_on_total([old])))  # plain JSON for the manifest


def test_merged_origins_keep_each_components_device(tmp_path):
    a = UnitRecord("a", "cache", [], [], [], 1, 0.1, extra={
        "device": {"class": "A", "key": "A | torch 2"}, "components": {"s1": {"vae": "v1", "text": ["t1"]}},
        "encoded_on": {"A | torch 2": {"vae": 1, "text": 1}}})
    b = UnitRecord("b", "cache", [], [], [], 1, 0.1, extra={
        "device": {"class": "B", "key": "B | torch 2"}, "components": {"s2": {"vae": "v2", "text": ["t2"]}},
        "foreign": {"t2": "A | torch 2"},
        "encoded_on": {"A | torch 2": {"vae": 0, "text": 1}, "B | torch 2": {"vae": 1, "text": 0}}})
    merged = cache.merged_origins(StageDir(tmp_path, "cache"), [a, b])  # records of before detail files
    assert merged["device"]["key"] == "A | torch 2" and merged["foreign"] == {"v2": "B | torch 2"}
    assert merged["encoded_on"] == {"A | torch 2": {"vae": 1, "text": 2}, "B | torch 2": {"vae": 1, "text": 0}}
    assert cache.merged_origins(StageDir(tmp_path, "cache"), [UnitRecord("c", "cache", [], [], [], 1, 0.1)]) \
        == {}
