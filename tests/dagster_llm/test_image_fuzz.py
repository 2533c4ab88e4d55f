"""No image cell, however hostile, fails a partition (issue 62): a property-based test of the
Dagster image column (`read_rows`, then the engine's checks the generation step runs on the
rows that pass) on a tiny random Qwen2-VL, the family with the strictest limits, and the two
reported cases (a 500x2 strip, a 57-byte PNG claiming 20000x10000) materialized end to end:
their rows get errors naming the row and the fix, the others their completions.
HYPOTHESIS_PROFILE=thorough runs 10,000 examples."""

from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset, partition_file
from dagster_llm.core.media import image_column, read_column
from dagster_llm.core.prompts import ModelMedia, PartitionSettings, PromptTableRules, read_rows
from engine import LLM, SamplingParams
from tests.fuzzing import examples
from tests.image_fuzz import BOMB, HostileImage, good_picture, hostile_images, strip_png
from tests.vision_models.qwen2_vl import build_tiny_qwen2_vl

SETTINGS = PartitionSettings(None, SamplingConfig(max_tokens=2), None, None, SamplingParams())
GOOD = good_picture(0)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("image_fuzz_vlm") / "qwen2_vl")


@pytest.fixture(scope="module")
def llm(qwen_folder) -> LLM:
    with LLM(str(qwen_folder), dtype="float32", quantization=None) as built:
        yield built


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("image_fuzz_cells")


@st.composite
def hostile_cells(draw: st.DrawFn) -> tuple[HostileImage, str]:
    """A hostile image and how its cell holds it: alone, second in a list after a good image,
    or in Hugging Face's {"bytes", "path"} struct."""
    return draw(hostile_images(network=False)), draw(st.sampled_from(["alone", "listed", "struct"]))


def cell_of(value: object, holding: str) -> object:
    if holding == "listed":
        return [GOOD, value]
    if holding == "struct":
        return {"bytes": value, "path": None} if isinstance(value, bytes) else {"bytes": None, "path": value}
    return value


@settings(max_examples=examples(60), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(drawn=hostile_cells())
def test_a_hostile_image_cell_is_its_rows_error_and_the_rows_beside_it_run(llm, files, drawn):
    image, holding = drawn
    cell = cell_of(image.value(files), holding)
    count = 2 if holding == "listed" else 1
    placeholder = llm.image_placeholder
    frame = pd.DataFrame({"id": ["good-a", "hostile", "good-b"], "photo": [GOOD, cell, GOOD],
                          "prompt": [placeholder + " Describe", placeholder * count + " Describe",
                                     placeholder + " Describe"]})
    media = ModelMedia({"image": placeholder}, {"image": image_column(llm.image_limits)})
    rows = read_rows(frame, SETTINGS, PromptTableRules(image_column="photo"), llm.get_tokenizer(), media)
    good_a, hostile, good_b = rows
    assert good_a.error is None and good_b.error is None
    if hostile.error is not None:  # the image named, or the prompt where the cell holds no image (a null, [])
        prefix = "photo: row 'hostile': " + ("image 2 of 2: " if holding == "listed" else "")
        assert hostile.error.startswith((prefix, "prompt: holds 1 ")) and "\n" not in hostile.error, hostile.error
        assert hostile.digests.get("image") in (None, [])
        return
    problems = llm.validate([row.prompt for row in rows])  # the generation step's check of the rows
    assert problems[0] is None and problems[2] is None
    assert problems[1] is None or problems[1].startswith("multi_modal_data['image']["), problems[1]


def test_the_bomb_and_the_strip_are_refused_when_their_cells_are_read(llm):
    bomb, strip, good = read_column([BOMB, strip_png(), GOOD], image_column(llm.image_limits))
    assert bomb.problem.startswith("the bytes claim more pixels than Pillow opens (Image size (200000000 pixels)")
    assert bomb.problem.endswith("resize the image below 40,000,000 pixels upstream")
    assert strip.problem == ("the image is 500x2, an aspect ratio of 250, over the 200 that the qwen2_vl image "
                             "processor takes: crop or pad it to an aspect ratio of at most 200")
    assert good.problem is None and good.data == [GOOD]


def test_a_strip_and_a_bomb_get_row_errors_while_the_partition_generates_the_others(qwen_folder, tmp_path):
    frame = pd.DataFrame({"id": ["good-a", "strip", "bomb", "good-b"], "prompt": "Describe",
                          "photo": [GOOD, strip_png(), BOMB, good_picture(1)]})

    @dg.asset(name="photos")
    def photos() -> pd.DataFrame:
        return frame

    gen = build_generation_asset("gen", upstream=photos, image_column="photo", chat=True,
                                 sampling=SamplingConfig(max_tokens=2, ignore_eos=True))
    resources = {"llm": LLMResource(model_id=str(qwen_folder), dtype="float32", kv_cache_memory=10 << 20),
                 "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables"))}
    assert dg.materialize([photos, gen], resources=resources).success
    table = pd.read_parquet(partition_file(tmp_path / "tables", ["gen"], None)).set_index("id")
    assert table["error"].isna().to_dict() == {"good-a": True, "strip": False, "bomb": False, "good-b": True}
    assert (table.loc[["good-a", "good-b"], "completion_tokens"] == 2).all()
    assert table.loc["strip", "error"].startswith("photo: row 'strip': the image is 500x2, an aspect ratio of 250")
    assert table.loc["strip", "error"].endswith("crop or pad it to an aspect ratio of at most 200")
    assert table.loc["bomb", "error"].startswith("photo: row 'bomb': the bytes claim more pixels than Pillow opens")


def test_a_cell_that_holds_no_image_is_named_on_one_line():
    """A numpy array's repr spans lines; a row's error is one line (found by the fuzz test)."""
    (row,) = read_column([[GOOD, np.zeros((4, 4, 3))]], image_column())
    assert row.problem.startswith("image 2 of 2: expected encoded image bytes") and "\n" not in row.problem
    assert "got ndarray array([[[0., 0., 0.], [0., 0., 0" in row.problem
