"""A code location for the transcript crash test: one partition of ROWS WAV files (some
longer than the tiny Whisper's 2 s window) transcribed one window at a time on one thread,
so that it takes long enough to be killed in the middle.

The model folder comes from CRASH_TEST_MODEL; the clips and tables go under
DAGSTER_LLM_OUTPUT_DIR."""

import os
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import soundfile

from dagster_llm import LLMResource, ParquetIOManager, build_transcription_asset

ROWS = 24
MAX_TOKENS = 48
RATE = 16_000
parts = dg.StaticPartitionsDefinition(["p1"])


def clip(row: int) -> np.ndarray:
    """A tone of its own per row, 1 to 3.4 s long (rows 3, 7, ... span two windows)."""
    seconds = 1.0 + 0.6 * (row % 5)
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * (180 + 37 * row) * t)).astype(np.float32)


def write_clips(folder: Path) -> list[str]:
    """The rows' WAV files in `folder` (written once), their paths in row order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for row in range(ROWS):
        path = folder / f"call-{row:02d}.wav"
        if not path.exists():
            soundfile.write(path, clip(row), RATE, subtype="PCM_16")
        paths.append(str(path))
    return paths


@dg.asset(partitions_def=parts)
def crash_calls(context: dg.AssetExecutionContext) -> pd.DataFrame:
    paths = write_clips(Path(os.environ["DAGSTER_LLM_OUTPUT_DIR"]) / "clips")
    return pd.DataFrame({"id": [f"{context.partition_key}-{i}" for i in range(ROWS)], "audio": paths})


crash_transcripts = build_transcription_asset("crash_transcripts", upstream=crash_calls, language="en",
                                              max_tokens=MAX_TOKENS, shard_rows=2)

defs = dg.Definitions(
    assets=[crash_calls, crash_transcripts],
    resources={
        "transcriber": LLMResource(model_id=os.environ.get("CRASH_TEST_MODEL", "whisper"), dtype="float32",
                                   max_num_seqs=1, num_threads=1),
        "io_manager": ParquetIOManager(),
    },
)
