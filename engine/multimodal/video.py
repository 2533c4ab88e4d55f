"""Prompt videos: what a row may give, as vLLM's `multi_modal_data={"video": ...}` takes it
(a uint8 array [frames, height, width, 3], a list of PIL images, a `(frames, {"fps": f})`
tuple, or a file as encoded bytes, a local path, a `file://` or base64 `data:` URI),
checked, decoded and sampled before any work starts, each frame resized to the grid the
model's video processor gives it, with the video's content hash, which keys the encoder
cache and the prefix cache.

Frames given as frames are kept as given (transformers' Qwen2-VL video processor does not
sample them: `do_sample_frames` is off); their rate is the tuple's "fps", else 24 frames per
second (transformers' `VideoMetadata.sampled_fps` without a rate). A file is decoded with
FFmpeg (PyAV), its first video stream sampled at `VideoLimits.fps` frames per second by the
rule of transformers' `Qwen2VLVideoProcessor.sample_frames`; the kept frames' rate is then
what the sampling left of the stream's (`sampled_fps`). A queued prompt holds the kept
frames resized (uint8), never the decoded video.

A row's video is hostile input: a file's header (frame size) is checked against the
per-frame decode budget (`ImageLimits`, as an image's) before any frame is decoded, and
whatever FFmpeg raises is the row's `VideoInputError`, never a raw exception."""

import hashlib
import io
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

from engine.multimodal.image import ImageLimits
from engine.multimodal.media import MediaKind, read_location, short_location

# The rate of frames given without one: transformers' (`VideoMetadata.sampled_fps`).
UNKNOWN_FRAMES_FPS = 24.0
# The frames per second sampled from a video file when the row does not say: Qwen's.
DEFAULT_VIDEO_FPS = 2.0


class VideoInputError(ValueError):
    """A video a row gives that cannot be used; the message says why and what to do."""


# How the shared location reading (`engine.multimodal.media`) names a video in its messages.
VIDEO = MediaKind(VideoInputError, "video", "data:video/mp4;base64,...", "the largest video file read",
                  "cut the video, or re-encode it smaller, upstream")

VideoLike = np.ndarray | list | tuple | bytes | bytearray | str | Path
# The grid a model's video processor resizes frames to: (frames, height, width) -> (height, width).
FrameSize = Callable[[int, int, int], tuple[int, int]]


@dataclass(frozen=True)
class VideoLimits:
    """What a video may be for a model: each frame within `frame` (the decode budget and
    aspect ratio, as an image), between 1 and `max_frames` frames as given, a file sampled at
    `fps` frames per second into at least `min_frames` and at most `max_frames` frames (a
    multiple of `temporal_patch_size`), read from a file of at most `max_file_bytes`; the
    kept frames resized by `frame_size` (None: as they are)."""

    frame: ImageLimits = ImageLimits()
    fps: float = DEFAULT_VIDEO_FPS
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2
    frame_size: FrameSize | None = field(default=None, compare=False)
    max_file_bytes: int = 1 << 30


@dataclass(frozen=True)
class PromptVideo:
    """A prompt's video as its processor reads it: read-only uint8 `frames` [frames, height,
    width, 3], already resized to the model's grid, at `fps` frames per second (their rate),
    and its `content_hash` (`video_hash`)."""

    frames: np.ndarray
    fps: float
    content_hash: str

    @property
    def seconds(self) -> float:
        """The time the kept frames span."""
        return len(self.frames) / self.fps


def read_video(value: VideoLike, limits: VideoLimits = VideoLimits()) -> PromptVideo:
    """The video `value` gives, checked, decoded, sampled (a file) and resized.

    Raises:
        VideoInputError: no frames, frames of different sizes or of another dtype or shape,
            more than `limits.max_frames` frames given, a frame over the decode budget or of an
            aspect ratio the processor does not take, bytes that are not a video or do not
            decode, a path that does not exist or is too large, a URL the engine does not fetch,
            a rate that is not a positive number.
    """
    if isinstance(value, (bytes, bytearray)):
        kept, fps = _decode(bytes(value), "the bytes", limits)
    elif isinstance(value, (str, Path)):
        data = read_location(str(value), limits.max_file_bytes, VIDEO)
        kept, fps = _decode(data, f"the bytes of {short_location(str(value))}", limits)
    elif isinstance(value, tuple):
        frames, fps = _from_tuple(value, limits)
        kept = _fitted(frames, limits)
    elif isinstance(value, (np.ndarray, list)):
        kept, fps = _fitted(_given_frames(value, limits), limits), UNKNOWN_FRAMES_FPS
    else:
        raise VideoInputError(f"expected a uint8 array [frames, height, width, 3], a list of PIL images, (frames, "
                              f"{{'fps': f}}), encoded video bytes, a local path or a file:// or data: URI, got "
                              f"{type(value).__name__}")
    kept.setflags(write=False)  # its hash must keep naming it
    return PromptVideo(kept, fps, video_hash(kept, fps))


def video_hash(frames: np.ndarray, fps: float) -> str:
    """sha256 of the kept frames (as the processor reads them), their shape and rate: the
    same video given as frames or as a file hashes alike only where the kept frames are equal."""
    digest = hashlib.sha256(f"uint8-rgb:{'x'.join(map(str, frames.shape))}:{fps!r}:".encode())
    digest.update(np.ascontiguousarray(frames).tobytes())
    return digest.hexdigest()


def sample_indices(total: int, source_fps: float, limits: VideoLimits) -> torch.Tensor:
    """The frames kept of a `total`-frame video at `source_fps`: `limits.fps` per second, at
    least `min_frames` and at most `max_frames` (and `total`), floored to a multiple of
    `temporal_patch_size`, spread evenly from the first (transformers' `sample_frames` with
    an fps).

    Raises:
        VideoInputError: the video has fewer frames than one temporal patch.
    """
    patch = limits.temporal_patch_size
    most = math.floor(min(limits.max_frames, total) / patch) * patch
    wanted = min(max(total / source_fps * limits.fps, limits.min_frames), most, total)
    count = math.floor(wanted / patch) * patch
    if count == 0:
        raise VideoInputError(f"the video has {total} frame(s), fewer than the {patch} of one temporal patch: give a "
                              "longer video")
    return torch.arange(0, total, total / count).int()


def _from_tuple(value: tuple, limits: VideoLimits) -> tuple[np.ndarray, float]:
    """vLLM's (frames, metadata) pair: the frames and the rate the metadata's "fps" gives."""
    if len(value) != 2 or not isinstance(value[1], dict):
        return _given_frames(list(value), limits), UNKNOWN_FRAMES_FPS  # a tuple of frames
    frames, metadata = value
    fps = metadata.get("fps", UNKNOWN_FRAMES_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf:
        raise VideoInputError(f"the metadata's fps is {fps!r}: give the frames' rate as a positive number, "
                              "(frames, {'fps': 2.0})")
    return _given_frames(frames, limits), float(fps)


def _given_frames(value: object, limits: VideoLimits) -> np.ndarray:
    """Frames given as frames, as uint8 [frames, height, width, 3], checked."""
    if isinstance(value, list) and all(isinstance(frame, Image.Image) for frame in value):
        for i, frame in enumerate(value):
            if (problem := limits.frame.size_problem(*frame.size)) is not None:
                raise VideoInputError(f"frame {i}: {problem}")
        _check_count(len(value), limits)
        _check_sizes([frame.size[::-1] for frame in value])
        try:
            return np.stack([np.asarray(frame.convert("RGB")) for frame in value])
        except Exception as exc:  # a lazily opened image whose data does not decode
            raise VideoInputError(f"a frame does not decode as an image ({type(exc).__name__}: {exc}): re-export "
                                  "the frames") from exc
    if isinstance(value, list) and all(isinstance(frame, np.ndarray) for frame in value):
        _check_sizes([frame.shape[:2] for frame in value])
    try:
        frames = np.asarray(value)
    except Exception as exc:  # a ragged list, an object whose __array__ raises
        raise VideoInputError(f"the frames are not an array ({type(exc).__name__}: {exc}): give a uint8 array "
                              "[frames, height, width, 3] or a list of PIL images of one size") from exc
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoInputError(f"the frames are a {frames.dtype} array of shape {frames.shape}: give uint8 RGB "
                              "frames [frames, height, width, 3] (or a list of PIL images)")
    _check_count(len(frames), limits)
    if (problem := limits.frame.size_problem(frames.shape[2], frames.shape[1])) is not None:
        raise VideoInputError(problem)
    return frames


def _check_count(count: int, limits: VideoLimits) -> None:
    if count == 0:
        raise VideoInputError("the video has no frames: drop the row or give the frames")
    if count > limits.max_frames:
        raise VideoInputError(f"the video has {count} frames, more than the {limits.max_frames} the video processor "
                              "takes: sample fewer frames upstream, or pass the file to sample it at a rate")


def _check_sizes(sizes: list[tuple[int, ...]]) -> None:
    """Frames of one video must be of one (height, width)."""
    if len(set(sizes)) > 1:
        first = sizes[0]
        other = next(i for i, size in enumerate(sizes) if size != first)
        raise VideoInputError(f"frame {other} is {'x'.join(map(str, sizes[other]))} but frame 0 is "
                              f"{'x'.join(map(str, first))} (height x width): give frames of one size")


def _decode(data: bytes, what: str, limits: VideoLimits) -> tuple[np.ndarray, float]:
    """A video file's sampled frames, resized, and their rate: its first video stream, the frame
    size checked before any frame is decoded, the frames counted where the container does not
    say how many it holds, then the sampled ones decoded and each resized at once (at most one
    frame is held at its decoded size)."""
    with _decoder_errors(what):
        width, height, total, source_fps = _probe(data, what)
        if (problem := limits.frame.size_problem(width, height)) is not None:
            raise VideoInputError(problem)
        if total == 0:
            total = sum(1 for _ in _frames(data))
        if total == 0:
            raise VideoInputError(f"{what} hold a video stream with no frames: give a video with frames")
        wanted = set(sample_indices(total, source_fps, limits).tolist())
        size = _target_size(limits.frame_size, len(wanted), height, width)
        kept, sizes = [], []
        for i, frame in zip(range(max(wanted) + 1), _frames(data)):
            if i in wanted:
                sizes.append((frame.height, frame.width))
                kept.append(_resize(frame.to_ndarray(format="rgb24"), size))
    if len(kept) != len(wanted):
        raise VideoInputError(f"{what} decode to fewer frames than the container says ({len(kept)} of the "
                              f"{len(wanted)} sampled): the file is truncated or corrupt; re-export it")
    _check_sizes(sizes)
    return np.stack(kept), len(kept) / total * source_fps


def _probe(data: bytes, what: str) -> tuple[int, int, int, float]:
    """The first video stream's width, height, frame count (0: unknown) and average rate."""
    try:
        container = av.open(io.BytesIO(data))
    except Exception as exc:  # FFmpeg probes hostile bytes: whatever it raises says they are no video it knows
        raise VideoInputError(f"{what} are not a video FFmpeg can decode ({type(exc).__name__}): pass MP4, WebM, "
                              "MKV, AVI or MOV bytes, or the frames") from exc
    with container:
        if not container.streams.video:
            raise VideoInputError(f"{what} hold no video stream: give a video file")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise VideoInputError(f"{what} do not say the video's frame rate: re-encode it with a constant rate")
        return stream.codec_context.width, stream.codec_context.height, stream.frames, float(rate)


def _frames(data: bytes) -> Iterator[av.VideoFrame]:
    """The first video stream's decoded frames, in order."""
    with av.open(io.BytesIO(data)) as container:
        yield from container.decode(container.streams.video[0])


@contextmanager
def _decoder_errors(what: str) -> Iterator[None]:
    """FFmpeg parses hostile bytes in this block: whatever it raises says that the video does
    not decode, so every exception is the row's."""
    try:
        yield
    except VideoInputError:
        raise
    except Exception as exc:
        raise VideoInputError(f"{what} do not decode as a video ({type(exc).__name__}: {exc}): the file is "
                              "truncated or corrupt; re-export it") from exc


def _fitted(frames: np.ndarray, limits: VideoLimits) -> np.ndarray:
    """Given frames resized to the processor's grid, as a copy (the caller's array may change)."""
    size = _target_size(limits.frame_size, *frames.shape[:3])
    return np.stack([_resize(frame, size) for frame in frames])


def _target_size(frame_size: FrameSize | None, count: int, height: int, width: int) -> tuple[int, int]:
    """The (height, width) `frame_size` gives `count` frames of height x width (None: theirs).

    Raises:
        VideoInputError: the processor's rules refuse the size.
    """
    if frame_size is None:
        return height, width
    try:
        return frame_size(count, height, width)
    except Exception as exc:  # the processor's rules (transformers' smart_resize raises ValueError)
        raise VideoInputError(f"the video processor refuses {width}x{height} frames ({type(exc).__name__}: {exc}): "
                              "crop or resize the video upstream") from exc


def _resize(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """One uint8 frame resized (Pillow's bicubic) to `size` (height, width), or as it is."""
    if frame.shape[:2] == size:
        return frame
    return np.asarray(Image.fromarray(frame).resize(size[::-1], Image.Resampling.BICUBIC))
