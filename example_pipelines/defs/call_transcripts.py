"""Calls pipeline: recorded support calls -> a transcript table, by a speech-to-text model.

The recordings (FLAC files under data/call_recordings, drawn by
example_pipelines/make_call_recordings.py; any format FFmpeg reads works, and so do encoded
bytes and s3:// / gs:// URIs) are listed in data/call_recordings.csv; the transcript asset
reads each row's file, cuts a call longer than the model's 30 s window into windows at quiet
points, and writes each call's text, language, duration and window count.

The model is the `transcriber` resource's: a local folder of a Whisper checkpoint named by
DAGSTER_LLM_AUDIO_MODEL (e.g. openai/whisper-small or openai/whisper-large-v3-turbo,
downloaded beforehand). There is no default: without it, materializing call_transcripts fails
naming the variable (the other pipelines, and any job or plan over all assets, do not need it),
and `make run` leaves this pipeline out.
"""

import os
from pathlib import Path

import dagster as dg
import pandas as pd

from dagster_llm import LLMResource, build_transcription_asset

DATA = Path(__file__).resolve().parents[1] / "data"
# Unset, the model is a text that names the setting: loading it fails saying what to set (a
# dg.EnvVar would fail every run and execution plan over all assets, which resolve every resource).
AUDIO_MODEL = (os.environ.get("DAGSTER_LLM_AUDIO_MODEL")
               or "unset: set DAGSTER_LLM_AUDIO_MODEL to a speech-to-text model folder (Whisper)")


@dg.asset(group_name="calls", kinds={"csv"})
def call_recordings() -> pd.DataFrame:
    """The support calls: id, customer and the recording's path."""
    calls = pd.read_csv(DATA / "call_recordings.csv", dtype=str)
    return pd.DataFrame({"id": calls["call_id"], "customer": calls["customer"],
                         "recording": [str(DATA / path) for path in calls["recording"]]})


call_transcripts = build_transcription_asset(
    "call_transcripts",
    upstream=call_recordings,
    audio_column="recording",
    language="en",
    group_name="calls",
    description="What was said on each support call, transcribed by a speech-to-text model.",
)

defs = dg.Definitions(
    assets=[call_recordings, call_transcripts],
    resources={
        "transcriber": LLMResource(model_id=AUDIO_MODEL, dtype=os.environ.get("DAGSTER_LLM_DTYPE", "auto")),
    },
)
