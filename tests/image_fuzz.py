"""Hostile images for the property-based tests of every place a row's image enters (the engine's
checks, the Dagster image column, the batch runner): any size (0 and 1 pixel, extreme aspect
ratios), every Pillow mode, every format the engine names (PNG, JPEG, GIF, WebP, BMP, TIFF),
cut short, corrupted, headers that claim sizes their data does not hold (tiny files that claim
billions of pixels), random bytes, lazily opened PIL images, hostile paths and URIs, and values
that are no image at all.

A drawn `HostileImage` is a description; `HostileImage.value(folder)` makes the value a row gives
(writing a file under `folder` for the path forms), so that the strategies need no fixture.
Example counts come from tests/fuzzing.py's `examples`."""

import base64
import hashlib
import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st
from PIL import Image

from engine.multimodal.image import SUPPORTED_MODES

MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", "I;16", "I;16B", "I", "F", "La", "RGBX",
         "RGBa", "LAB", "HSV")
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
# Images drawn with real pixels stay this small, so that an example takes milliseconds.
MAX_DRAWN_PIXELS = 200_000
# Sizes a header may claim: around the engine's 40 Mpx decode budget, Pillow's warning (89.5 Mpx)
# and error (179 Mpx) thresholds, and far beyond; with 0 and 1 pixel sides.
CLAIMED_SIDES = (0, 1, 2, 3, 199, 201, 500, 6000, 6324, 6325, 9000, 9460, 13000, 13400, 20000, 65535)
HOSTILE_LOCATIONS = ("/dev/zero", "/dev/null", "/", ".", "", "\x00", "a\x00b.png", "~no_such_user_zz/x.png",
                     "file://[x/y.png", "file:///dev/zero", "http://example.com/cat.png", "s3://bucket/cat.png",
                     "data:image/png,notbase64", "data:image/png;base64,!!!!", "data:;base64,", "C:\\cat.png",
                     "x" * 5000)


@dataclass(frozen=True)
class HostileImage:
    """One drawn image input: `form` says how a row gives it ("bytes", "pil", "lazy_pil",
    "path", "uri", "data_uri", "location", "object") and `payload` holds it (encoded bytes, a
    PIL image, a hostile location string, or any object)."""

    form: str
    payload: Any
    how: str  # what was drawn, for the failure report

    def value(self, folder: Path) -> Any:
        """The value a row gives: files written under `folder` for "path" and "uri"."""
        if self.form in ("path", "uri"):
            path = folder / f"{hashlib.sha256(self.payload).hexdigest()[:16]}.img"
            path.write_bytes(self.payload)
            return str(path) if self.form == "path" else path.as_uri()
        if self.form == "data_uri":
            return "data:image/png;base64," + base64.b64encode(self.payload).decode()
        if self.form == "lazy_pil":
            return Image.open(io.BytesIO(self.payload))  # its pixels are read by whoever loads it
        return self.payload

    def __repr__(self) -> str:
        return f"HostileImage({self.form}, {self.how})"


def _pixels(mode: str, size: tuple[int, int], seed: int, flat: bool) -> Image.Image:
    """An image of `mode` and `size`: random bytes as its pixels, or one flat colour."""
    blank = Image.new(mode, size)
    if flat or 0 in size:
        return blank
    data = np.random.default_rng(seed).bytes(len(blank.tobytes()))
    return Image.frombytes(mode, size, data)


@st.composite
def drawn_sizes(draw: st.DrawFn) -> tuple[int, int]:
    """A width and height: tiny, ordinary or extreme in aspect ratio, within MAX_DRAWN_PIXELS."""
    side = st.one_of(st.integers(1, 96), st.integers(1, 8), st.sampled_from([0, 150, 199, 200, 201, 250, 400, 500,
                                                                            1000, 3000, 20000, 40000]))
    width, height = draw(side), draw(side)
    if width * height > MAX_DRAWN_PIXELS:
        height = max(1, MAX_DRAWN_PIXELS // max(width, 1))
    return width, height


@st.composite
def pil_images(draw: st.DrawFn, modes: tuple[str, ...] = MODES) -> Image.Image:
    """A PIL image of one of `modes` and any size (0 included), random or flat."""
    mode, size = draw(st.sampled_from(modes)), draw(drawn_sizes())
    return _pixels(mode, size, draw(st.integers(0, 2**32 - 1)), draw(st.booleans()))


def encode(image: Image.Image, fmt: str) -> bytes:
    """The image in `fmt`, else the first of TIFF and PNG that takes its mode and size; a
    black RGB PNG of its size where none does, a bare PNG header where its size is empty."""
    for attempt in (fmt, "TIFF", "PNG"):
        try:
            buffer = io.BytesIO()
            image.save(buffer, format=attempt)
            return buffer.getvalue()
        except Exception:  # a mode or size the format does not take
            continue
    return encode(Image.new("RGB", image.size), "PNG") if 0 not in image.size else png_header(*image.size)


def png_header(width: int, height: int, color_type: int = 2, data: bytes = b"") -> bytes:
    """A PNG that claims width x height: its header, an optional IDAT of `data`, and its end."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    idat = chunk(b"IDAT", zlib.compress(data)) if data else b""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0))
            + idat + chunk(b"IEND", b""))


def gif_header(width: int, height: int) -> bytes:
    """A GIF whose screen and one frame claim width x height, with one code of data."""
    screen = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    return screen + frame + b"\x3b"


def bmp_header(width: int, height: int) -> bytes:
    """A 24-bit BMP that claims width x height and holds 16 bytes of pixels."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + 16, 0, 0, 14 + 40) + info + bytes(16)


def tiff_header(width: int, height: int) -> bytes:
    """An 8-bit greyscale TIFF that claims width x height in one strip of 16 bytes."""
    entries = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8),
               (277, 3, 1), (278, 4, height), (279, 4, 16)]
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHI", tag, kind, 1) + (struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value))
        for tag, kind, value in entries) + struct.pack("<I", 0)
    return b"II*\x00" + struct.pack("<I", 8 + 16) + bytes(16) + ifd


def webp_header(width: int, height: int) -> bytes:
    """An extended WebP (VP8X) whose canvas claims width x height (at most 2**24 a side), with no frame."""
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(4) + struct.pack("<I", max(width - 1, 0))[:3] \
        + struct.pack("<I", max(height - 1, 0))[:3]
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def jpeg_claiming(width: int, height: int) -> bytes:
    """A small real JPEG whose frame header (SOF0) is rewritten to claim width x height."""
    data = bytearray(encode(Image.new("RGB", (16, 16), (90, 30, 200)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", min(height, 65535), min(width, 65535))
    return bytes(data)


HEADERS = {"png": png_header, "gif": gif_header, "bmp": bmp_header, "tiff": tiff_header, "jpeg": jpeg_claiming,
           "webp": webp_header}


@st.composite
def header_bombs(draw: st.DrawFn) -> tuple[bytes, str]:
    """A tiny file whose header claims a size its data does not hold (up to billions of pixels)."""
    kind = draw(st.sampled_from(sorted(HEADERS)))
    side = st.one_of(st.sampled_from(CLAIMED_SIDES), st.integers(0, 70000))
    width, height = draw(side), draw(side)
    if kind in ("gif", "jpeg"):
        width, height = min(width, 65535), min(height, 65535)
    return HEADERS[kind](width, height), f"{kind} header claiming {width}x{height}"


def _mutated(data: bytes, draw: st.DrawFn) -> tuple[bytes, str]:
    """`data` as is, cut short, with bytes overwritten, or with garbage after it."""
    how = draw(st.sampled_from(["whole", "whole", "cut", "flipped", "tail"]))
    if how == "cut" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at], f"cut at {at} of {len(data)}"
    if how == "flipped" and data:
        buffer = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            buffer[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(buffer), "bytes overwritten"
    if how == "tail":
        return data + draw(st.binary(min_size=1, max_size=64)), "garbage after it"
    return data, "whole"


@st.composite
def encoded_images(draw: st.DrawFn) -> tuple[bytes, str]:
    """Encoded bytes: a drawn image in a drawn format (mutated), a header bomb, or random bytes."""
    kind = draw(st.sampled_from(["image", "image", "image", "bomb", "random"]))
    if kind == "bomb":
        return draw(header_bombs())
    if kind == "random":
        return draw(st.binary(max_size=256)), "random bytes"
    image, fmt = draw(pil_images()), draw(st.sampled_from(FORMATS))
    data, how = _mutated(encode(image, fmt), draw)
    return data, f"{image.mode} {image.size[0]}x{image.size[1]} as {fmt}, {how}"


@st.composite
def hostile_images(draw: st.DrawFn, network: bool = True) -> HostileImage:
    """An image a row might give, in any form: mostly bad, some fine. Without `network`, no
    location names a network store (a reader that fetches would wait on it)."""
    form = draw(st.sampled_from(["bytes", "bytes", "bytes", "pil", "lazy_pil", "path", "uri", "data_uri",
                                 "location", "object"]))
    if form == "pil":
        image = draw(pil_images())
        return HostileImage(form, image, f"PIL {image.mode} {image.size[0]}x{image.size[1]}")
    if form == "location":
        locations = HOSTILE_LOCATIONS if network else tuple(x for x in HOSTILE_LOCATIONS if "://" not in x
                                                              or x.startswith("file://"))
        text = draw(st.one_of(st.sampled_from(locations), st.text(max_size=40).filter(lambda x: "://" not in x)))
        return HostileImage(form, text, f"location {text!r:.60}")
    if form == "object":
        thing = draw(st.sampled_from([None, 7, 2.5, [], {}, {"bytes": None}, object(), np.zeros((4, 4, 3))]))
        return HostileImage(form, thing, f"object {type(thing).__name__}")
    data, how = draw(encoded_images())
    if form == "lazy_pil":
        try:
            Image.open(io.BytesIO(data))
        except Exception:  # not even a header: given as bytes instead
            form = "bytes"
    return HostileImage(form, data, f"{how} ({len(data)} bytes)")


@st.composite
def decodable_images(draw: st.DrawFn) -> HostileImage:
    """An image in a mode the engine reads, whole, as bytes in any format or as a PIL image:
    mostly accepted, at any size and aspect ratio (what the tests that generate need)."""
    image = draw(pil_images(modes=SUPPORTED_MODES))
    if draw(st.booleans()):
        return HostileImage("pil", image, f"PIL {image.mode} {image.size[0]}x{image.size[1]}")
    fmt = draw(st.sampled_from(FORMATS))
    return HostileImage("bytes", encode(image, fmt), f"{image.mode} {image.size[0]}x{image.size[1]} as {fmt}")


def good_picture(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """A real small RGB picture as PNG bytes: the rows beside a hostile one."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "PNG")


def strip_png() -> bytes:
    """A 500x2 strip as PNG bytes: an aspect ratio of 250, over Qwen2-VL's 200 (issue 62)."""
    return encode(Image.new("RGB", (500, 2), (200, 40, 40)), "PNG")


# 57 bytes of PNG that claim 20000x10000, 200 megapixels: over Pillow's own limit (issue 62).
BOMB = png_header(20000, 10000)
