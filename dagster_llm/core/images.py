"""A prompt table's image column: each row's images read to bytes before any work (local
paths, `file://` and `data:` URIs, object stores through the fsspec file systems the tables
use), checked to decode, and digested, so that a row's data version follows its images'
content rather than their names.

A cell is one image or a list of them; an image is encoded bytes (Parquet binary), a path
or URI, or a `{"bytes", "path"}` struct (how Hugging Face datasets store images)."""

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pandas as pd
from upath import UPath

from engine.multimodal.image import ImageInputError, load_image

# Images read at once: an object store answers each request slowly, but many side by side.
READ_THREADS = 16


@dataclass(frozen=True)
class RowImages:
    """A row's images, in order: their encoded bytes and each one's sha256 (hex), or why the
    row cannot use them (`problem`, which names the image and the fix; then both lists are empty)."""

    data: list[bytes] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    problem: str | None = None


def read_images(cells: Sequence[object]) -> list[RowImages]:
    """Each cell's images, read and checked on `READ_THREADS` threads."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(_read_cell, cells))


def _read_cell(cell: object) -> RowImages:
    sources = _sources(cell)
    data = []
    for index, source in enumerate(sources):
        where = f"image {index + 1} of {len(sources)}: " if len(sources) > 1 else ""
        try:
            blob = _read(source)
            load_image(blob)  # decoded here too, so a row's broken image is its error before any work
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


def _read(source: object) -> bytes:
    """The encoded bytes of one image.

    Raises:
        ImageInputError: a location that cannot be read, or a value that names no image.
    """
    if isinstance(source, dict) and ("bytes" in source or "path" in source):
        source = source.get("bytes") if source.get("bytes") is not None else source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise ImageInputError(f"expected encoded image bytes, a path or a URI (file://, data:, s3://, gs://, ...), "
                              f"got {type(source).__name__} {source!r:.40}: fix the cell upstream")
    try:
        return UPath(source).read_bytes()
    except FileNotFoundError:
        raise ImageInputError(f"{_short(source)}: no such file or object: fix the path or drop the row") from None
    except (OSError, ValueError, ImportError) as exc:  # permissions, network, an unknown protocol
        raise ImageInputError(f"{_short(source)}: cannot be read ({type(exc).__name__}: {exc}): fix the location, "
                              "or the store's credentials (AWS_*, Google's, AZURE_STORAGE_* environment)") from None


def _short(location: str) -> str:
    return location if len(location) <= 100 else location[:70] + "..." + location[-20:]
