"""Prompt audio read before any work (engine/multimodal/audio.py, issue 65): every form a row may
give decodes to the same samples, resampling keeps a sine's pitch, channels are averaged, the
content hash follows the samples, each bad input is an `AudioInputError` naming what is wrong,
and no hostile input (random or corrupted bytes, odd arrays, rates and objects) escapes as any
other exception. Clips are a fraction of a second, made in memory."""

import base64
import io
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.multimodal.audio import (
    MAX_CHANNELS, MAX_SAMPLE_RATE, AudioInputError, AudioLimits, PromptAudio, audio_hash, read_audio,
)
from tests.fuzzing import examples

RATE = 16_000


def sine(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    """A sine quantised to 16-bit steps (k / 32768), so that 16-bit WAV and FLAC keep it exactly."""
    t = np.arange(int(rate * seconds)) / rate
    return (np.round(amplitude * np.sin(2 * np.pi * freq * t) * 32768) / 32768).astype(np.float32)


def encode_soundfile(samples: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    """`samples` ([samples] or [samples, channels]) encoded by libsndfile in memory."""
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def encode_ffmpeg(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """Mono `samples` encoded by FFmpeg (PyAV) in memory."""
    out = io.BytesIO()
    with av.open(out, "w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            muxer.mux(packet)
    return out.getvalue()


def peak_hz(audio: PromptAudio) -> float:
    """The frequency of the largest FFT bin of a clip."""
    spectrum = np.abs(np.fft.rfft(audio.waveform))
    return float(np.fft.rfftfreq(len(audio.waveform), 1 / audio.sample_rate)[np.argmax(spectrum)])


TONE = sine(440, RATE, 0.5)
TONE_WAV = encode_soundfile(TONE, RATE, "WAV", "PCM_16")


def test_each_form_gives_the_same_samples(tmp_path: Path) -> None:
    path = tmp_path / "tone.wav"
    path.write_bytes(TONE_WAV)
    forms = {
        "tuple": (TONE, RATE), "list": (TONE.tolist(), RATE), "float64": (TONE.astype(np.float64), 16000.0),
        "wav": TONE_WAV, "bytearray": bytearray(TONE_WAV), "flac": encode_soundfile(TONE, RATE, "FLAC", "PCM_16"),
        "path": str(path), "Path": path, "file uri": path.as_uri(),
        "data uri": "data:audio/wav;base64," + base64.b64encode(TONE_WAV).decode(),
    }
    reads = {name: read_audio(value) for name, value in forms.items()}
    for name, audio in reads.items():
        assert audio.waveform.dtype == np.float32 and audio.sample_rate == RATE, name
        np.testing.assert_array_equal(audio.waveform, TONE, err_msg=name)
        assert audio.content_hash == audio_hash(TONE, RATE), name
    assert reads["wav"].seconds == 0.5


def _lossy_cases() -> list:
    """Lossy encodings of the tone, each skipped where the installed wheel cannot encode it."""
    def soundfile_case(fmt: str, subtype: str):
        usable = subtype in soundfile.available_subtypes(fmt)
        return pytest.param(lambda: encode_soundfile(TONE, RATE, fmt, subtype), id=f"{fmt}-{subtype}",
                            marks=pytest.mark.skipif(not usable, reason=f"libsndfile here writes no {fmt} {subtype}"))

    def ffmpeg_case(container: str, codec: str):
        try:
            av.codec.Codec(codec, "w")
            usable = True
        except Exception:
            usable = False
        rate = 48_000 if codec == "libopus" else RATE  # Opus encodes 48 kHz
        return pytest.param(lambda: encode_ffmpeg(sine(440, rate, 0.5), rate, container, codec),
                            id=f"{container}-{codec}",
                            marks=pytest.mark.skipif(not usable, reason=f"this FFmpeg build has no {codec} encoder"))

    return [soundfile_case("MP3", "MPEG_LAYER_III"), soundfile_case("OGG", "VORBIS"),
            ffmpeg_case("mp4", "aac"), ffmpeg_case("webm", "libopus")]


@pytest.mark.parametrize("encode", _lossy_cases())
def test_lossy_formats_decode(encode) -> None:
    audio = read_audio(encode())
    assert audio.sample_rate == RATE and abs(audio.seconds - 0.5) < 0.1  # encoder delay and padding
    assert abs(peak_hz(audio) - 440) <= 2 / audio.seconds  # within two FFT bins
    assert audio.content_hash != audio_hash(TONE, RATE)  # other samples than the lossless tone


def test_resampling_keeps_a_sines_frequency() -> None:
    audio = read_audio((sine(1000, 44_100, 0.5), 44_100))
    assert audio.sample_rate == RATE and len(audio.waveform) == 8000
    assert abs(peak_hz(audio) - 1000) <= 2
    assert 0.45 < np.abs(audio.waveform[1000:-1000]).max() < 0.55  # the amplitude kept, edges aside


def test_channels_are_averaged() -> None:
    left, right = sine(440, RATE, 0.25), sine(880, RATE, 0.25, amplitude=0.25)
    mean = ((left.astype(np.float64) + right) / 2).astype(np.float32)
    stereo_wav = encode_soundfile(np.stack([left, right], axis=1), RATE, "WAV", "PCM_16")
    for value in [(np.stack([left, right]), RATE), (np.stack([left, right], axis=1), RATE), stereo_wav]:
        np.testing.assert_array_equal(read_audio(value).waveform, mean)


def test_the_hash_follows_the_samples() -> None:
    changed = TONE.copy()
    changed[100] += 1 / 32768
    assert read_audio((TONE, RATE)).content_hash == read_audio(TONE_WAV).content_hash
    assert read_audio((changed, RATE)).content_hash != read_audio((TONE, RATE)).content_hash
    assert read_audio((TONE, RATE), AudioLimits(sample_rate=8000)).content_hash != audio_hash(TONE[::2], RATE)
    assert audio_hash(np.array([-0.0, 0.5]), RATE) == audio_hash(np.array([0.0, 0.5]), RATE)  # equal samples


def test_the_waveform_is_read_only_and_the_callers_array_stays_theirs() -> None:
    given_samples = TONE.copy()
    audio = read_audio((given_samples, RATE))
    assert not audio.waveform.flags.writeable and given_samples.flags.writeable
    given_samples[0] = 0.25
    assert audio.content_hash == audio_hash(audio.waveform, RATE)


def silent_video() -> bytes:
    """A one-frame video with no audio stream (FFmpeg opens it; it holds nothing to hear)."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as muxer:
        stream = muxer.add_stream("mpeg4", rate=1)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            muxer.mux(packet)
    return out.getvalue()


BAD_INPUTS = {
    "empty bytes": (b"", "the bytes are empty"),
    "not audio": (b"hello, this is no audio file" * 8, "are not audio soundfile or FFmpeg can decode"),
    "bare array": (TONE, "a waveform needs its sample rate beside it"),
    "three-tuple": ((TONE, RATE, 1), "a tuple of length 3"),
    "zero rate": ((TONE, 0), "a sample rate of 0 is not usable"),
    "negative rate": ((TONE, -16000), "a sample rate of -16000 is not usable"),
    "rate in kHz": ((TONE, 16), "a sample rate of 16 is not usable: give the clip's own rate"),
    "absurd rate": ((TONE, 10**9), "whole number of Hz from 1,000 to 192,000"),
    "fractional rate": ((TONE, 22050.5), "a sample rate of 22050.5"),
    "bool rate": ((TONE, True), "a sample rate of True"),
    "nan rate": ((TONE, float("nan")), "a sample rate of nan"),
    "int16 samples": (((TONE * 32767).astype(np.int16), RATE), r"int16: .*\(e.g. int16 samples / 32768\)"),
    "complex samples": ((TONE.astype(np.complex64), RATE), "samples are complex64"),
    "strings": ((["a", "b"], RATE), "samples are <U1"),
    "ragged": (([[0.0, 0.1], [0.2]], RATE), "the waveform is not an array of samples"),
    "no samples": ((np.zeros(0, np.float32), RATE), r"no samples \(shape \(0,\)\)"),
    "no channels": ((np.zeros((0, 5), np.float32), RATE), "no samples"),
    "3-D": ((np.zeros((2, 3, 4), np.float32), RATE), r"shape \(2, 3, 4\): give \[samples\]"),
    "square": ((np.zeros((3, 3), np.float32), RATE), "does not say which axis is the channels'"),
    "too many channels": ((np.zeros((MAX_CHANNELS + 1, 1000), np.float32), RATE), "65 channels, not 1 to 64"),
    "nan": ((np.array([0.0, np.nan, np.inf, 0.5], np.float32), RATE), "2 non-finite samples"),
    "beyond float32": ((np.array([0.0, 1e300]), RATE), "1 non-finite samples"),
    "nan in a WAV": (encode_soundfile(np.array([0, np.nan], np.float32), RATE, "WAV", "FLOAT"), "non-finite"),
    "truncated FLAC": (encode_soundfile(TONE, RATE, "FLAC", "PCM_16")[:2000],
                       r"do not decode as audio \(LibsndfileError: .*\): the file is truncated"),
    "video without sound": (silent_video(), "hold no audio stream"),
    "https": ("https://example.com/a.wav", "does not fetch https:// URLs"),
    "s3": ("s3://bucket/a.wav", "download the audio and pass its bytes"),
    "missing file": ("/no/such/clip.wav", "cannot be read .*: fix the path"),
    "directory": ("/", "is not a file .*: give the path of an audio file"),
    "device": ("/dev/zero", "is not a file"),
    "data uri, not base64": ("data:audio/wav,RIFF", r"must be base64-encoded \(data:audio/wav;base64,...\)"),
    "data uri, bad base64": ("data:audio/wav;base64,%%%", "base64 payload does not decode"),
    "a number": (12, "got int"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_each_bad_input_says_what_is_wrong(name: str) -> None:
    value, message = BAD_INPUTS[name]
    with pytest.raises(AudioInputError, match=message):
        read_audio(value)


def test_length_and_file_size_limits(tmp_path: Path) -> None:
    with pytest.raises(AudioInputError, match=r"the clip is 0.5 s long, more than the 0.25 s accepted"):
        read_audio((TONE, RATE), AudioLimits(max_seconds=0.25))
    with pytest.raises(AudioInputError, match=r"the clip is 0.5 s long, more than the 0.25 s"):  # from the header
        read_audio(TONE_WAV, AudioLimits(max_seconds=0.25))
    m4a = encode_ffmpeg(TONE, RATE, "mp4", "aac")  # FFmpeg's length is counted as it decodes
    with pytest.raises(AudioInputError, match=r"the clip is over 0.\d s long, more than the 0.25 s"):
        read_audio(m4a, AudioLimits(max_seconds=0.25))
    path = tmp_path / "tone.wav"
    path.write_bytes(TONE_WAV)
    with pytest.raises(AudioInputError, match=rf"is {len(TONE_WAV):,} bytes, more than the largest audio file read "
                                              r"\(1,000\): cut the clip"):
        read_audio(path, AudioLimits(max_file_bytes=1000))
    assert read_audio((TONE, MAX_SAMPLE_RATE)).seconds == pytest.approx(len(TONE) / MAX_SAMPLE_RATE, abs=1 / RATE)


# Encoded clips (0.1 s at 8 kHz) that the fuzz test truncates and corrupts.
SHORT = sine(300, 8000, 0.1)
ENCODED = [encode_soundfile(SHORT, 8000, "WAV", "PCM_16"), encode_soundfile(SHORT, 8000, "WAV", "FLOAT"),
           encode_soundfile(np.stack([SHORT, SHORT], 1), 8000, "FLAC", "PCM_16"),
           encode_soundfile(SHORT, 8000, "OGG", "VORBIS"), encode_ffmpeg(SHORT, 8000, "mp4", "aac")]
FUZZ_LIMITS = AudioLimits(max_seconds=2.0, max_file_bytes=1 << 16)


@st.composite
def corrupted(draw: st.DrawFn) -> bytes:
    """An encoded clip cut short and with a few bytes overwritten."""
    data = bytearray(draw(st.sampled_from(ENCODED)))
    data = data[:draw(st.integers(0, len(data)))]
    for _ in range(draw(st.integers(0, 4)) if data else 0):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


RATES = st.one_of(st.sampled_from([8000, 16000, 22050, 44100, 48000, 12345, np.int32(8000), 16000.0]),
                  st.integers(-10**6, 999), st.integers(192_001, 10**12), st.floats(), st.booleans(), st.none(),
                  st.text(max_size=3))
ARRAYS = hnp.arrays(st.sampled_from([np.float16, np.float32, np.float64, np.int16, np.uint8, np.bool_, np.complex64,
                                     np.dtype("U2"), np.dtype(object)]),
                    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=70))
HOSTILE = st.one_of(
    st.binary(max_size=2000), corrupted(),
    st.tuples(st.one_of(ARRAYS, st.lists(st.one_of(st.floats(), st.integers(), st.text(max_size=2)), max_size=40),
                        st.binary(max_size=40), st.none()), RATES),
    st.tuples(ARRAYS), st.integers(), st.none(), st.text(max_size=30),
    st.builds(lambda data: "data:audio/wav;base64," + base64.b64encode(data).decode(), corrupted()))


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=HOSTILE)
def test_no_hostile_input_escapes_as_another_exception(value: object) -> None:
    try:
        audio = read_audio(value, FUZZ_LIMITS)
    except AudioInputError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert audio.waveform.dtype == np.float32 and audio.waveform.ndim == 1 and audio.waveform.size > 0
    assert np.isfinite(audio.waveform).all() and not audio.waveform.flags.writeable
    assert audio.sample_rate == FUZZ_LIMITS.sample_rate and audio.seconds <= FUZZ_LIMITS.max_seconds + 0.01
    assert audio.content_hash == audio_hash(audio.waveform, audio.sample_rate)
