"""Still images as a viewer shows them: the decoding rules every stage that looks at pixels follows.

A file's bytes become 8-bit sRGB pixels in the orientation a viewer shows:

* **Formats.** Every still format in :data:`IMAGE_EXTENSIONS` (Pillow's own decoders, HEIC/HEIF through
  ``pillow-heif``). A multi-page file (TIFF) gives its first page; an animated GIF, WebP or PNG gives its
  first frame, as a still (ingest records ``pages``, the count of pages or frames). Videos are read by :mod:`latentmill.stages.video`.
* **Orientation.** The EXIF orientation tag (1–8) is applied: a phone photo stored 600×200 with tag 6 is
  200×600 everywhere (ingest's ``width``/``height``, the bucket, the pixels).
* **Bit depth.** 16-bit samples are scaled to 8 bits (``value / 257``, rounded), never clipped; 32-bit
  integer samples are read as 16-bit values; floating-point samples as 0..1.
* **Colour.** An embedded ICC profile (Display P3, Adobe RGB, CMYK print profiles, grey) is converted to
  sRGB through LittleCMS (Pillow's ``ImageCms``), relative colorimetric intent. CMYK without a profile and
  Adobe's inverted CMYK JPEGs are converted by Pillow. A profile that cannot be read is ignored (ingest
  records it in ``color_profile``).
* **Transparency.** Alpha (RGBA, LA, palette or grey/RGB with a transparent colour) is composited over
  ``cache.alpha_background`` (white by default), in sRGB, as a viewer does on a plain page.

:func:`pixel_rules` says which of these rules change a sample's pixels from a plain ``convert("RGB")``; the
cache stage folds that into the sample's latent key, so caches of plain images stay valid across the
rules' introduction and a changed background re-encodes only the images with alpha.
"""

from __future__ import annotations

import io
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image, ImageColor, ImageOps

RULES_VERSION = 1
WHITE = (255, 255, 255)  # cache.alpha_background's default
# Every still format accepted by ingest: extension -> Pillow format (all decodable here; tests check it).
IMAGE_EXTENSIONS = {
    ".jpg": "JPEG", ".jpeg": "JPEG", ".jpe": "JPEG", ".jfif": "JPEG",
    ".png": "PNG", ".apng": "PNG",
    ".webp": "WEBP", ".gif": "GIF", ".bmp": "BMP", ".dib": "DIB",
    ".tif": "TIFF", ".tiff": "TIFF",
    ".heic": "HEIF", ".heif": "HEIF", ".avif": "AVIF",
    ".jp2": "JPEG2000", ".j2k": "JPEG2000", ".jpx": "JPEG2000",
    ".tga": "TGA", ".ppm": "PPM", ".pgm": "PPM", ".pbm": "PPM", ".pnm": "PPM",
    ".qoi": "QOI", ".sgi": "SGI", ".pcx": "PCX", ".psd": "PSD", ".dds": "DDS", ".ico": "ICO",
}
# Every still image is stored in an intermediate shard under this one member, whatever its format (the
# original bytes; the format is in the sample's JSON), so every sample of a shard has the same members and
# the shards load in Hugging Face ``datasets`` as well as in ``webdataset``.
IMAGE_MEMBER = "image"
LEGACY_IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "bmp")  # shards written before the one member
SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
# Modes whose plain convert("RGB") is what these rules give when there is no profile, alpha or rotation.
PLAIN_MODES = {"RGB", "L", "P", "1", "CMYK", "YCbCr"}
_ICC_SPACES = {"RGB": "RGB", "CMYK": "CMYK", "GRAY": "L"}


def register_plugins() -> None:
    """Teach Pillow the formats that need a plugin (HEIC/HEIF through pillow-heif); idempotent."""
    _register()


@lru_cache(maxsize=1)
def _register() -> bool:
    try:
        from pillow_heif import register_heif_opener
    except ImportError:  # HEIC then stays unreadable and is quarantined with Pillow's reason
        return False
    register_heif_opener()
    return True


def image_member(sample: dict[str, Any]) -> str | None:
    """The member of ``sample`` that holds its still image's bytes, or None."""
    if IMAGE_MEMBER in sample:
        return IMAGE_MEMBER
    return next((m for m in LEGACY_IMAGE_MEMBERS if m in sample), None)


def parse_background(value: str) -> tuple[int, int, int]:
    """An RGB triple from a colour name or ``#rrggbb`` (ValueError when it is not a colour)."""
    return ImageColor.getrgb(value)[:3]


def open_image(data: bytes) -> Image.Image:
    """Pillow's image of ``data`` (first page or frame), with the plugins registered."""
    register_plugins()
    img = Image.open(io.BytesIO(data))
    if getattr(img, "n_frames", 1) > 1:
        img.seek(0)
    return img


def orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (1 when absent or out of range)."""
    try:
        value = int(img.getexif().get(0x0112, 1))
    except (TypeError, ValueError, SyntaxError):
        return 1
    return value if 1 <= value <= 8 else 1


def has_alpha(img: Image.Image) -> bool:
    """Whether ``img`` has transparency: an alpha channel or a transparent colour or palette entry."""
    return img.mode in ALPHA_MODES or "transparency" in img.info


def profile_name(icc: bytes) -> str:
    """The description of an ICC profile, or ``unreadable: ...``."""
    from PIL import ImageCms

    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        return (ImageCms.getProfileDescription(profile) or "").strip() or "unnamed"
    except (OSError, ImageCms.PyCMSError, ValueError) as err:
        return f"unreadable: {err}"


def header(img: Image.Image) -> dict[str, Any]:
    """What ingest records of an image's decoding: the shown size and what the rules will do to it."""
    turn = orientation(img)
    width, height = img.size
    if turn >= 5:  # 5-8 swap the axes
        width, height = height, width
    facts: dict[str, Any] = {"width": width, "height": height, "orientation": turn, "mode": img.mode,
                             "alpha": has_alpha(img), "pages": int(getattr(img, "n_frames", 1))}
    icc = img.info.get("icc_profile")
    facts["color_profile"] = profile_name(icc) if icc else None
    return facts


def pixel_rules(meta: dict[str, Any], background: tuple[int, int, int]) -> dict[str, Any]:
    """Which decoding rules make this sample's pixels differ from a plain ``convert("RGB")``; ``{}`` when none.

    Read from the facts ingest recorded (:func:`header`). Samples ingested before those facts existed
    (no ``mode``) count as plain, as they were decoded then.
    """
    if meta.get("kind") == "video" or "mode" not in meta:
        return {}
    rules: dict[str, Any] = {}
    if meta.get("orientation", 1) != 1:
        rules["orientation"] = meta["orientation"]
    if meta.get("alpha"):
        rules["background"] = list(background)
    if meta.get("color_profile") and not str(meta["color_profile"]).startswith("unreadable"):
        rules["icc"] = True
    if meta["mode"] not in PLAIN_MODES:
        rules["mode"] = meta["mode"]
    if meta.get("pages", 1) > 1:
        rules["pages"] = "first"
    return {"rules": RULES_VERSION, **rules} if rules else {}


def _to_8bit(img: Image.Image) -> Image.Image:
    """An 8-bit ``L`` image of a 16-bit, 32-bit integer or float grey image (scaled, not clipped)."""
    values = np.asarray(img)
    if img.mode == "F":
        scaled = np.clip(values.astype(np.float64), 0.0, 1.0) * 255.0
    else:
        scaled = np.clip(values.astype(np.float64), 0, 65535) / 257.0
    return Image.fromarray(np.rint(scaled).astype(np.uint8), "L")


@lru_cache(maxsize=64)
def _transform(icc: bytes, mode: str):
    from PIL import ImageCms

    source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
    return ImageCms.buildTransform(source, ImageCms.createProfile("sRGB"), mode, "RGB",
                                   renderingIntent=ImageCms.Intent.RELATIVE_COLORIMETRIC)


def _profile_mode(icc: bytes, mode: str) -> str | None:
    """The mode to feed ``icc``'s transform an image of ``mode`` in; None when they do not fit together."""
    from PIL import ImageCms

    space = _ICC_SPACES.get(ImageCms.ImageCmsProfile(io.BytesIO(icc)).profile.xcolor_space.strip())
    if space is None or (space == "CMYK") != (mode == "CMYK") or (space == "L" and mode != "L"):
        return None
    return space


def _to_srgb(img: Image.Image, icc: bytes | None) -> Image.Image:
    """RGB pixels in sRGB: through the embedded profile when there is a usable one, else Pillow's convert."""
    if icc:
        from PIL import ImageCms

        try:
            mode = _profile_mode(icc, img.mode)
            if mode is not None:
                return ImageCms.applyTransform(img if img.mode == mode else img.convert(mode), _transform(icc, mode))
        except (OSError, ImageCms.PyCMSError, ValueError):
            pass  # an unreadable profile: decoded as if there were none (ingest recorded it)
    if img.mode == "LAB":
        from PIL import ImageCms

        return ImageCms.profileToProfile(img, ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"),
                                         outputMode="RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def rgb_and_alpha(img: Image.Image) -> tuple[Image.Image, Image.Image | None]:
    """``img`` as 8-bit sRGB RGB in its shown orientation, not composited, and its alpha (``L``, 0 transparent
    .. 255 opaque) when it has transparency, else None."""
    icc = img.info.get("icc_profile")
    if orientation(img) != 1:
        img = ImageOps.exif_transpose(img)
    alpha = None
    if img.mode in SIXTEEN_BIT or img.mode == "F":
        if "transparency" in img.info and img.mode != "F":  # a transparent grey value (PNG tRNS)
            opaque = np.asarray(img) != img.info["transparency"]
            alpha = Image.fromarray(opaque.astype(np.uint8) * 255, "L")
        img = _to_8bit(img)
    elif has_alpha(img):
        if img.mode in ("LA", "La"):
            alpha, img = img.getchannel("A"), img.convert("L")
        else:
            rgba = img.convert("RGBA")
            alpha, img = rgba.getchannel("A"), rgba.convert("RGB")
    return _to_srgb(img, icc), alpha


def composite(rgb: Image.Image, alpha: Image.Image | None, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """``rgb`` over ``background`` through ``alpha`` (``rgb`` itself when there is no alpha)."""
    if alpha is None:
        return rgb
    return Image.composite(rgb, Image.new("RGB", rgb.size, background), alpha)


def to_rgb(img: Image.Image, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """``img`` as 8-bit sRGB RGB in its shown orientation, transparency composited over ``background``."""
    return composite(*rgb_and_alpha(img), background)


def decode_rgb(data: bytes, background: tuple[int, int, int] = WHITE,
               draft: int | None = None) -> Image.Image:
    """Decode a still image's bytes by these rules; ``draft``: let JPEGs decode at 1/2–1/8 scale when their
    longer side stays at least this large (a captioner's small input)."""
    return decode_rgb_alpha(data, background, draft)[0]


def decode_rgb_alpha(data: bytes, background: tuple[int, int, int] = WHITE,
                     draft: int | None = None) -> tuple[Image.Image, Image.Image | None]:
    """:func:`decode_rgb`'s image and the alpha it was composited through (``L``, in the shown orientation),
    or None when the image has no transparency: which pixels are the picture, for scores that should not
    see the background."""
    with open_image(data) as img:
        if draft:
            img.draft("RGB", (draft, draft))
        img.load()
        rgb, alpha = rgb_and_alpha(img)
        return composite(rgb, alpha, background), alpha
