"""Generate the embedded demo dataset: 24 small images with sidecar captions, plus two bad files; and 12 edit
pairs for the edit families' demo (``data/demo/edits``).

The output is deterministic (fixed seed, no timestamps in the files), so the committed copies in
``data/demo/images`` and ``data/demo/edits`` can be re-created byte for byte:

    python data/make_demo.py data/demo/images
    python data/make_demo.py --edits data/demo/edits

An edit pair (``ingest.edit``'s sidecar layout): ``edit_NNN.src.png`` (the source image), ``edit_NNN.png`` (the
target: the same picture with its shape in another colour) and ``edit_NNN.txt`` (the instruction).

Mixed sizes and aspect ratios (portrait, landscape, square), JPEG and PNG. Two files are broken on
purpose so the demo shows quarantine at work: ``broken.jpg`` is not an image at all (ingest quarantines
it), ``truncated.jpg`` has a valid header but its pixel data is cut short (the cache stage, which is where
pixels are decoded, quarantines it). Two more are over-exposed (``overexposed_0.png``, ``overexposed_1.jpg``,
mostly pure white): the demo recipe's ``curate.max_exposure`` quarantines them.
"""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 70),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 190),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "stripes")
# (width, height): portrait, landscape and square, none a multiple of the bucket step on purpose.
SIZES = [
    (160, 160), (200, 120), (120, 200), (256, 144), (144, 256), (180, 180),
    (220, 150), (150, 220), (96, 96), (240, 160), (160, 240), (128, 128),
]


def _draw(rng: random.Random, width: int, height: int, recolour: bool = False):
    """A shape on a background and its caption; ``recolour``: also the same picture with the shape in a third
    colour and the instruction that makes it (an edit pair's target)."""
    fg_name, bg_name = rng.sample(sorted(COLORS), 2)
    shape = rng.choice(SHAPES)
    if recolour:
        new_name = rng.choice([c for c in sorted(COLORS) if c not in (fg_name, bg_name)])
        source, _ = _shape(rng.getstate(), width, height, shape, COLORS[fg_name], COLORS[bg_name])
        target, after = _shape(rng.getstate(), width, height, shape, COLORS[new_name], COLORS[bg_name])
        rng.setstate(after)
        return source, target, f"make the {shape} {new_name}"
    img, rng_state = _shape(rng.getstate(), width, height, shape, COLORS[fg_name], COLORS[bg_name])
    rng.setstate(rng_state)
    orient = "square" if width == height else ("landscape" if width > height else "portrait")
    caption = f"a {fg_name} {shape} on a {bg_name} background, {orient} picture"
    return img, caption


def _shape(state: tuple, width: int, height: int, shape: str, fg: tuple, bg: tuple) -> tuple[Image.Image, tuple]:
    """Draw ``shape`` in ``fg`` on ``bg`` at a position drawn from the random state ``state``; the state after."""
    rng = random.Random()
    rng.setstate(state)
    img = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(img)
    cx, cy = width // 2 + rng.randint(-width // 8, width // 8), height // 2 + rng.randint(-height // 8, height // 8)
    r = min(width, height) // 3
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    else:
        for x in range(0, width, 16):
            draw.rectangle([x, 0, x + 7, height], fill=fg)
    return img, rng.getstate()


def generate(out_dir: Path, count: int = 24, seed: int = 0) -> list[Path]:
    """Write ``count`` images with sidecar captions plus the two broken files; return the image paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    written = []
    for i in range(count):
        width, height = SIZES[i % len(SIZES)]
        img, caption = _draw(rng, width, height)
        ext = "png" if i % 3 == 0 else "jpg"
        path = out_dir / f"img_{i:03d}.{ext}"
        if ext == "png":
            img.save(path, format="PNG", optimize=False)
        else:
            img.save(path, format="JPEG", quality=90)
        path.with_suffix(".txt").write_text(caption + "\n")
        written.append(path)

    # Not an image at all: ingest reads the header and quarantines it.
    (out_dir / "broken.jpg").write_bytes(b"this is not a JPEG file\n" * 4)
    (out_dir / "broken.txt").write_text("a file that is not an image\n")
    # A real JPEG header with the pixel data cut short: only decoding the pixels finds out.
    img, _ = _draw(rng, 128, 96)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    (out_dir / "truncated.jpg").write_bytes(data[: len(data) // 3])
    (out_dir / "truncated.txt").write_text("an image whose pixel data is cut short\n")
    # Over-exposed on purpose: most pixels blown out to white (255). The demo recipe's curate.max_exposure
    # quarantines exactly these two (the curate stage, "Curation" in docs/cache-format.md).
    for i, (width, height) in enumerate([(160, 120), (120, 160)]):
        img = Image.new("RGB", (width, height), (255, 255, 255))
        ImageDraw.Draw(img).ellipse([width // 3, height // 3, 2 * width // 3, 2 * height // 3], fill=(235, 225, 200))
        ext = "png" if i == 0 else "jpg"
        path = out_dir / f"overexposed_{i}.{ext}"
        img.save(path, format="PNG" if ext == "png" else "JPEG", **({"optimize": False} if ext == "png" else {"quality": 90}))
        path.with_suffix(".txt").write_text(f"an over-exposed picture, {'landscape' if width > height else 'portrait'}\n")
    return written


def generate_edits(out_dir: Path, count: int = 12, seed: int = 1) -> list[Path]:
    """Write ``count`` edit pairs (source, target, instruction) in the sidecar layout; return the targets' paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    written = []
    for i in range(count):
        width, height = SIZES[i % len(SIZES)]
        source, target, instruction = _draw(rng, width, height, recolour=True)
        path = out_dir / f"edit_{i:03d}.png"
        target.save(path, format="PNG", optimize=False)
        source.save(out_dir / f"edit_{i:03d}.src.png", format="PNG", optimize=False)
        path.with_suffix(".txt").write_text(instruction + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    if sys.argv[1:2] == ["--edits"]:
        target = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parent / "demo" / "edits"
        print(f"wrote {len(generate_edits(target))} edit pairs to {target}")
    else:
        target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "demo" / "images"
        paths = generate(target)
        print(f"wrote {len(paths)} images (+2 broken, +2 over-exposed files) to {target}")
