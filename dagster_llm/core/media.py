"""A prompt table's media columns (`image_column`, `audio_column`, `video_column`): each row's items read
before any work (local paths, `file://` and `data:` URIs, object stores through the fsspec
file systems the tables use), checked with the engine's own readers against the model's limits
(an image's decode budget and aspect ratio, read on its header before any pixel; a clip's
sample rate and length; a video's frames: docs/engine.md, "Images in", "Audio in" and "Video
in"), and digested, so that a row's data version follows its items' content rather than their
names.

A cell is one item or a list of them; an item is encoded bytes (Parquet binary), a path or
URI, or Hugging Face datasets' struct: `{"bytes", "path"}` (images, audio files), or a decoded
clip `{"array", "sampling_rate"}`."""

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from upath import UPath

from dagster_llm.core.engine_surface import IMAGE, ImageLimits, MediaKind, load_image, short_location

if TYPE_CHECKING:
    from dagster_llm.core.engine_surface import AudioLimits, VideoLimits

# Items read at once: an object store answers each request slowly, but many side by side.
READ_THREADS = 16
# Protocols of the local file system, whose devices and pipes are refused unread (a read of
# /dev/zero never ends).
LOCAL_PROTOCOLS = ("", "file", "local")


@dataclass(frozen=True)
class MediaColumn:
    """How one modality's column is read for a model: `modality` is its `multi_modal_data`
    key, `kind` names it in messages (the engine's), `max_file_bytes` caps a local file, and
    `check` decodes an item as the engine will, raising `kind.error` where it cannot."""

    modality: str
    kind: MediaKind
    max_file_bytes: int
    check: Callable[[object], object]


def image_column(limits: ImageLimits | None = None) -> MediaColumn:
    """An image column for a model whose images may be `limits` (`LLM.image_limits`; None:
    the engine's defaults)."""
    limits = limits or ImageLimits()
    return MediaColumn("image", IMAGE, limits.max_file_bytes, lambda item: load_image(item, limits))


def audio_column(limits: "AudioLimits | None" = None) -> MediaColumn:
    """An audio column for a model whose clips may be `limits` (`LLM.audio_limits`; None: the
    engine's defaults)."""
    # Imported here: the engine's audio reader loads its decoders (libsndfile, FFmpeg), which a
    # code location's definitions without an audio column do not need.
    from dagster_llm.core.engine_surface import AUDIO, AudioLimits, read_audio

    limits = limits or AudioLimits()
    return MediaColumn("audio", AUDIO, limits.max_file_bytes, lambda item: read_audio(item, limits))


def video_column(limits: "VideoLimits | None" = None) -> MediaColumn:
    """A video column for a model whose videos may be `limits` (`LLM.video_limits`; None: the
    engine's defaults)."""
    # Imported here: the engine's video reader loads FFmpeg and torch.
    from dagster_llm.core.engine_surface import VIDEO, VideoLimits, read_video

    limits = limits or VideoLimits()
    return MediaColumn("video", VIDEO, limits.max_file_bytes, lambda item: read_video(item, limits))


@dataclass(frozen=True)
class RowItems:
    """A row's items, in order: each as the engine takes it (encoded bytes, or a decoded clip's
    `(samples, sample_rate)`) and its sha256 (hex), or why the row cannot use them (`problem`,
    which names the item and the fix; then both lists are empty)."""

    data: list[object] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    problem: str | None = None


def read_column(cells: Sequence[object], column: MediaColumn) -> list[RowItems]:
    """Each cell's items, read and checked on `READ_THREADS` threads."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(lambda cell: _read_cell(cell, column), cells))


def _read_cell(cell: object, column: MediaColumn) -> RowItems:
    sources = _sources(cell)
    data = []
    for index, source in enumerate(sources):
        where = f"{column.kind.noun} {index + 1} of {len(sources)}: " if len(sources) > 1 else ""
        try:
            item = _read(source, column)
            column.check(item)  # decoded here too, so a row's broken item is its error before any work
        except column.kind.error as exc:
            return RowItems(problem=f"{where}{exc}")
        data.append(item)
    return RowItems(data, [_digest(item) for item in data])


def _sources(cell: object) -> list[object]:
    """The items of a cell: none for a null cell, the items of a list (a numpy array from
    Parquet), else the one item."""
    cell = cell.tolist() if hasattr(cell, "tolist") else cell
    if isinstance(cell, (list, tuple)):
        return list(cell)
    if cell is None or (not isinstance(cell, (bytes, bytearray, str, dict)) and pd.isna(cell)):
        return []
    return [cell]


def _read(source: object, column: MediaColumn) -> object:
    """One item as the engine takes it: encoded bytes, or a decoded clip's (samples, rate).

    Raises:
        column.kind.error: a location that cannot be read, a local device, pipe or file larger
            than `column.max_file_bytes`, or a value that names no item.
    """
    if isinstance(source, dict) and "array" in source and "sampling_rate" in source and column.modality == "audio":
        return (source["array"], source["sampling_rate"])  # read_audio checks both
    if isinstance(source, dict) and ("bytes" in source or "path" in source):
        source = source.get("bytes") if source.get("bytes") is not None else source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    kind = column.kind
    if not isinstance(source, str) or not source:
        shown = " ".join(repr(source).split())[:40]  # on one line: a numpy array's repr spans several
        raise kind.error(f"expected encoded {kind.noun} bytes, a path or a URI (file://, data:, s3://, gs://, ...), "
                         f"got {type(source).__name__} {shown}: fix the cell upstream")
    try:
        return _read_location(UPath(source), source, column)
    except kind.error:
        raise
    except FileNotFoundError:
        raise kind.error(f"{short_location(source)}: no such file or object: fix the path or drop the row") from None
    except (OSError, ValueError, ImportError) as exc:  # permissions, network, an unknown protocol
        raise kind.error(f"{short_location(source)}: cannot be read ({type(exc).__name__}: {exc}): fix the location, "
                         "or the store's credentials (AWS_*, Google's, AZURE_STORAGE_* environment)") from None


def _read_location(path: UPath, source: str, column: MediaColumn) -> bytes:
    """The bytes at `path`; on the local file system only a file of at most `max_file_bytes`
    (an object store's objects are read as they are: a stat would cost a request each)."""
    kind = column.kind
    if path.protocol in LOCAL_PROTOCOLS and path.exists():
        if not path.is_file():
            raise kind.error(f"{short_location(source)}: is not a file (a directory, device or pipe): give the path "
                             f"of an {kind.noun} file")
        if (size := path.stat().st_size) > column.max_file_bytes:
            raise kind.error(f"{short_location(source)}: is {size:,} bytes, more than {kind.cap} "
                             f"({column.max_file_bytes:,}): {kind.shrink}")
    return path.read_bytes()


def _digest(item: object) -> str:
    """sha256 (hex) of an item's bytes; of a decoded clip, of its float32 samples and rate."""
    if isinstance(item, bytes):
        return hashlib.sha256(item).hexdigest()
    samples, rate = item
    digest = hashlib.sha256(f"float32:{rate}:".encode())
    digest.update(np.ascontiguousarray(samples, dtype="<f4").tobytes())
    return digest.hexdigest()
