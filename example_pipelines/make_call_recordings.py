"""Draws the recordings of the call-transcript example (example_pipelines/defs/call_transcripts.py):
bursts of tones with pauses between them, as a call's turns and silences, 16 kHz mono FLAC
(at most a few hundred KB each), one longer than Whisper's 30 s window so that it is cut in two, and their
list in data/call_recordings.csv. Run once; the files are committed.

    python -m example_pipelines.make_call_recordings

They carry no words: a real speech-to-text model transcribes them as noise or nothing. Replace
them with your own recordings (any format FFmpeg reads) to see real transcripts.
"""

import csv
from pathlib import Path

import numpy as np
import soundfile

DATA = Path(__file__).resolve().parent / "data"
RECORDINGS = DATA / "call_recordings"
RATE = 16_000
# id, customer, seconds, base pitch (Hz)
CALLS = [("C-2041", "Acme Freight", 7.5, 180), ("C-2042", "Birch & Co", 12.0, 220),
         ("C-2043", "Northwind Ltd", 38.0, 150), ("C-2044", "Juniper Health", 5.0, 260)]


def recording(seconds: float, pitch: float, seed: int) -> np.ndarray:
    """Turns of 0.5 to 2 s of a voiced tone (a pitch and two overtones, gliding), a pause of
    0.2 to 0.8 s of silence after each."""
    rng = np.random.default_rng(seed)
    samples = np.zeros(int(seconds * RATE), np.float32)
    at = 0
    while at < len(samples):
        turn = int(rng.uniform(0.5, 2.0) * RATE)
        t = np.arange(min(turn, len(samples) - at)) / RATE
        glide = pitch * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
        phase = 2 * np.pi * np.cumsum(glide) / RATE
        voice = sum(np.sin(k * phase) / k for k in (1, 2, 3)) * np.hanning(len(t)) * 0.3
        samples[at:at + len(t)] = voice
        at += len(t) + int(rng.uniform(0.2, 0.8) * RATE)
    return samples


def main() -> None:
    RECORDINGS.mkdir(parents=True, exist_ok=True)
    with (DATA / "call_recordings.csv").open("w", newline="") as file:
        table = csv.writer(file)
        table.writerow(["call_id", "customer", "recording"])
        for seed, (call_id, customer, seconds, pitch) in enumerate(CALLS):
            name = f"{call_id.lower()}.flac"
            soundfile.write(RECORDINGS / name, recording(seconds, pitch, seed), RATE, subtype="PCM_16")
            table.writerow([call_id, customer, f"call_recordings/{name}"])


if __name__ == "__main__":
    main()
