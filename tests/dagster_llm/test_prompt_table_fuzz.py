"""Prompt and text tables of any content, however hostile: ids, prompt cells (text, chat messages
of any shape, numbers, bytes, nested values), per-row sampling columns of any type, and the
embedding asset's text cells. Reading the table, checking its rows against the engine,
generating and embedding never raise: each bad row gets an error naming its column, and every
other row is answered."""

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dagster_llm import GenerationRun, PartitionInput, RunOptions, SamplingConfig
from dagster_llm.core.embedding import EmbeddingOptions, EmbeddingRun, TextPartition, text_rows
from dagster_llm.core.prompts import PartitionSettings, PromptTableRules, read_rows
from dagster_llm.core.sampling import SAMPLING_FIELD_NAMES
from engine import LLM
from tests.fuzzing import examples
from tests.reasoning_models import build_reasoning_model

SAMPLING = SamplingConfig(temperature=0, max_tokens=2, ignore_eos=True)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**66), max_value=2**66),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=16), st.binary(max_size=8),
                    st.just(""), st.just("\ud800"))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=3), max_leaves=8)
ROLES = st.sampled_from(["user", "assistant", "system", "tool", "", "USER", "bot"]) | SCALARS
CONTENT = st.one_of(st.text(max_size=40), SCALARS, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "image_url", "input_audio", "video"]) | st.text(max_size=5)},
    optional={"text": JSON, "image_url": JSON, "image": JSON}), max_size=2))
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLES, "content": CONTENT, "name": JSON, "tool_calls": JSON,
                                              "extra": JSON})
PROMPT = st.one_of(st.text(max_size=60), st.lists(MESSAGE, max_size=3), JSON)
# A per-row sampling cell: its field's kind of value, in range or not, or anything.
OVERRIDE = st.one_of(st.none(), st.integers(min_value=-3, max_value=300), st.floats(min_value=-2, max_value=3),
                     st.lists(st.text(max_size=4), max_size=2), JSON)
# What a row's error names: its id, prompt or sampling column, or the prompt's length.
NAMED = ("id:", "prompt", "sampling override", "messages", "max_tokens", "min_tokens", "tokens")
HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = build_reasoning_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    with LLM(str(folder), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, max_model_len=256) as llm:
        yield llm


def tables(max_rows: int):
    """A prompt table: id and prompt columns of anything, and some sampling columns."""
    return st.integers(min_value=1, max_value=max_rows).flatmap(lambda n: st.fixed_dictionaries({
        "id": st.lists(st.one_of(st.integers(0, 3), st.text(max_size=3), SCALARS), min_size=n, max_size=n),
        "prompt": st.lists(PROMPT, min_size=n, max_size=n),
        "overrides": st.dictionaries(st.sampled_from(SAMPLING_FIELD_NAMES), st.lists(OVERRIDE, min_size=n, max_size=n),
                                     max_size=3),
    }))


def _rows(llm: LLM, table: dict, chat: bool):
    columns = {"id": table["id"], "prompt": table["prompt"], **table["overrides"]}
    frame = pd.DataFrame({name: pd.Series(values, dtype=object) for name, values in columns.items()})
    settings = PartitionSettings(None, SAMPLING, None, None, llm.get_default_sampling_params())
    return read_rows(frame, settings, PromptTableRules(chat=chat), llm.get_tokenizer())


@settings(max_examples=examples(150), deadline=None, derandomize=True, suppress_health_check=HEALTH)
@given(table=tables(6), chat=st.booleans())
def test_any_table_reads_and_checks_without_raising(llm, table, chat):
    rows = _rows(llm, table, chat)
    assert len(rows) == len(table["id"])
    ready = [row for row in rows if row.error is None]
    for row, problem in zip(ready, llm.validate([r.prompt for r in ready], [r.params for r in ready])):
        if problem is not None:
            row.fail(problem)
    for row in rows:
        if row.error is not None:
            assert any(word in row.error for word in NAMED), row.error
        else:
            assert row.prompt["prompt_token_ids"] and row.prompt_text is not None


@settings(max_examples=examples(15, thorough=300), deadline=None, derandomize=True, suppress_health_check=HEALTH)
@given(table=tables(4), chat=st.booleans())
def test_any_table_generates_its_good_rows_and_names_its_bad_ones(llm, table, chat):
    rows = _rows(llm, table, chat)
    options = RunOptions(model_id="tiny", code_version="1", resume=False)
    [result] = GenerationRun(llm, {}, options, lambda _: None).generate([PartitionInput(None, rows, None)])
    out = result.table.to_pandas()
    assert len(out) == len(rows)
    for row, (_, record) in zip(rows, out.iterrows()):
        if row.error is None:
            assert record["finish_reason"] in ("length", "stop") and isinstance(record["generated_text"], str)
        else:
            assert record["error"] == row.error and pd.isna(record["generated_text"])


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = build_reasoning_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    with LLM(str(folder), dtype="float32", kv_cache_memory=4 << 20, max_model_len=64, runner="pooling") as llm:
        yield llm


@settings(max_examples=examples(60, thorough=2000), deadline=None, derandomize=True, suppress_health_check=HEALTH)
@given(ids=st.lists(st.one_of(st.integers(0, 3), st.text(max_size=3), SCALARS, st.just(pd.NA)), min_size=1,
                    max_size=5),
       texts=st.lists(st.one_of(st.text(max_size=300), JSON, st.just(pd.NA)), min_size=5, max_size=5))
def test_any_text_table_embeds_its_good_rows_and_names_its_bad_ones(embedder, ids, texts):
    """The embedding asset's boundary: ids and text cells of anything."""
    rows = text_rows(ids, texts[:len(ids)])
    [result] = EmbeddingRun(embedder, EmbeddingOptions(model_id="tiny", code_version="1"),
                            lambda _: None).embed([TextPartition(None, rows, None)])
    out = result.table.to_pylist()
    assert len(out) == len(ids)
    for row, record in zip(rows, out):
        if row.error is None:
            assert record["error"] is None and len(record["embedding"]) == embedder.hidden_size
        else:
            assert record["error"] == row.error and record["embedding"] is None
            assert row.error.startswith(("id:", "text:", "prompt")), row.error


@pytest.mark.parametrize("null", [None, float("nan"), pd.NA, pd.NaT])
def test_every_kind_of_null_id_is_named(null):
    """pandas' NA and NaT were ids '<NA>' and 'NaT' of an embedding table, not null ones."""
    [row] = text_rows([null], ["a text"])
    assert row.error == "id: is null: give every row an id"
