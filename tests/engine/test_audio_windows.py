"""Cutting a clip longer than a model's window (issue 65), as vLLM's transcription endpoint
does: a window ends at the quietest 100 ms of its last second, the windows tile the clip, and
a clip within the window stays whole."""

import numpy as np

from engine.multimodal.audio_windows import AudioWindow, split_windows

RATE = 16_000


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, int(seconds * RATE)).astype(np.float32)


def test_a_clip_within_the_window_is_one_window() -> None:
    assert split_windows(noise(29.5), RATE, 30.0) == [AudioWindow(0, int(29.5 * RATE))]
    assert split_windows(noise(30.0), RATE, 30.0) == [AudioWindow(0, 30 * RATE)]
    assert split_windows(np.zeros(0, np.float32), RATE, 30.0) == [AudioWindow(0, 0)]


def test_each_window_ends_at_the_planted_silence_of_its_last_second() -> None:
    clip = noise(70.0)
    first = 29 * RATE + 4 * 1600  # 0.4 s into the first window's last second
    second = first + 29 * RATE + 7 * 1600  # 0.7 s into the second window's (which starts at the first cut)
    quiet = [first, second]
    for start in quiet:
        clip[start:start + 1600] *= 0.01
    windows = split_windows(clip, RATE, 30.0)
    assert [w.end for w in windows[:-1]] == quiet
    assert windows[-1].end == len(clip)


def test_the_windows_tile_the_clip_and_none_is_longer_than_the_window() -> None:
    clip = noise(95.3, seed=1)
    windows = split_windows(clip, RATE, 30.0)
    assert windows[0].start == 0 and windows[-1].end == len(clip)
    assert all(a.end == b.start for a, b in zip(windows, windows[1:]))
    assert all(29 * RATE <= w.end - w.start <= 30 * RATE for w in windows[:-1])
    assert np.array_equal(np.concatenate([clip[w.start:w.end] for w in windows]), clip)


def test_a_search_too_short_for_one_energy_run_cuts_at_the_window() -> None:
    assert [w.end for w in split_windows(noise(5.0), RATE, 2.0, search_s=0.05)] == [2 * RATE, 4 * RATE, 5 * RATE]


def test_the_search_is_at_most_half_a_window() -> None:
    """A short window (a tiny model's 2 s) searches its second half, not more."""
    clip = noise(5.0)
    clip[int(0.5 * RATE):int(0.5 * RATE) + 1600] = 0.0  # in the first half: never a cut
    assert all(w.end - w.start >= RATE for w in split_windows(clip, RATE, 2.0, search_s=1.5)[:-1])
