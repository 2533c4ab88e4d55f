"""Cutting a clip longer than a model's window into windows it reads one at a time (Whisper
reads 30 s): at the quietest moment near each window's end, so that a cut falls in a pause
rather than in a word, as vLLM's transcription endpoint cuts (`_split_audio`)."""

from dataclasses import dataclass

import numpy as np

# vLLM's `SpeechToTextConfig` defaults: a cut is searched for in the last second of a window,
# over stretches of 1600 samples (100 ms at 16 kHz).
SEARCH_SECONDS = 1.0
ENERGY_WINDOW = 1600


@dataclass(frozen=True)
class AudioWindow:
    """Samples [start, end) of a clip."""

    start: int
    end: int


def split_windows(waveform: np.ndarray, sample_rate: int, window_s: float, search_s: float = SEARCH_SECONDS,
                  energy_window: int = ENERGY_WINDOW) -> list[AudioWindow]:
    """Windows of at most `window_s` that cover the clip in order, without overlap. A clip that
    fits one window is one window. Otherwise each window ends where the quietest stretch of
    `energy_window` samples (by RMS) starts, among the consecutive stretches from `search_s`
    (at most half a window) before the window's full length, those ending before it (vLLM's
    rule); the last window is the rest of the clip."""
    size = int(window_s * sample_rate)
    search = min(int(search_s * sample_rate), size // 2)
    windows, start = [], 0
    while len(waveform) - start > size:
        end = _quietest_stretch(waveform, start + size - search, start + size, energy_window)
        windows.append(AudioWindow(start, end))
        start = end
    windows.append(AudioWindow(start, len(waveform)))
    return windows


def _quietest_stretch(waveform: np.ndarray, first: int, last: int, width: int) -> int:
    """The start of the stretch of `width` samples with the lowest RMS (the first of equals)
    among those starting at `first`, `first + width`, ... and ending before `last`; `last`
    where none fits."""
    count = -(-(last - first - width) // width)
    if count <= 0:
        return last
    stretches = np.asarray(waveform[first : first + count * width], dtype=np.float64).reshape(count, width)
    return first + int(np.argmin(np.sqrt(np.mean(stretches**2, axis=1)))) * width
