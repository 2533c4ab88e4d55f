"""Structured generation assets end to end on the tiny random Llama: typed Parquet columns,
their metadata and lineage, the parse-rate check, cut-off rows and a schema the grammar
backend refuses."""

from typing import Literal

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest

from dagster_llm import SamplingConfig, build_generation_asset, partition_file
from dagster_llm.core.structured import ENUM_TYPE
from tests.dagster_llm.test_generation_asset import latest, prompts_asset, run

pytestmark = pytest.mark.slow


class Detail(pydantic.BaseModel):
    side: Literal["left", "right"]
    count: int = pydantic.Field(ge=0, le=9)


class Reading(pydantic.BaseModel):
    level: Literal["low", "mid", "high"]
    score: int = pydantic.Field(ge=1, le=5)
    ok: bool
    tags: list[Literal["x", "y"]] = pydantic.Field(max_length=2)
    detail: Detail


READING_TYPES = [
    ("level", ENUM_TYPE), ("score", pa.int64()), ("ok", pa.bool_()), ("tags", pa.list_(ENUM_TYPE)),
    ("detail", pa.struct([("side", ENUM_TYPE), ("count", pa.int64())])),
]


def test_partitions_get_typed_columns_metadata_lineage_and_a_parse_rate(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=128),
                                 output_schema=Reading, choices_by_partition={"b": ["yes", "no"]})
    with dg.instance_for_test() as instance:
        result = run([prompts, gen], env, partition_range=("a", "b"), instance=instance)
        a = pq.read_table(partition_file(env["root"], dg.AssetKey("gen"), "a"))
        assert [(f.name, f.type) for f in a.schema][-5:] == READING_TYPES
        for row in a.to_pylist():
            assert row["error"] is None and row["finish_reason"] == "stop"
            assert Reading.model_validate_json(row["generated_text"]).model_dump() == {
                name: row[name] for name, _ in READING_TYPES}
        b = pq.read_table(partition_file(env["root"], dg.AssetKey("gen"), "b"))
        assert b.schema.field("choice").type == ENUM_TYPE and "level" not in b.schema.names
        assert b["choice"].to_pylist() == b["generated_text"].to_pylist()
        assert set(b["choice"].to_pylist()) <= {"yes", "no"}

        meta = latest(instance, "gen", "a").metadata
        columns = {c.name: c for c in meta["dagster/column_schema"].value.columns}
        assert columns["tags"].type == str(pa.list_(ENUM_TYPE)) and "Output field 'tags'" in columns["tags"].description
        deps = meta["dagster/column_lineage"].value.deps_by_column
        assert all(deps[name][0].column_name == "prompt" for name, _ in READING_TYPES)
        assert meta["structured_output"].value["schema"] == Reading.model_json_schema()
        assert latest(instance, "gen", "b").metadata["structured_output"].value == {"choices": ["yes", "no"]}
        checks = {(e.check_name, e.partition): e for e in result.get_asset_check_evaluations()}
        for key, rows in (("a", 3), ("b", 2)):
            assert checks[("parse_rate", key)].passed
            assert checks[("parse_rate", key)].metadata["parsed_rows"].value == rows

        # Materialized again: the committed typed table is reused as it is.
        run([prompts, gen], env, partition="a", instance=instance)
        assert latest(instance, "gen", "a").metadata["resumed_rows"].value == 3
        assert pq.read_table(partition_file(env["root"], dg.AssetKey("gen"), "a")).equals(a)


def test_outputs_cut_off_by_max_tokens_are_error_rows_that_fail_the_parse_rate(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=3),
                                 output_schema=Reading)
    result = run([prompts, gen], env, partition="a")
    table = pq.read_table(partition_file(env["root"], dg.AssetKey("gen"), "a")).to_pylist()
    for row in table:
        assert row["finish_reason"] == "length" and row["generated_text"] and row["level"] is None
        assert "cut off by max_tokens (3) before the JSON was complete; raise max_tokens" in row["error"]
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert not checks["parse_rate"].passed and checks["parse_rate"].metadata["failed_rows"].value == 3
    assert checks["no_error_rows"].passed  # every row was generated


def test_a_schema_the_grammar_backend_refuses_fails_the_step_before_generating(env):
    prompts = prompts_asset()
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}}}
    gen = build_generation_asset("gen", upstream=prompts, output_schema=schema)  # a valid JSON schema
    result = run([prompts, gen], env, partition="a", raise_on_error=False)
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    message = str(failure.event_specific_data.error)
    assert "gen: partition 'a': the json constraint does not compile" in message and "Lookbehind" in message
    assert "change the schema" in message
    assert not partition_file(env["root"], dg.AssetKey("gen"), "a").exists()
