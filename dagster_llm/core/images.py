"""A prompt table's image column: each row's images read to bytes before any work (local
paths, `file://` and `data:` URIs, object stores through the fsspec file systems the tables
use), checked to decode within the model's limits (its decode budget, read on the header
before any pixel, and the aspect ratio its image processor takes: docs/engine.md, "Images in"),
and digested, so that a row's data version follows its images' content rather than their names.

A cell is one image or a list of them; an image is encoded bytes (Parquet binary), a path
or URI, or a `{"bytes", "path"}` struct (how Hugging Face datasets store images)."""

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pandas as pd
from upath import UPath

from dagster_llm.core.engine_surface import ImageInputError, ImageLimits, load_image

# Images read at once: an object store answers each request slowly, but many side by side.
READ_THREADS = 16
# Protocols of the local file system, whose devices and pipes are refused unread (a read of
# /dev/zero never ends).
LOCAL_PROTOCOLS = ("", "file", "local")


@dataclass(frozen=True)
class RowImages:
    """A row's images, in order: their encoded bytes and each one's sha256 (hex), or why the
    row cannot use them (`problem`, which names the image and the fix; then both lists are empty)."""

    data: list[bytes] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    problem: str | None = None


def read_images(cells: Sequence[object], limits: ImageLimits = ImageLimits()) -> list[RowImages]:
    """Each cell's images, read and checked against the model's `limits` (`LLM.image_limits`)
    on `READ_THREADS` threads."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(lambda cell: _read_cell(cell, limits), cells))


def _read_cell(cell: object, limits: ImageLimits) -> RowImages:
    sources = _sources(cell)
    data = []
    for index, source in enumerate(sources):
        where = f"image {index + 1} of {len(sources)}: " if len(sources) > 1 else ""
        try:
            blob = _read(source, limits)
            load_image(blob, limits)  # decoded here too, so a row's broken image is its error before any work
        except ImageInputError as exc:
            return RowImages(problem=f"{where}{exc}")
        data.append(blob)
    return RowImages(data, [hashlib.sha256(blob).hexdigest() for blob in data])


def _sources(cell: object) -> list[object]:
    """The images of a cell: none for a null cell, the items of a list (a numpy array from
    Parquet), else the one image."""
    cell = cell.tolist() if hasattr(cell, "tolist") else cell
    if isinstance(cell, (list, tuple)):
        return list(cell)
    if cell is None or (not isinstance(cell, (bytes, bytearray, str, dict)) and pd.isna(cell)):
        return []
    return [cell]


def _read(source: object, limits: ImageLimits) -> bytes:
    """The encoded bytes of one image.

    Raises:
        ImageInputError: a location that cannot be read, a local device, pipe or file larger
            than an image within the limits, or a value that names no image.
    """
    if isinstance(source, dict) and ("bytes" in source or "path" in source):
        source = source.get("bytes") if source.get("bytes") is not None else source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        shown = " ".join(repr(source).split())[:40]  # on one line: a numpy array's repr spans several
        raise ImageInputError(f"expected encoded image bytes, a path or a URI (file://, data:, s3://, gs://, ...), "
                              f"got {type(source).__name__} {shown}: fix the cell upstream")
    try:
        return _read_location(UPath(source), source, limits)
    except ImageInputError:
        raise
    except FileNotFoundError:
        raise ImageInputError(f"{_short(source)}: no such file or object: fix the path or drop the row") from None
    except (OSError, ValueError, ImportError) as exc:  # permissions, network, an unknown protocol
        raise ImageInputError(f"{_short(source)}: cannot be read ({type(exc).__name__}: {exc}): fix the location, "
                              "or the store's credentials (AWS_*, Google's, AZURE_STORAGE_* environment)") from None


def _read_location(path: UPath, source: str, limits: ImageLimits) -> bytes:
    """The bytes at `path`; on the local file system only a file of at most `limits.max_file_bytes`
    (an object store's objects are read as they are: a stat would cost a request each)."""
    if path.protocol in LOCAL_PROTOCOLS and path.exists():
        if not path.is_file():
            raise ImageInputError(f"{_short(source)}: is not a file (a directory, device or pipe): give the path "
                                  "of an image file")
        if (size := path.stat().st_size) > limits.max_file_bytes:
            raise ImageInputError(f"{_short(source)}: is {size:,} bytes, more than an image within the decode budget "
                                  f"takes ({limits.max_file_bytes:,}): give the image file itself, resized")
    return path.read_bytes()


def _short(location: str) -> str:
    """A location as a one-line error shows it: quoted where it holds an unprintable character,
    its middle cut where it is long."""
    shown = location if location.isprintable() else repr(location)
    return shown if len(shown) <= 100 else shown[:70] + "..." + shown[-20:]
