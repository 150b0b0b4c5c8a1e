"""The decoding rules (stages.pixels): pixels as a viewer shows them, checked against reference conversions.

Every test image is generated here: EXIF orientations, 16-bit PNG and TIFF, alpha, palettes with a
transparent entry, ICC profiles written byte by byte (tests/icc.py), every accepted still format, a
multi-page TIFF and an animated GIF.
"""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from latentmill.stages import bucket, ingest, pixels
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache import CacheConfig, CachePlan, decode_sample, load_pixels
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from PIL import Image

from latentmill.core.hashing import stable_hash
from tests import icc


def _rgb(data: bytes, **kw) -> np.ndarray:
    return np.asarray(pixels.decode_rgb(data, **kw)).astype(np.int32)


def _save(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# What each EXIF orientation asks a viewer to do to the stored pixels (numpy, independent of Pillow).
SHOWN = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),
    8: lambda a: np.rot90(a, 1),
}


def _with_orientation(arr: np.ndarray, value: int, fmt: str = "PNG") -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return _save(Image.fromarray(arr), fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))


@pytest.mark.parametrize("value", range(1, 9))
def test_each_exif_orientation_is_shown_as_a_viewer_shows_it(value):
    stored = _noise(20, 60)  # stored 60 wide, 20 high
    data = _with_orientation(stored, value)
    expected = SHOWN[value](stored)
    assert np.array_equal(_rgb(data), expected)
    with pixels.open_image(data) as img:
        facts = pixels.header(img)
    assert (facts["width"], facts["height"]) == (expected.shape[1], expected.shape[0])
    assert facts["orientation"] == value
    assert pixels.pixel_rules({"kind": "image", **facts}, (255, 255, 255)) == (
        {} if value == 1 else {"rules": pixels.RULES_VERSION, "orientation": value})


def _stage(module, cfg, root, name, units):
    sd = StageDir(root / name, name).ensure()
    records = [sd.run_unit(u, lambda unit, out: module.process(cfg, unit, out)) for u in units]
    sd.write_manifest(records, {"fingerprint": "test"})
    return sd, records


def test_a_phone_photo_with_orientation_6_is_ingested_bucketed_and_decoded_upright(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    stored = np.zeros((200, 600, 3), np.uint8)
    stored[:, :300] = (220, 30, 30)  # left half red when stored: the top half once shown upright
    stored[:, 300:] = (30, 30, 220)
    (src / "phone.jpg").write_bytes(_with_orientation(stored, 6, "JPEG"))
    (src / "phone.txt").write_text("a photo")
    icfg = IngestConfig(source=str(src))
    ing, _ = _stage(ingest, icfg, tmp_path, "ingest", ingest.plan(icfg))
    bcfg = BucketConfig(resolutions=[128])
    bkt, _ = _stage(bucket, bcfg, tmp_path, "bucket", bucket.plan(bcfg, ing))
    [sample] = [s for shard in bkt.read_manifest()["shards"] for s in read_shard(bkt.root / shard["path"])]
    meta = json.loads(sample["json"])
    assert (meta["width"], meta["height"], meta["orientation"]) == (200, 600, 6)
    width, height = meta["bucket"][:2]
    assert height > width  # portrait, as shown (a landscape bucket would be 176x96)
    got = decode_sample(sample, meta)
    assert got.shape == (3, height, width)
    # The reference: Pillow's plain decode of the same bytes, turned upright by numpy, resized and cropped.
    upright = np.ascontiguousarray(np.rot90(np.asarray(Image.open(io.BytesIO(sample["image"])).convert("RGB")), -1))
    crop = meta["crop"]
    ref = Image.fromarray(upright).resize((crop["resize_width"], crop["resize_height"]), Image.Resampling.LANCZOS)
    ref = ref.crop((crop["left"], crop["top"], crop["left"] + width, crop["top"] + height))
    ref_t = torch.from_numpy(np.asarray(ref).copy()).permute(2, 0, 1).float().div(127.5).sub(1.0)
    assert torch.equal(got, ref_t)
    assert got[0, : height // 3].mean() > 0.5 and got[2, -height // 3:].mean() > 0.5  # red on top, blue below


def _png16(values: np.ndarray) -> bytes:
    """A 16-bit PNG (grey when 2-D, RGB when 3-D), written by hand: Pillow cannot write 16-bit RGB."""
    height, width = values.shape[:2]
    colour = 2 if values.ndim == 3 else 0
    raw = b"".join(b"\0" + values[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, colour, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _tiff16_rgb(values: np.ndarray) -> bytes:
    """An uncompressed 16-bit RGB TIFF, written by hand (little-endian, one strip)."""
    height, width, _ = values.shape
    pixels_ = values.astype("<u2").tobytes()
    bits_at = 8 + 2 + 12 * 10 + 4  # after the header and the 10-entry IFD
    entries = [(256, 3, 1, width), (257, 3, 1, height), (258, 3, 3, bits_at), (259, 3, 1, 1),
               (262, 3, 1, 2), (273, 4, 1, bits_at + 6), (277, 3, 1, 3), (278, 3, 1, height),
               (279, 4, 1, len(pixels_)), (284, 3, 1, 1)]
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHI", tag, kind, count) + (struct.pack("<HH", value, 0) if kind == 3 and count == 1
                                                 else struct.pack("<I", value))
        for tag, kind, count, value in entries) + struct.pack("<I", 0)
    return b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack("<3H", 16, 16, 16) + pixels_


def test_16_bit_grey_is_scaled_not_clipped():
    flat = _png16(np.full((4, 5), 40000, np.uint16))
    assert (_rgb(flat) == 156).all()  # round(40000 / 257); convert("RGB") gave 255
    ramp = np.arange(0, 65536, 3277, dtype=np.uint16)[:20].reshape(4, 5)
    expected = np.rint(ramp / 257.0).astype(np.int32)
    for data in (_png16(ramp), _save(Image.fromarray(ramp), "TIFF")):
        got = _rgb(data)
        assert np.array_equal(got[..., 0], expected) and np.array_equal(got[..., 1], got[..., 2])


def test_16_bit_rgb_png_and_tiff_are_scaled_to_8_bits():
    values = np.random.default_rng(1).integers(0, 65536, (6, 7, 3), dtype=np.uint16)
    values[0, 0] = (40000, 65535, 0)
    expected = values / 257.0
    for data in (_png16(values), _tiff16_rgb(values)):
        got = _rgb(data)
        assert np.abs(got - expected).max() <= 1.0  # Pillow keeps the high byte: within one level of v/257
        assert tuple(got[0, 0]) == (156, 255, 0)


def test_alpha_is_composited_over_the_background():
    rgb = _noise(8, 8, seed=2)
    alpha = np.tile(np.linspace(0, 255, 8).round().astype(np.uint8), (8, 1))
    data = _save(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"))
    a = alpha[..., None] / 255.0
    for background in ((255, 255, 255), (0, 0, 0), (10, 200, 30)):
        expected = rgb * a + np.array(background) * (1 - a)
        assert np.abs(_rgb(data, background=background) - expected).max() <= 1.0
    # LA: grey with alpha
    grey = rgb[..., 0]
    got = _rgb(_save(Image.fromarray(np.dstack([grey, alpha]), "LA")))
    assert np.abs(got[..., 1] - (grey * a[..., 0] + 255 * (1 - a[..., 0]))).max() <= 1.0


def test_palette_and_colour_key_transparency_show_the_background():
    palette_img = Image.new("P", (6, 4), 1)
    palette_img.putpalette([0, 0, 0, 200, 10, 10] + [0] * (254 * 3))
    palette_img.paste(0, (0, 0, 3, 4))  # left half: palette entry 0, declared transparent
    for fmt in ("PNG", "GIF"):
        got = _rgb(_save(palette_img, fmt, transparency=0), background=(0, 120, 255))
        assert (got[:, :3] == (0, 120, 255)).all() and (got[:, 3:] == (200, 10, 10)).all()
    keyed = Image.new("RGB", (4, 4), (5, 6, 7))
    keyed.paste((90, 90, 90), (0, 0, 2, 4))
    got = _rgb(_save(keyed, "PNG", transparency=(5, 6, 7)))  # a transparent colour (tRNS), no alpha channel
    assert (got[:, 2:] == 255).all() and (got[:, :2] == 90).all()


@pytest.mark.parametrize("primaries, gamma, name", [(icc.DISPLAY_P3, 2.2, "Display P3 (gamma 2.2)"),
                                                    (icc.ADOBE_RGB, 563 / 256, "Adobe RGB (1998)")])
def test_an_rgb_profile_is_converted_to_srgb(primaries, gamma, name):
    values = np.random.default_rng(3).integers(30, 226, (10, 10, 3), dtype=np.uint8)
    profile = icc.matrix_profile(primaries, gamma, name)
    data = _save(Image.fromarray(values), "PNG", icc_profile=profile)
    expected = icc.matrix_to_srgb(values.astype(np.float64), primaries, gamma)
    got = _rgb(data)
    assert np.abs(got - expected).max() <= 1.5
    assert np.abs(values.astype(np.int32) - expected).max() > 40  # naive decoding is far off
    with pixels.open_image(data) as img:
        assert pixels.header(img)["color_profile"] == name
    # The same bytes as a JPEG: within JPEG's loss of the reference of its own decoded values.
    jpeg = _save(Image.fromarray(values), "JPEG", quality=100, icc_profile=profile)
    stored = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")).astype(np.float64)
    assert np.abs(_rgb(jpeg) - icc.matrix_to_srgb(stored, primaries, gamma)).max() <= 1.5


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF"])
def test_cmyk_with_a_profile_is_converted_through_it(fmt):
    # Pillow writes CMYK JPEGs in Adobe's inverted convention (APP14) and reads them back, so the JPEG case
    # is an inverted-CMYK JPEG with an embedded print profile.
    inks = np.random.default_rng(4).integers(0, 150, (12, 12, 4), dtype=np.uint8)
    data = _save(Image.fromarray(inks, "CMYK"), fmt, icc_profile=icc.cmyk_profile(), quality=100)
    with Image.open(io.BytesIO(data)) as img:
        stored = np.asarray(img).astype(np.float64)  # what the file holds, after JPEG's loss
        naive = np.asarray(img.convert("RGB")).astype(np.int32)
        assert fmt != "JPEG" or img.info.get("adobe") is not None
    got = _rgb(data)
    assert np.abs(got - icc.cmyk_to_srgb(stored)).max() <= 2.5
    assert np.abs(got - naive).max() > 40


def test_cmyk_without_a_profile_and_unreadable_profiles_fall_back_to_plain_conversion():
    inks = np.random.default_rng(5).integers(0, 256, (8, 8, 4), dtype=np.uint8)
    data = _save(Image.fromarray(inks, "CMYK"), "TIFF")
    assert np.array_equal(_rgb(data), np.asarray(Image.fromarray(inks, "CMYK").convert("RGB")))
    values = _noise(6, 6, seed=6)
    broken = _save(Image.fromarray(values), "PNG", icc_profile=b"not a profile at all" * 8)
    assert np.array_equal(_rgb(broken), values)
    with pixels.open_image(broken) as img:
        facts = pixels.header(img)
    assert facts["color_profile"].startswith("unreadable")
    assert "icc" not in pixels.pixel_rules({"kind": "image", **facts}, (255, 255, 255))


def _formats() -> list[tuple[str, str]]:
    return sorted(pixels.IMAGE_EXTENSIONS.items())


def test_every_accepted_extension_is_a_format_pillow_decodes_here():
    pixels.register_plugins()
    registered = Image.registered_extensions()
    Image.init()
    for ext, fmt in _formats():
        assert registered.get(ext) == fmt, ext
        assert fmt in Image.OPEN, fmt


WRITE = {".pgm": "L", ".pbm": "1"}


def test_every_writable_format_is_ingested_and_decoded(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    colour = (200, 60, 20)
    for ext, fmt in _formats():
        if fmt == "PSD":  # Pillow reads PSD but cannot write it
            continue
        img = Image.new("RGB", (40, 30), colour)
        if ext in WRITE:
            img = img.convert(WRITE[ext])
        pixels.register_plugins()
        img.save(src / f"x{ext}", fmt)
    cfg = IngestConfig(source=str(src))
    sd, records = _stage(ingest, cfg, tmp_path, "ingest", ingest.plan(cfg))
    assert [q for r in records for q in r.quarantined] == []
    samples = {json.loads(s["json"])["source"]: s for shard in sd.read_manifest()["shards"]
               for s in read_shard(sd.root / shard["path"])}
    assert len(samples) == len(_formats()) - 1
    for name, sample in samples.items():
        meta = json.loads(sample["json"])
        assert set(sample) == {"__key__", "json", "image"}
        assert sample["image"] == (src / name).read_bytes()  # the original bytes, never re-encoded
        got = _rgb(sample["image"])
        ext = "." + name.split(".")[-1]
        if ext not in WRITE:
            assert np.abs(got[5, 5] - colour).max() <= 4, name  # lossy formats within a few levels
        assert (meta["width"], meta["height"]) == ((24, 18) if ext == ".ico" else (40, 30)), name


def test_multi_page_tiff_and_animated_gif_use_their_first_page(tmp_path):
    first, second = Image.new("RGB", (8, 8), (250, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 250))
    tiff = _save(first, "TIFF", save_all=True, append_images=[second])
    gif = _save(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    webp = _save(first, "WEBP", save_all=True, append_images=[second], lossless=True)
    apng = _save(first, "PNG", save_all=True, append_images=[second])
    for data in (tiff, gif, webp, apng):
        assert (_rgb(data)[..., 0] > 240).all()
        with pixels.open_image(data) as img:
            facts = pixels.header(img)
        assert facts["pages"] == 2
        assert pixels.pixel_rules({"kind": "image", **facts}, (255, 255, 255))["pages"] == "first"


def test_the_latent_key_changes_only_for_images_the_rules_change():
    plan = CachePlan("flux", {}, "vae-fp", "text-fp", (255, 255, 255))
    black = CachePlan("flux", {}, "vae-fp", "text-fp", (0, 0, 0))
    base = {"kind": "image", "sha256": "s", "bucket": [64, 64, 1], "crop": {"left": 0}}
    plain = {**base, "mode": "RGB", "orientation": 1, "alpha": False, "color_profile": None, "pages": 1}
    # A plain image keeps the key caches made before the rules existed (so they stay valid).
    legacy = stable_hash(["vae-fp", "s", None, [64, 64, 1], {"left": 0}])
    assert plan.vae_key(plain) == plan.vae_key(base) == legacy == black.vae_key(plain)
    rotated, transparent = {**plain, "orientation": 6}, {**plain, "mode": "RGBA", "alpha": True}
    assert plan.vae_key(rotated) != legacy and plan.vae_key(rotated) == black.vae_key(rotated)
    assert len({plan.vae_key(transparent), black.vae_key(transparent), legacy}) == 3
    assert plan.vae_key({**plain, "mode": "I;16"}) != legacy
    assert plan.fingerprint() != black.fingerprint()


def test_alpha_background_is_validated_and_reaches_the_pixels():
    from latentmill.core.config import ConfigError, from_dict

    assert CacheConfig(alpha_background="#102030").background == (16, 32, 48)
    with pytest.raises(ConfigError, match=r"cache.alpha_background: 'nope' is not a colour"):
        from_dict(CacheConfig, {"alpha_background": "nope"}, prefix="cache")
    data = _save(Image.new("RGBA", (16, 16), (0, 0, 0, 0)))
    crop = {"resize_width": 16, "resize_height": 16, "left": 0, "top": 0}
    white = load_pixels(data, crop, [16, 16, 1])
    black = load_pixels(data, crop, [16, 16, 1], background=(0, 0, 0))
    assert torch.equal(white, torch.ones(3, 16, 16)) and torch.equal(black, -torch.ones(3, 16, 16))
