"""Prompt images: what a row may give (a PIL image, encoded bytes, a local path, a `file://`
or `data:` URI), checked and decoded before any work starts, and each image's content hash,
which keys the encoder cache and the prefix cache.

A row's image is hostile input: its header is read first (Pillow's `Image.open` reads no
pixels) and the image refused, before it is decoded, when it is empty, wider or taller than
the model's image processor takes (`ImageLimits.max_aspect_ratio`), or larger than the decode
budget (`ImageLimits.max_pixels`; a JPEG above it decodes at 1/2, 1/4 or 1/8 scale where that
fits). The budget is the engine's own, whatever Pillow's global `MAX_IMAGE_PIXELS` says: the
image processors resize every image to a few megapixels at most, so decoding more only costs
memory (docs/engine.md, "Images in")."""

import hashlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from PIL import Image, UnidentifiedImageError

from engine.multimodal.media import MediaKind, read_location, short_location

# Modes an image processor can convert to RGB without losing what the image shows.
SUPPORTED_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1")
# The decode budget's floor, whatever the model: 40 megapixels, 120 MB decoded as RGB. An 8K
# screenshot is 33, most cameras' photos less (larger JPEGs decode at a reduced scale). Under
# Pillow's warning threshold (89.5 Mpx): an image within the budget never warns.
MIN_DECODE_BUDGET = 40_000_000
# The budget is at least this many times the pixels the model's image processor keeps: an image
# up to twice its size on each side gives the processor's antialiased resize detail it keeps;
# beyond, decoding only costs memory.
DECODE_OVERSAMPLING = 4
# The most bytes a pixel of an image file within the budget takes: 16-bit RGBA uncompressed (Pillow
# reads it as RGBA); a larger local file is refused before it is read.
MAX_FILE_BYTES_PER_PIXEL = 8
# The attribute that keeps, on a PIL image given lazily opened, why its decoding failed (`_loaded`).
DECODE_PROBLEM = "_engine_decode_problem"
# The reduced scales a JPEG decoder can decode at (Pillow's `Image.draft`), smallest reduction first.
JPEG_DRAFT_SCALES = (2, 4, 8)


class ImageInputError(ValueError):
    """An image a row gives that cannot be used; the message says why and what to do."""


# How the shared location reading (`engine.multimodal.media`) names an image in its messages.
IMAGE = MediaKind(ImageInputError, "image", "data:image/png;base64,...", "an image within the decode budget takes",
                  "give the image file itself, resized")


ImageLike = Image.Image | bytes | bytearray | str | Path
T = TypeVar("T")


def decode_budget(kept_pixels: int) -> int:
    """The decode budget of a model whose image processor keeps at most `kept_pixels` of an
    image: `DECODE_OVERSAMPLING` times that, and at least `MIN_DECODE_BUDGET`."""
    return max(MIN_DECODE_BUDGET, DECODE_OVERSAMPLING * kept_pixels)


@dataclass(frozen=True)
class ImageLimits:
    """What an image may be for a model, checked on its header before it is decoded: at most
    `max_pixels` pixels (the decode budget) and, where the model's image processor (`processor`,
    as messages name it) needs one, an aspect ratio of at most `max_aspect_ratio`."""

    max_pixels: int = MIN_DECODE_BUDGET
    max_aspect_ratio: float | None = None
    processor: str = "the image processor"

    @property
    def max_file_bytes(self) -> int:
        """The largest image file read: an image within the budget at `MAX_FILE_BYTES_PER_PIXEL`,
        and a megabyte of metadata."""
        return MAX_FILE_BYTES_PER_PIXEL * self.max_pixels + (1 << 20)

    def size_problem(self, width: int, height: int) -> str | None:
        """Why an image of width x height cannot be used, or None."""
        return self.shape_problem(width, height) or self.pixels_problem(width, height)

    def shape_problem(self, width: int, height: int) -> str | None:
        """Why an image of width x height cannot be used whatever its scale (empty, or of an
        aspect ratio the processor does not take), or None."""
        if min(width, height) < 1:
            return f"the image is empty ({width}x{height}): drop the row or fix the image"
        ratio = max(width, height) / min(width, height)
        if self.max_aspect_ratio is not None and ratio > self.max_aspect_ratio:
            return (f"the image is {width}x{height}, an aspect ratio of {f'{ratio:.1f}'.removesuffix('.0')}, over the "
                    f"{self.max_aspect_ratio:g} that {self.processor} takes: crop or pad it to an aspect ratio of at "
                    f"most {self.max_aspect_ratio:g}")
        return None

    def pixels_problem(self, width: int, height: int) -> str | None:
        """Why an image of width x height is too large to decode, or None."""
        if width * height <= self.max_pixels:
            return None
        scale = math.sqrt(self.max_pixels / (width * height))
        return (f"the image is {width}x{height} ({width * height:,} pixels), over the decode budget of "
                f"{self.max_pixels:,} pixels: resize it below {self.max_pixels:,} pixels (e.g. to "
                f"{max(1, int(width * scale))}x{max(1, int(height * scale))}) upstream")


def load_image(value: ImageLike, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The image `value` names, checked against `limits` on its header, then decoded (a JPEG
    above the budget at a reduced scale), in a mode an image processor reads.

    Raises:
        ImageInputError: bytes that are not an image, are cut short or do not decode, an image
            that is empty, over the budget or of an aspect ratio the model's processor does not
            take, a path that does not exist or is not a file, a URL the engine does not fetch
            (http, s3: it reads nothing from the network), an unsupported mode (e.g. 16-bit or
            float images).
    """
    if isinstance(value, Image.Image):
        image = _loaded(value, limits)
    elif isinstance(value, (bytes, bytearray)):
        image = _decode(bytes(value), "the bytes", limits)
    elif isinstance(value, (str, Path)):
        data = read_location(str(value), limits.max_file_bytes, IMAGE)
        image = _decode(data, f"the bytes of {short_location(str(value))}", limits)
    else:
        raise ImageInputError(f"expected a PIL image, encoded image bytes, a local path or a file:// or data: URI, "
                              f"got {type(value).__name__}")
    if image.mode not in SUPPORTED_MODES:
        raise ImageInputError(f"mode {image.mode!r} is not supported (supported: {', '.join(SUPPORTED_MODES)}): "
                              "convert the image to RGB upstream (e.g. Image.convert('RGB') after scaling)")
    return image


@dataclass(frozen=True)
class PromptImage:
    """A prompt's image: decoded (to check and hash it, and to count its tokens), and what it
    was read from, kept compact until its encoder inputs are made (PIL images as given,
    everything else as its encoded bytes: a path is read once, when the row is checked)."""

    image: Image.Image
    source: Image.Image | bytes


def read_image(value: ImageLike, limits: ImageLimits = ImageLimits()) -> PromptImage:
    """The image `value` names, checked and decoded, with its compact source.

    Raises:
        ImageInputError: as `load_image`.
    """
    source = value
    if isinstance(value, (bytes, bytearray)):
        source = bytes(value)
    elif isinstance(value, (str, Path)):
        source = read_location(str(value), limits.max_file_bytes, IMAGE)
    return PromptImage(load_image(source, limits), source)


def image_hash(image: Image.Image) -> str:
    """sha256 of the decoded pixels, mode and size, and of what else the image processor's
    conversion to RGB reads (a palette image's palette, a transparent colour): equal for the
    same picture however it was given (bytes, path, PIL object), different for any other."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    if image.palette is not None:  # a palette image's pixels are indices into it
        digest.update(b"palette:" + bytes(image.getpalette("RGBA") or []))
    if (transparency := image.info.get("transparency")) is not None:
        digest.update(f"transparency:{transparency!r}".encode())
    return digest.hexdigest()


def _decode(data: bytes, what: str, limits: ImageLimits) -> Image.Image:
    """`data` decoded within `limits`: its header read and checked first (a JPEG above the
    budget decodes at the smallest reduction that fits), its pixels decoded after."""
    image = _pillow(lambda: Image.open(io.BytesIO(data)), what, limits)
    width, height = image.size
    if (problem := limits.shape_problem(width, height)) is not None:
        raise ImageInputError(problem)
    if (problem := limits.pixels_problem(width, height)) is not None and not _pillow(
            lambda: _drafted_within(image, limits.max_pixels), what, limits):
        raise ImageInputError(problem)
    _pillow(image.load, what, limits)
    return image


def _loaded(image: Image.Image, limits: ImageLimits) -> Image.Image:
    """A PIL image as given, checked within `limits` and decoded where it was opened lazily.

    A lazily opened image whose decoding fails keeps the pixels decoded so far, and Pillow
    takes it as loaded from then on (a second `load()` raises nothing): its failure is kept
    on the image (`DECODE_PROBLEM`), so that every later check (`generate` after `validate`,
    the step that encodes it) refuses it alike rather than run on what was partly decoded.
    """
    if (problem := limits.size_problem(*image.size) or getattr(image, DECODE_PROBLEM, None)) is not None:
        raise ImageInputError(problem)
    try:
        _pillow(image.load, "the PIL image's pixels", limits)
    except ImageInputError as exc:
        setattr(image, DECODE_PROBLEM, str(exc))
        raise
    return image


def _drafted_within(image: Image.Image, max_pixels: int) -> bool:
    """Whether the image now decodes within `max_pixels`, at the smallest reduction of the JPEG
    decoder (`Image.draft`; other formats have none) that fits."""
    width, height = image.size
    for scale in JPEG_DRAFT_SCALES:
        if math.ceil(width / scale) * math.ceil(height / scale) <= max_pixels:
            image.draft(None, (max(1, width // scale), max(1, height // scale)))
            return image.size[0] * image.size[1] <= max_pixels
    return False


def _pillow(call: Callable[[], T], what: str, limits: ImageLimits) -> T:
    """`call()`, a step of Pillow's reading of a row's image. Pillow parses hostile bytes here:
    whatever it raises (its decoders raise OSError, ValueError, SyntaxError, struct.error,
    IndexError, ...) says that the image does not decode, so every exception is the row's."""
    try:
        return call()
    except UnidentifiedImageError as exc:
        raise ImageInputError(f"{what} are not an image Pillow can decode: pass PNG, JPEG, WebP, GIF, BMP or TIFF "
                              "bytes") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageInputError(f"{what} claim more pixels than Pillow opens ({exc}): resize the image below "
                              f"{limits.max_pixels:,} pixels upstream") from exc
    except Exception as exc:
        raise ImageInputError(f"{what} do not decode as an image ({type(exc).__name__}: {exc}): the file is "
                              "truncated or corrupt; re-export it") from exc
