"""A prompt table's audio column (issue 65): every cell form read before any work (bytes,
paths, file:// and data: URIs, object stores, Hugging Face's {"bytes", "path"} and decoded
{"array", "sampling_rate"} structs), digested by content, a bad clip as its row's error naming
the row and the fix, placeholders counted per modality, and a model without an audio tower
refusing the rows with clips while the others run. The end-to-end assets on a model that
reads audio are in test_audio_assets.py."""

import base64
import hashlib
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import soundfile
from transformers import AutoTokenizer

from dagster_llm.core.media import audio_column, image_column, read_column
from dagster_llm.core.prompts import (
    ModelMedia, PartitionSettings, PromptTableError, PromptTableRules, check_columns, read_rows,
)
from dagster_llm.core.sampling import SamplingConfig
from engine import SamplingParams
from engine.multimodal.audio import AudioLimits
from engine.multimodal.media import short_location
from tests.tiny_models import build_tiny_model

RATE = 16_000
AUDIO = "<|AUDIO|>"
IMAGE = "<image>"
SETTINGS = PartitionSettings(None, SamplingConfig(max_tokens=4), None, None, SamplingParams())
READS_AUDIO = ModelMedia({"audio": AUDIO})


def tone(seconds: float, freq: float = 440.0, rate: int = RATE) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    encoded = io.BytesIO()
    soundfile.write(encoded, samples, rate, format="WAV", subtype="PCM_16")
    return encoded.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


LOW, HIGH = wav(tone(0.3, 300)), wav(tone(0.2, 900))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("audio_column") / "llama", "llama"))


def rows_of(frame: pd.DataFrame, tokenizer, media: ModelMedia = READS_AUDIO, **rules):
    return read_rows(frame, SETTINGS, PromptTableRules(audio_column="clip", **rules), tokenizer, media)


def test_every_cell_form_is_read_and_digested(tokenizer, tmp_path: Path) -> None:
    (tmp_path / "high.wav").write_bytes(HIGH)
    samples = tone(0.25, 600, 22_050)
    cells = [LOW, str(tmp_path / "high.wav"), (tmp_path / "high.wav").as_uri(),
             "data:audio/wav;base64," + base64.b64encode(LOW).decode(), [LOW, HIGH],
             {"bytes": None, "path": str(tmp_path / "high.wav")}, {"array": samples, "sampling_rate": 22_050}, None]
    frame = pd.DataFrame({"id": [f"r{i}" for i in range(len(cells))], "clip": cells,
                          "prompt": [f"{AUDIO} Say"] * 4 + [f"{AUDIO}{AUDIO} Compare"] + [f"{AUDIO} Say"] * 2
                          + ["No clip"]})
    rows = rows_of(frame, tokenizer)
    assert [r.error for r in rows] == [None] * len(cells)
    decoded = hashlib.sha256(b"float32:22050:" + samples.astype("<f4").tobytes()).hexdigest()
    assert [r.digests["audio"] for r in rows] == [
        [sha256(LOW)], [sha256(HIGH)], [sha256(HIGH)], [sha256(LOW)], [sha256(LOW), sha256(HIGH)], [sha256(HIGH)],
        [decoded], []]
    clips = [r.prompt.get("multi_modal_data", {}).get("audio", []) for r in rows]
    assert clips[:6] == [[LOW], [HIGH], [HIGH], [LOW], [LOW, HIGH], [HIGH]]
    (array, rate), = clips[6]
    assert rate == 22_050 and np.array_equal(array, samples)
    assert "multi_modal_data" not in rows[-1].prompt


def test_a_bad_clip_is_its_rows_error_naming_the_row_and_the_fix(tokenizer, tmp_path: Path) -> None:
    frame = pd.DataFrame({"id": ["ok", "noise", "gone", "second", "empty", "thing", "folder", "bare"],
                          "clip": [LOW, b"not audio at all", str(tmp_path / "gone.wav"), [LOW, b"\x00" * 40],
                                   wav(np.zeros(0, np.float32)), 7, str(tmp_path), {"array": tone(0.1)}],
                          "prompt": f"{AUDIO} Say"})
    ok, noise, gone, second, empty, thing, folder, bare = rows_of(frame, tokenizer)
    assert ok.error is None and ok.prompt["multi_modal_data"]["audio"] == [LOW]
    assert noise.error.startswith("clip: row 'noise': the bytes") and "\n" not in noise.error
    gone_path = short_location(str(tmp_path / "gone.wav"))  # a long temporary path is cut in its middle
    assert gone.error == f"clip: row 'gone': {gone_path}: no such file or object: fix the path or drop the row"
    assert second.error.startswith("clip: row 'second': audio 2 of 2: the bytes")
    assert empty.error.startswith("clip: row 'empty': ") and "no samples" in empty.error
    assert thing.error.startswith("clip: row 'thing': expected encoded audio bytes, a path or a URI")
    assert folder.error.startswith("clip: row 'folder': ") and "is not a file" in folder.error
    assert bare.error.startswith("clip: row 'bare': expected encoded audio bytes")  # a struct without its rate
    assert all("audio" not in r.digests for r in (noise, gone, second, empty, thing, folder, bare))


def test_the_models_limits_refuse_a_long_clip_and_a_large_file(tmp_path: Path) -> None:
    (tmp_path / "long.wav").write_bytes(wav(tone(3.0)))
    column = audio_column(AudioLimits(max_seconds=2.0, max_file_bytes=50_000))
    short, long_clip, large = read_column([LOW, wav(tone(2.5)), str(tmp_path / "long.wav")], column)
    assert short.problem is None and short.digests == [sha256(LOW)]
    assert long_clip.problem == ("the clip is 2.5 s long, more than the 2 s accepted: cut it into shorter clips "
                                 "upstream")
    assert large.problem.startswith(f"{short_location(str(tmp_path / 'long.wav'))}: is 96,044 bytes, more than the "
                                    "largest audio file read (50,000)")


def test_placeholders_are_counted_per_modality(tokenizer) -> None:
    media = ModelMedia({"image": IMAGE, "audio": AUDIO})
    red = _png()
    frame = pd.DataFrame({"id": ["both", "no-audio-placeholder", "extra"], "photo": [red, red, red],
                          "clip": [LOW, LOW, None],
                          "prompt": [f"{IMAGE}{AUDIO} Say", f"{IMAGE} Say", f"{IMAGE}{AUDIO} Say"]})
    both, missing, extra = rows_of(frame, tokenizer, media, image_column="photo")
    assert both.error is None and both.prompt["multi_modal_data"] == {"image": [red], "audio": [LOW]}
    assert both.digests == {"image": [sha256(red)], "audio": [sha256(LOW)]}
    assert missing.error == (f"prompt: holds 0 {AUDIO!r} placeholder(s) for the row's 1 clip(s) in 'clip': write "
                             f"{AUDIO!r} once where each clip goes, or set chat=True for the model's chat template "
                             "to place them")
    assert extra.error.startswith(f"prompt: holds 1 {AUDIO!r} placeholder(s) for the row's 0 clip(s)")


def test_a_model_without_an_audio_tower_refuses_rows_with_clips_and_runs_the_others(tokenizer) -> None:
    frame = pd.DataFrame({"id": ["with", "without"], "clip": [LOW, None], "prompt": ["Say", "Say"]})
    with_clip, without = rows_of(frame, tokenizer, ModelMedia())
    assert with_clip.error == ("clip: the model reads text only, so it cannot take the row's 1 clip(s): point the "
                               "resource's model_id at a model that reads audio in its prompts (Whisper transcribes "
                               "through build_transcription_asset), or leave audio_column unset")
    assert without.error is None and without.digests == {"audio": []}
    vision = ModelMedia({"image": IMAGE}, {"image": image_column()})
    (refused,) = rows_of(frame.iloc[:1], tokenizer, vision)
    assert refused.error.startswith("clip: the model reads no audio, so it cannot take the row's 1 clip(s)")


def test_a_missing_audio_column_fails_the_table() -> None:
    frame = pd.DataFrame({"id": ["a"], "prompt": ["Say"]})
    with pytest.raises(PromptTableError, match="has no column 'clip'.*pass audio_column="):
        check_columns(frame, PromptTableRules(audio_column="clip"), "of partition 'p'")


def _png() -> bytes:
    from PIL import Image

    encoded = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 30)).save(encoded, "PNG")
    return encoded.getvalue()
