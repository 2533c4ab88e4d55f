"""A clip longer than a model's window (Whisper's 30 s) cut into windows the model reads one
at a time, as vLLM's transcription endpoint cuts it: each window ends at the quietest stretch
of its last second, so that a cut falls between words where the audio allows, and the windows
do not overlap (their transcripts are joined in order, with nothing to deduplicate)."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AudioWindow:
    """Samples [start, end) of a clip."""

    start: int
    end: int

    def seconds(self, sample_rate: int) -> tuple[float, float]:
        """Where the window starts and ends in the clip, in seconds."""
        return self.start / sample_rate, self.end / sample_rate


def split_windows(waveform: np.ndarray, sample_rate: int, window_s: float, search_s: float = 1.0,
                  energy_window: int = 1600) -> list[AudioWindow]:
    """The windows of a mono `waveform`: one for a clip of at most `window_s` seconds; else
    each window but the last ends at the start of the quietest (lowest RMS) run of
    `energy_window` samples (100 ms at 16 kHz) among those that start in its last `search_s`
    seconds, and the last window takes the rest.

    Raises:
        ValueError: `search_s` not shorter than `window_s`, or a non-positive `energy_window`.
    """
    if not 0 < search_s < window_s or energy_window <= 0:
        raise ValueError(f"split_windows needs 0 < search_s < window_s and energy_window > 0, got search_s={search_s}, "
                         f"window_s={window_s}, energy_window={energy_window}")
    size, search = int(window_s * sample_rate), int(search_s * sample_rate)
    windows, start = [], 0
    while start + size < len(waveform):
        end = _quietest(waveform, start + size - search, start + size, energy_window)
        windows.append(AudioWindow(start, end))
        start = end
    windows.append(AudioWindow(start, len(waveform)))
    return windows


def _quietest(waveform: np.ndarray, begin: int, end: int, energy_window: int) -> int:
    """The start of the quietest run of `energy_window` samples starting at begin, begin +
    energy_window, ... and ending by `end` (the first of equals); `end` where none fits."""
    starts = np.arange(begin, end - energy_window + 1, energy_window)
    if len(starts) == 0:
        return end
    runs = waveform[starts[0]:starts[-1] + energy_window].astype(np.float64).reshape(len(starts), energy_window)
    return int(starts[np.argmin(np.mean(runs * runs, axis=1))])
