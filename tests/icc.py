"""Small ICC profiles written byte by byte, for tests of colour management (none ship with Pillow).

* :func:`matrix_profile` — an RGB display profile (primaries, D65 white, one gamma): Display P3 and Adobe RGB
  class profiles, the kind phones and cameras embed;
* :func:`cmyk_profile` — a CMYK print profile whose A2B0 table is a 2x2x2x2 grid in Lab.

Both are ICC v2, which LittleCMS (Pillow's ImageCms) reads. The reference conversions beside them compute
what those profiles mean with plain numpy, independently of LittleCMS.
"""

from __future__ import annotations

import struct

import numpy as np

D65 = (0.3127, 0.3290)
D50_XYZ = np.array([0.9642, 1.0, 0.8249])
BRADFORD = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])
SRGB_PRIMARIES = ((0.64, 0.33), (0.30, 0.60), (0.15, 0.06))
DISPLAY_P3 = ((0.680, 0.320), (0.265, 0.690), (0.150, 0.060))
ADOBE_RGB = ((0.64, 0.33), (0.21, 0.71), (0.15, 0.06))


def _xyz(xy: tuple[float, float]) -> np.ndarray:
    x, y = xy
    return np.array([x / y, 1.0, (1 - x - y) / y])


def rgb_to_xyz(primaries, white=D65) -> np.ndarray:
    """The linear-RGB -> XYZ matrix of a colour space (columns: the primaries scaled to the white)."""
    m = np.stack([_xyz(p) for p in primaries], axis=1)
    return m * np.linalg.solve(m, _xyz(white))


def adapt(src_white: np.ndarray, dst_white: np.ndarray) -> np.ndarray:
    """Bradford chromatic adaptation matrix from one white (XYZ) to another."""
    lms = BRADFORD @ src_white, BRADFORD @ dst_white
    return np.linalg.inv(BRADFORD) @ np.diag(lms[1] / lms[0]) @ BRADFORD


def _s15(v: float) -> bytes:
    return struct.pack(">i", int(round(v * 65536)))


def _xyz_tag(v) -> bytes:
    return b"XYZ " + b"\0" * 4 + b"".join(_s15(c) for c in v)


def _desc(text: str) -> bytes:
    ascii_ = text.encode("ascii") + b"\0"
    return b"desc" + b"\0" * 4 + struct.pack(">I", len(ascii_)) + ascii_ + b"\0" * 8 + b"\0" * 3 + b"\0" * 67


def _profile(klass: bytes, space: bytes, pcs: bytes, tags: list[tuple[bytes, bytes]]) -> bytes:
    table, body, offset = [], b"", 128 + 4 + 12 * len(tags)
    for sig, data in tags:
        data += b"\0" * (-len(data) % 4)
        table.append(struct.pack(">4sII", sig, offset + len(body), len(data)))
        body += data
    size = offset + len(body)
    header = (struct.pack(">I", size) + b"\0" * 4 + struct.pack(">I", 0x02100000) + klass + space + pcs
              + b"\0" * 12 + b"acsp" + b"\0" * 24 + struct.pack(">I", 0) + b"".join(_s15(c) for c in D50_XYZ)
              + b"\0" * 4 + b"\0" * 16 + b"\0" * 28)
    assert len(header) == 128
    return header + struct.pack(">I", len(tags)) + b"".join(table) + body


def matrix_profile(primaries, gamma: float, name: str) -> bytes:
    """An RGB display profile: the primaries and D65 white adapted to D50 (Bradford), one gamma curve."""
    to_d50 = adapt(_xyz(D65), D50_XYZ) @ rgb_to_xyz(primaries)
    curve = b"curv" + b"\0" * 4 + struct.pack(">IH", 1, int(round(gamma * 256)))
    tags = [(b"desc", _desc(name)), (b"wtpt", _xyz_tag(D50_XYZ)),
            (b"rXYZ", _xyz_tag(to_d50[:, 0])), (b"gXYZ", _xyz_tag(to_d50[:, 1])), (b"bXYZ", _xyz_tag(to_d50[:, 2])),
            (b"rTRC", curve), (b"gTRC", curve), (b"bTRC", curve)]
    return _profile(b"mntr", b"RGB ", b"XYZ ", tags)


def encode_srgb(linear: np.ndarray) -> np.ndarray:
    """Linear sRGB in [0, 1] -> 8-bit sRGB values (float, unrounded)."""
    linear = np.clip(linear, 0.0, 1.0)
    return 255 * np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * np.power(linear, 1 / 2.4) - 0.055)


def matrix_to_srgb(rgb8: np.ndarray, primaries, gamma: float) -> np.ndarray:
    """What a matrix profile's 8-bit RGB values are in 8-bit sRGB (both spaces have a D65 white)."""
    linear = np.power(rgb8 / 255.0, gamma)
    xyz = linear @ rgb_to_xyz(primaries).T
    return encode_srgb(xyz @ np.linalg.inv(rgb_to_xyz(SRGB_PRIMARIES)).T)


# A CMYK profile: the 16 corners of the CMYK cube as Lab colours (L, a, b); C, M, Y, K each 0 or 1. Lab is
# affine in C, M, Y, K, so every interpolation (LittleCMS's tetrahedral one, the multilinear reference) agrees;
# paper white is the PCS white, which LittleCMS pins to display white.
def _corner_lab(c: int, m: int, y: int, k: int) -> tuple[float, float, float]:
    return (100.0 - 20 * c - 25 * m - 10 * y - 40 * k, 40 * m - 30 * c - 5 * y, 45 * y - 35 * c - 10 * m)


def cmyk_profile(name: str = "test CMYK") -> bytes:
    """A CMYK output profile whose A2B0 (lut16, 2-point grid, Lab PCS) holds :func:`_corner_lab`."""
    grid = []
    for c in (0, 1):
        for m in (0, 1):
            for y in (0, 1):
                for k in (0, 1):
                    lab = _corner_lab(c, m, y, k)
                    grid += [int(round(lab[0] * 65280 / 100)), int(round((lab[1] + 128) * 256)),
                             int(round((lab[2] + 128) * 256))]
    identity = b"".join(_s15(v) for v in (1, 0, 0, 0, 1, 0, 0, 0, 1))
    lut = (b"mft2" + b"\0" * 4 + struct.pack(">BBBB", 4, 3, 2, 0) + identity + struct.pack(">HH", 2, 2)
           + struct.pack(">8H", *([0, 65535] * 4)) + struct.pack(f">{len(grid)}H", *grid)
           + struct.pack(">6H", *([0, 65535] * 3)))
    return _profile(b"prtr", b"CMYK", b"Lab ", [(b"desc", _desc(name)), (b"wtpt", _xyz_tag(D50_XYZ)),
                                                (b"A2B0", lut)])


def cmyk_to_srgb(cmyk8: np.ndarray) -> np.ndarray:
    """What :func:`cmyk_profile` makes of 8-bit CMYK values, in 8-bit sRGB (multilinear in Lab, D50 -> D65)."""
    t = cmyk8 / 255.0
    lab = np.zeros(t.shape[:-1] + (3,))
    for c in (0, 1):
        for m in (0, 1):
            for y in (0, 1):
                for k in (0, 1):
                    weight = np.ones(t.shape[:-1])
                    for axis, bit in enumerate((c, m, y, k)):
                        weight = weight * (t[..., axis] if bit else 1 - t[..., axis])
                    lab += weight[..., None] * np.array(_corner_lab(c, m, y, k))
    fy = (lab[..., 0] + 16) / 116
    f = np.stack([fy + lab[..., 1] / 500, fy, fy - lab[..., 2] / 200], axis=-1)
    xyz = np.where(f > 6 / 29, f ** 3, 3 * (6 / 29) ** 2 * (f - 4 / 29)) * D50_XYZ
    to_d65 = adapt(D50_XYZ, _xyz(D65))
    return encode_srgb(xyz @ (np.linalg.inv(rgb_to_xyz(SRGB_PRIMARIES)) @ to_d65).T)
