"""Prompt images: what a row may give (a PIL image, encoded bytes, a local path, a `file://`
or `data:` URI), decoded and checked before any work starts, and each image's content hash,
which keys the encoder cache and the prefix cache."""

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

# Modes an image processor can convert to RGB without losing what the image shows.
SUPPORTED_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1")


class ImageInputError(ValueError):
    """An image a row gives that cannot be used; the message says why and what to do."""


ImageLike = Image.Image | bytes | bytearray | str | Path


def load_image(value: ImageLike) -> Image.Image:
    """The image `value` names, decoded in full, in a mode an image processor reads.

    Raises:
        ImageInputError: bytes that are not an image or are cut short, a path that does not
            exist, a URL the engine does not fetch (http, s3: it reads nothing from the
            network), an unsupported mode (e.g. 16-bit or float images).
    """
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (bytes, bytearray)):
        image = _decode(bytes(value), "the bytes")
    elif isinstance(value, (str, Path)):
        image = _decode(_read_location(str(value)), _short(str(value)))
    else:
        raise ImageInputError(f"expected a PIL image, encoded image bytes, a local path or a file:// or data: URI, "
                              f"got {type(value).__name__}")
    if image.mode not in SUPPORTED_MODES:
        raise ImageInputError(f"mode {image.mode!r} is not supported (supported: {', '.join(SUPPORTED_MODES)}): "
                              "convert the image to RGB upstream (e.g. Image.convert('RGB') after scaling)")
    if min(image.size) < 1:
        raise ImageInputError(f"the image is empty ({image.size[0]}x{image.size[1]}): drop the row or fix the image")
    return image


@dataclass(frozen=True)
class PromptImage:
    """A prompt's image: decoded (to check and hash it, and to count its tokens), and what it
    was read from, kept compact until its encoder inputs are made (PIL images as given,
    everything else as its encoded bytes: a path is read once, when the row is checked)."""

    image: Image.Image
    source: Image.Image | bytes


def read_image(value: ImageLike) -> PromptImage:
    """The image `value` names, decoded, with its compact source.

    Raises:
        ImageInputError: as `load_image`.
    """
    source = value
    if isinstance(value, (bytes, bytearray)):
        source = bytes(value)
    elif isinstance(value, (str, Path)):
        source = _read_location(str(value))
    return PromptImage(load_image(source), source)


def image_hash(image: Image.Image) -> str:
    """sha256 of the decoded pixels, mode and size: equal for the same picture however it was
    given (bytes, path, PIL object), different for any other."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _read_location(location: str) -> bytes:
    """The bytes of a local path, `file://` or `data:` URI."""
    if location.startswith("data:"):
        header, _, payload = location.partition(",")
        if not header.endswith(";base64"):
            raise ImageInputError("a data: URI must be base64-encoded (data:image/png;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageInputError(f"the data: URI's base64 payload does not decode ({exc}): fix the encoding") from exc
    scheme = urlparse(location).scheme
    if scheme == "file":
        path = Path(unquote(urlparse(location).path))
    elif scheme and len(scheme) > 1:  # "C:" is a Windows drive, not a scheme
        raise ImageInputError(f"{_short(location)}: the engine does not fetch {scheme}:// URLs (it reads nothing "
                              "from the network): download the image and pass its bytes or a local path")
    else:
        path = Path(location).expanduser()
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ImageInputError(f"{path}: cannot be read ({exc.strerror or exc}): fix the path") from exc


def _decode(data: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError as exc:
        raise ImageInputError(f"{what} are not an image Pillow can decode: pass PNG, JPEG, WebP, GIF, BMP or TIFF "
                              "bytes") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageInputError(f"{what} do not decode as an image ({exc}): the file is truncated or corrupt; "
                              "re-export it") from exc
    return image


def _short(location: str) -> str:
    return location if len(location) <= 80 else location[:60] + "..." + location[-12:]
