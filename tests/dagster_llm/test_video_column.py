"""A prompt table's video column (issue 65): files read before any work (bytes, paths, URIs,
Hugging Face's {"bytes", "path"} struct), digested by content, a broken video as its row's
error, placeholders counted per modality, a model that reads no video refusing the rows with
videos; and a partition of videos and text generated on a tiny random Qwen2-VL with the
tokens `LLM.generate` gives the same rows."""

import hashlib
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pytest

from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset, partition_file
from dagster_llm.core.media import read_column, video_column
from dagster_llm.core.prompts import ModelMedia, PartitionSettings, PromptTableRules, read_rows
from engine import LLM, SamplingParams
from engine.multimodal.media import short_location
from tests.engine.test_video_qwen2_vl import clip, mp4_bytes
from tests.tiny_models import build_tokenizer
from tests.vision_models.qwen2_vl import build_tiny_qwen2_vl

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
SETTINGS = PartitionSettings(None, SamplingConfig(max_tokens=4), None, None, SamplingParams())


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def movies() -> tuple[bytes, bytes]:
    return mp4_bytes(clip(8, 56, 56, 0), 4), mp4_bytes(clip(6, 56, 84, 1), 2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("video_column_tokenizer")
    build_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def rows_of(frame: pd.DataFrame, tokenizer, media: ModelMedia, **rules):
    return read_rows(frame, SETTINGS, PromptTableRules(video_column="movie", **rules), tokenizer, media)


def test_every_cell_form_is_read_and_digested_and_a_broken_video_is_its_rows_error(movies, tokenizer, tmp_path):
    first, second = movies
    (tmp_path / "second.mp4").write_bytes(second)
    cells = [first, str(tmp_path / "second.mp4"), (tmp_path / "second.mp4").as_uri(),
             {"bytes": None, "path": str(tmp_path / "second.mp4")}, [first, second], None, b"not a video", 7]
    frame = pd.DataFrame({"id": [f"r{i}" for i in range(len(cells))], "movie": cells,
                          "prompt": [f"{VIDEO} Say"] * 4 + [f"{VIDEO}{VIDEO} Compare", "No video", f"{VIDEO} Say",
                                                            f"{VIDEO} Say"]})
    rows = rows_of(frame, tokenizer, ModelMedia({"video": VIDEO}))
    assert [r.error for r in rows[:6]] == [None] * 6
    assert [r.digests["video"] for r in rows[:6]] == [[sha256(first)], [sha256(second)], [sha256(second)],
                                                     [sha256(second)], [sha256(first), sha256(second)], []]
    assert rows[4].prompt["multi_modal_data"] == {"video": [first, second]}
    assert rows[6].error.startswith("movie: row 'r6': ") and "\n" not in rows[6].error
    assert rows[7].error.startswith("movie: row 'r7': expected encoded video bytes, a path or a URI")


def test_placeholders_are_counted_and_a_model_without_video_refuses_the_rows_with_videos(movies, tokenizer):
    frame = pd.DataFrame({"id": ["missing", "text"], "movie": [movies[0], None], "prompt": ["Say", "Say"]})
    missing, text = rows_of(frame, tokenizer, ModelMedia({"video": VIDEO}))
    assert missing.error.startswith(f"prompt: holds 0 {VIDEO!r} placeholder(s) for the row's 1 video(s) in 'movie'")
    assert text.error is None
    refused, fine = rows_of(frame, tokenizer, ModelMedia({"image": "<image>"}))
    assert refused.error == ("movie: the model reads no video, so it cannot take the row's 1 video(s): point the "
                             "resource's model_id at a model that reads videos (Qwen2-VL, Qwen2.5-VL), or leave "
                             "video_column unset")
    assert fine.error is None


def test_a_file_over_the_models_size_limit_is_refused_unread(movies, tmp_path):
    from engine.multimodal.video import VideoLimits

    (tmp_path / "big.mp4").write_bytes(movies[0])
    (row,) = read_column([str(tmp_path / "big.mp4")], video_column(VideoLimits(max_file_bytes=1000)))
    assert row.problem.startswith(f"{short_location(str(tmp_path / 'big.mp4'))}: is {len(movies[0]):,} bytes, more "
                                  "than the largest video file read (1,000)") and not row.digests


def test_a_partition_of_videos_images_and_text_generates_as_llm_generate_does(movies, tmp_path):
    folder = build_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    first, second = movies
    frame = pd.DataFrame({"id": ["video", "two", "text"], "movie": [first, [first, second], None],
                          "prompt": [f"{VIDEO} Describe", f"{VIDEO} then {VIDEO}", "Just text"]})

    @dg.asset(name="movies", io_manager_key="cells")
    def movies_asset() -> pd.DataFrame:
        return frame

    gen = build_generation_asset("gen", upstream=movies_asset, video_column="movie",
                                 sampling=SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True))
    resources = {"llm": LLMResource(model_id=str(folder), dtype="float32", kv_cache_memory=32 << 20),
                 "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables")), "cells": dg.InMemoryIOManager()}
    assert dg.materialize([movies_asset, gen], resources=resources).success
    table = pd.read_parquet(partition_file(tmp_path / "tables", ["gen"], None)).set_index("id")
    assert table["error"].isna().all()
    assert [list(d) for d in table["video_digests"]] == [[sha256(first)], [sha256(first), sha256(second)], []]
    with LLM(str(folder), dtype="float32", kv_cache_memory=32 << 20) as llm:
        expected = llm.generate([{"prompt": f"{VIDEO} Describe", "multi_modal_data": {"video": first}},
                                 {"prompt": f"{VIDEO} then {VIDEO}", "multi_modal_data": {"video": [first, second]}},
                                 "Just text"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                use_tqdm=False)
    assert list(table["generated_text"]) == [o.outputs[0].text for o in expected]
