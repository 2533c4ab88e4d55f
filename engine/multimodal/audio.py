"""Prompt audio: what a row may give, as vLLM's `multi_modal_data={"audio": ...}` takes it
(a `(waveform, sample_rate)` tuple, encoded bytes, a local path, a `file://` or base64 `data:`
URI), checked, decoded, downmixed to mono and resampled to the model's feature extractor's
rate before any work starts, with each clip's content hash, which keys the encoder cache and
the prefix cache. The row check reads a prompt's clips with it, for a model that reads audio
(Qwen2-Audio); the others refuse them.

A row's audio is hostile input, read through kept libraries: libsndfile (`soundfile`: WAV,
FLAC, OGG Vorbis/Opus, MP3) first, FFmpeg (PyAV) for what it does not read (M4A/AAC, WebM,
...), and scipy's polyphase resampler. A file's header (rate, channels, length) is checked
before its samples are decoded, the length again while they are, and whatever a decoder
raises is the row's `AudioInputError`, never a raw exception. At most the clip's mono
waveform at its own rate is held while it decodes (`AudioLimits.max_seconds` bounds it).

A waveform given as an array is floating-point samples (nominally in [-1, 1], as decoders
give them), 1-D, or 2-D as [channels, samples] or [samples, channels]: the shorter axis is the
channels' (at most `MAX_CHANNELS`; a square array is refused as ambiguous). Integer arrays are
refused rather than guessed at (PCM codes or values?). Channels are averaged to mono, as the
feature extractors (Whisper's, Qwen2-Audio's) take one channel. Unlike vLLM, a bare array
without its rate is refused: the engine does not assume it is at the model's rate."""

import hashlib
import io
import math
import numbers
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import av
import numpy as np
import soundfile

from engine.multimodal.media import MediaKind, read_location, short_location

# Sample rates a clip may have: telephone audio is 8 kHz; studio masters go up to 192 kHz.
# Outside, the rate is a mistake (a rate in kHz, a header gone bad).
MIN_SAMPLE_RATE = 1_000
MAX_SAMPLE_RATE = 192_000
# The most channels a clip may have: FFmpeg's layouts go up to 64 (22.2 surround has 24).
MAX_CHANNELS = 64
# Frames libsndfile decodes at a time: each block is downmixed before the next is read.
BLOCK_FRAMES = 1 << 16
# What a file's decoders read, as the message of bytes they cannot decode names it.
DECODED_FORMATS = "WAV, FLAC, OGG (Vorbis, Opus), MP3, M4A/AAC or WebM"


class AudioInputError(ValueError):
    """An audio clip a row gives that cannot be used; the message says why and what to do."""


# How the shared location reading (`engine.multimodal.media`) names audio in its messages.
AUDIO = MediaKind(AudioInputError, "audio", "data:audio/wav;base64,...", "the largest audio file read",
                  "cut the clip, or re-encode it compressed (FLAC, MP3, Opus), upstream")

AudioLike = tuple[object, int | float] | bytes | bytearray | str | Path


@dataclass(frozen=True)
class AudioLimits:
    """What a clip may be for a model: resampled to `sample_rate` (its feature extractor's
    `sampling_rate`: 16 kHz for Whisper, Qwen2-Audio and Voxtral), at most `max_seconds` long
    (an hour by default: a meeting; a model's own window rules come with the model), read from
    a file of at most `max_file_bytes` (256 MiB by default: an hour of 16 kHz 16-bit mono WAV is
    115 MB, of 320 kbit/s MP3 144 MB)."""

    sample_rate: int = 16_000
    max_seconds: float = 3600.0
    max_file_bytes: int = 256 << 20

    def length_problem(self, samples: int, rate: int, so_far: bool = False) -> str | None:
        """Why a clip of `samples` at `rate` Hz is too long, or None; `so_far` when decoding
        stopped there, so that the clip is at least that long."""
        if samples <= self.max_seconds * rate:
            return None
        length = f"{'over ' if so_far else ''}{samples / rate:,.1f} s"
        return (f"the clip is {length} long, more than the {self.max_seconds:g} s accepted: cut it into shorter "
                "clips upstream")


@dataclass(frozen=True)
class PromptAudio:
    """A prompt's audio clip as the feature extractor reads it: a read-only float32 mono
    `waveform` at `sample_rate` (the limits'), and its `content_hash` (`audio_hash`)."""

    waveform: np.ndarray
    sample_rate: int
    content_hash: str

    @property
    def seconds(self) -> float:
        """The clip's duration."""
        return len(self.waveform) / self.sample_rate


def read_audio(value: AudioLike, limits: AudioLimits = AudioLimits()) -> PromptAudio:
    """The clip `value` gives, checked, decoded, downmixed to mono and resampled to
    `limits.sample_rate`.

    Raises:
        AudioInputError: bytes that are not audio or do not decode, a path that does not exist,
            is not a file or is larger than `limits.max_file_bytes`, a URL the engine does not
            fetch, a clip with no samples, non-finite samples, too many channels or longer than
            `limits.max_seconds`, a sample rate out of range, an array of another dtype or shape.
    """
    if isinstance(value, tuple):
        mono, rate = _from_array(value, limits)
    elif isinstance(value, (bytes, bytearray)):
        mono, rate = _decode(bytes(value), "the bytes", limits)
    elif isinstance(value, (str, Path)):
        data = read_location(str(value), limits.max_file_bytes, AUDIO)
        mono, rate = _decode(data, f"the bytes of {short_location(str(value))}", limits)
    else:
        bare = ": a waveform needs its sample rate beside it" if isinstance(value, (list, np.ndarray)) else ""
        raise AudioInputError(f"expected (waveform, sample_rate), encoded audio bytes, a local path or a file:// or "
                              f"data: URI, got {type(value).__name__}{bare}")
    waveform = _resample(_checked(mono), rate, limits.sample_rate)
    waveform.setflags(write=False)  # its hash must keep naming it
    return PromptAudio(waveform, limits.sample_rate, audio_hash(waveform, limits.sample_rate))


def audio_hash(waveform: np.ndarray, sample_rate: int) -> str:
    """sha256 of the float32 mono samples the feature extractor reads and their rate. It keys
    what the encoder sees, not the file: the same clip given as a float array, WAV or FLAC
    (lossless) hashes alike, while an MP3 of it (other samples), or the clip at another
    source rate (resampled to other samples), does not. -0.0 hashes as 0.0: they compare
    equal, and an extractor reads them alike (a float array may hold -0.0 where a decoder gives 0.0)."""
    digest = hashlib.sha256(f"float32-mono:{sample_rate}:".encode())
    digest.update((np.asarray(waveform, dtype="<f4") + np.float32(0)).tobytes())  # -0.0 + 0.0 is 0.0
    return digest.hexdigest()


def _from_array(value: tuple, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """A `(waveform, sample_rate)` tuple's mono samples (float32) and rate."""
    if len(value) != 2:
        raise AudioInputError(f"expected a (waveform, sample_rate) pair, got a tuple of length {len(value)}")
    waveform, given_rate = value
    rate = _rate(given_rate, limits)
    try:
        samples = np.asarray(waveform)
    except Exception as exc:  # a ragged list, an object whose __array__ raises
        raise AudioInputError(f"the waveform is not an array of samples ({type(exc).__name__}: {exc}): give a 1-D "
                              "float array, or [channels, samples]") from exc
    if samples.dtype.kind != "f":
        hint = " (e.g. int16 samples / 32768)" if samples.dtype.kind in "iu" else ""
        raise AudioInputError(f"the waveform's samples are {samples.dtype}: give floating-point samples in [-1, 1]"
                              f"{hint}, or the encoded file")
    if samples.size == 0:
        raise AudioInputError(f"the waveform has no samples (shape {samples.shape}): drop the row or fix the audio")
    channels = _channels_first(samples)
    _check_stream(rate, *channels.shape, limits)
    return _downmix(channels, 0), rate  # a new array: the caller's stays theirs (and writable)


def _channels_first(samples: np.ndarray) -> np.ndarray:
    """A waveform as [channels, samples]: a 1-D one as one channel; of a 2-D one, the shorter
    axis is the channels'."""
    if samples.ndim == 1:
        return samples[None, :]
    if samples.ndim != 2:
        raise AudioInputError(f"the waveform has shape {samples.shape}: give [samples], [channels, samples] or "
                              "[samples, channels]")
    if samples.shape[0] == samples.shape[1] > 1:
        raise AudioInputError(f"the waveform has shape {samples.shape}, which does not say which axis is the "
                              "channels': give [channels, samples] with fewer channels than samples")
    return samples if samples.shape[0] < samples.shape[1] else samples.T


def _rate(rate: object, limits: AudioLimits) -> int:
    """A given sample rate as a whole number of Hz within the accepted range."""
    whole = isinstance(rate, numbers.Integral) or (isinstance(rate, numbers.Real) and float(rate).is_integer())
    if isinstance(rate, bool) or not whole or not MIN_SAMPLE_RATE <= int(rate) <= MAX_SAMPLE_RATE:
        raise AudioInputError(f"a sample rate of {rate!r} is not usable: give the clip's own rate, a whole number of "
                              f"Hz from {MIN_SAMPLE_RATE:,} to {MAX_SAMPLE_RATE:,} (the engine resamples it to the "
                              f"model's {limits.sample_rate:,} Hz)")
    return int(rate)


def _check_stream(rate: int, channels: int, frames: int | None, limits: AudioLimits) -> None:
    """Refuse a clip on what its header (or its array's shape) says: its rate, its channels
    and, where known before decoding, its length in frames."""
    _rate(rate, limits)
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioInputError(f"the clip has {channels} channels, not 1 to {MAX_CHANNELS}: downmix it upstream, or "
                              "give [channels, samples]")
    if frames is not None and (problem := limits.length_problem(frames, rate)) is not None:
        raise AudioInputError(problem)


def _downmix(samples: np.ndarray, channel_axis: int) -> np.ndarray:
    """The channels' average (in float64, so that loud channels do not overflow), as float32."""
    with np.errstate(over="ignore"):  # an average beyond float32's range becomes inf, refused after
        return samples.mean(axis=channel_axis, dtype=np.float64).astype(np.float32)


def _decode(data: bytes, what: str, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """Encoded audio's mono samples and rate: libsndfile's where it reads the format, else
    FFmpeg's."""
    if not data:
        raise AudioInputError(f"{what} are empty: drop the row or give the audio file")
    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except Exception:  # a format libsndfile does not read, or no audio at all: FFmpeg's turn
        return _decode_ffmpeg(data, what, limits)
    with _decoder_errors(what), sound:
        rate, channels = sound.samplerate, sound.channels
        _check_stream(rate, channels, sound.frames, limits)
        blocks = sound.blocks(BLOCK_FRAMES, dtype="float32", always_2d=True)
        return _collect((_downmix(block, 1) for block in blocks), rate, limits), rate


def _decode_ffmpeg(data: bytes, what: str, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """Encoded audio's mono samples and rate, through FFmpeg: its first audio stream, each
    frame converted to float planar samples at the stream's rate and layout, then downmixed."""
    try:
        container = av.open(io.BytesIO(data))
    except Exception as exc:  # FFmpeg probes hostile bytes: whatever it raises says they are no audio it knows
        raise AudioInputError(f"{what} are not audio soundfile or FFmpeg can decode ({type(exc).__name__}): pass "
                              f"{DECODED_FORMATS} bytes, or (waveform, sample_rate)") from exc
    with _decoder_errors(what), container:
        if not container.streams.audio:
            raise AudioInputError(f"{what} hold no audio stream: give an audio file ({DECODED_FORMATS})")
        stream = container.streams.audio[0]
        rate = stream.rate
        _check_stream(rate, stream.channels, None, limits)
        resampler = av.AudioResampler(format="fltp", rate=rate)
        frames = chain.from_iterable(resampler.resample(frame) for frame in container.decode(stream))
        converted = chain(frames, resampler.resample(None))  # None flushes the resampler
        return _collect((_downmix(frame.to_ndarray(), 0) for frame in converted), rate, limits), rate


@contextmanager
def _decoder_errors(what: str) -> Iterator[None]:
    """The decoders parse hostile bytes in this block: whatever they raise (libsndfile's
    errors, FFmpeg's, numpy's on what they return) says that the audio does not decode, so
    every exception is the row's."""
    try:
        yield
    except AudioInputError:
        raise
    except Exception as exc:
        raise AudioInputError(f"{what} do not decode as audio ({type(exc).__name__}: {exc}): the file is truncated "
                              "or corrupt; re-export it") from exc


def _collect(blocks: Iterable[np.ndarray], rate: int, limits: AudioLimits) -> np.ndarray:
    """The mono blocks a decoder gives, joined, refused as soon as they pass `limits.max_seconds`."""
    kept, count = [], 0
    for block in blocks:
        count += len(block)
        if (problem := limits.length_problem(count, rate, so_far=True)) is not None:
            raise AudioInputError(problem)
        kept.append(block)
    return np.concatenate(kept) if kept else np.zeros(0, np.float32)


def _checked(mono: np.ndarray) -> np.ndarray:
    """`mono` (float32 samples), refused when empty or non-finite (its length is checked as it is read)."""
    if mono.size == 0:
        raise AudioInputError("the clip has no samples: drop the row or fix the audio")
    if (bad := int(mono.size - np.count_nonzero(np.isfinite(mono)))) > 0:
        raise AudioInputError(f"the clip has {bad:,} non-finite samples (NaN or infinite, or beyond float32's range): "
                              "fix the audio upstream (e.g. numpy.nan_to_num, or clip it to [-1, 1])")
    return mono


def _resample(mono: np.ndarray, rate: int, target: int) -> np.ndarray:
    """`mono` at `rate` resampled to `target` Hz by scipy's polyphase filter (the exact ratio,
    reduced), float32."""
    if rate == target:
        return mono
    step = math.gcd(rate, target)
    # Imported here: scipy.signal takes most of a second to import, and the engine's row
    # checks (which import this module) load with `from engine import LLM`.
    from scipy.signal import resample_poly

    return resample_poly(mono, target // step, rate // step).astype(np.float32, copy=False)
