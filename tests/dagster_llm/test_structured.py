"""Structured outputs without a model: schema -> Arrow types, parsing and validation, the
table's typed columns, the parse-rate check and the definition-time errors."""

import enum
import json
from typing import Literal

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest

from dagster_llm import (
    CheckThresholds,
    GenerationComponent,
    GenerationSpec,
    SamplingConfig,
    StructuredOutput,
    build_generation_asset,
)
from dagster_llm.core.checks import evaluate
from dagster_llm.core.prompts import PromptRow
from dagster_llm.partitions import output_choice
from dagster_llm.core.schema import generation_schema, records_table, result_record
from dagster_llm.core.structured import ENUM_TYPE
from engine import CompletionOutput, RequestOutput, SamplingParams

PARTS = dg.StaticPartitionsDefinition(["a", "b"])


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Part(pydantic.BaseModel):
    name: str
    count: int


class Node(pydantic.BaseModel):
    label: str
    children: list["Node"] = []


class Everything(pydantic.BaseModel):
    text: str
    whole: int
    real: float
    flag: bool
    level: Literal["low", "high"]
    fixed: Literal["only"]
    color: Color
    maybe: float | None = None
    tags: list[str]
    part: Part
    parts: list[Part]
    counts: dict[str, int]
    tree: Node
    pair: tuple[int, str]
    either: int | str


EXPECTED_TYPES = {
    "text": pa.string(), "whole": pa.int64(), "real": pa.float64(), "flag": pa.bool_(),
    "level": ENUM_TYPE, "fixed": ENUM_TYPE, "color": ENUM_TYPE, "maybe": pa.float64(),
    "tags": pa.list_(pa.string()),
    "part": pa.struct([("name", pa.string()), ("count", pa.int64())]),
    "parts": pa.list_(pa.struct([("name", pa.string()), ("count", pa.int64())])),
    "counts": pa.map_(pa.string(), pa.int64()),
    "tree": pa.string(), "pair": pa.string(), "either": pa.string(),  # recursive, tuple, union: JSON text
}
VALUE = {
    "text": "hi", "whole": 3, "real": 2, "flag": True, "level": "high", "fixed": "only", "color": "blue",
    "tags": ["x", "y"], "part": {"name": "bolt", "count": 2}, "parts": [{"name": "nut", "count": 5}],
    "counts": {"a": 1}, "tree": {"label": "root", "children": [{"label": "leaf"}]}, "pair": [1, "a"], "either": "s",
}


def test_every_kind_of_field_has_its_arrow_type():
    output = StructuredOutput(Everything)
    assert {c.name: c.arrow_type for c in output.columns} == EXPECTED_TYPES
    assert [c.name for c in output.columns if c.as_json] == ["tree", "pair", "either"]
    assert output.params.json == Everything.model_json_schema() and output.params.disable_any_whitespace


def test_a_json_schema_dict_with_refs_type_lists_and_descriptions():
    schema = {
        "type": "object",
        "$defs": {"Size": {"type": "string", "enum": ["S", "M"]}},
        "properties": {
            "size": {"$ref": "#/$defs/Size", "description": "Shirt size."},
            "note": {"type": ["string", "null"]},
            "score": {"allOf": [{"type": "number"}]},
            "anything": {},
        },
    }
    columns = {c.name: c for c in StructuredOutput(schema).columns}
    assert columns["size"].arrow_type == ENUM_TYPE and "Shirt size" in columns["size"].description
    assert columns["note"].arrow_type == pa.string() and not columns["note"].as_json
    assert columns["score"].arrow_type == pa.float64()
    assert columns["anything"].as_json and "JSON text" in columns["anything"].description


def test_a_valid_output_becomes_typed_columns_that_survive_parquet(tmp_path):
    output = StructuredOutput(Everything)
    parsed = output.parse(json.dumps(VALUE), "stop", 64)
    assert parsed.error is None
    assert parsed.values["maybe"] is None and parsed.values["tree"] == json.dumps(VALUE["tree"])
    row = PromptRow("p", 0, "r1", "prompt", SamplingConfig(), SamplingParams(), output=output)
    record = result_record(row, _request_output(json.dumps(VALUE)), "model")
    pq.write_table(records_table([record], output), tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.schema == generation_schema(output)
    assert table.schema.names[-len(EXPECTED_TYPES):] == list(EXPECTED_TYPES)
    got = table.to_pylist()[0]
    assert got["error"] is None and got["generated_text"] == json.dumps(VALUE)  # the raw JSON stays
    assert got["part"] == VALUE["part"] and got["parts"] == VALUE["parts"] and got["counts"] == [("a", 1)]
    assert got["level"] == "high" and got["real"] == 2.0 and got["pair"] == "[1, \"a\"]"


@pytest.mark.parametrize("text, finish, message", [
    ('{"name": "x", "count": 1', "length",
     "cut off by max_tokens (7) before the JSON was complete; raise max_tokens"),
    ('{"name": "x", "count": 1', "stop", "is not valid JSON (Expecting ',' delimiter"),
    ('{"name": "x", "count": "many"}', "stop", "count: 'many' is not of type 'integer'"),
    ('{"name": "x"}', "stop", "(top level): 'count' is a required property"),
    ('[1, 2]', "stop", "(top level): [1, 2] is not of type 'object'"),
    ('{"name": "x", "count": 100000000000000000000}', "stop", "count: 100000000000000000000 does not fit"),
])
def test_an_output_that_does_not_parse_is_the_rows_error(text, finish, message):
    output = StructuredOutput(Part)
    row = PromptRow("p", 0, "r1", "prompt", SamplingConfig(max_tokens=7), SamplingParams(max_tokens=7), output=output)
    record = result_record(row, _request_output(text, finish), "model")
    assert record["error"].startswith("structured output: ") and message in record["error"]
    assert record["generated_text"] == text and record["name"] is None and record["count"] is None


def test_choices_are_a_dictionary_column_and_other_text_is_an_error():
    output = StructuredOutput(choices=["spam", "ham"])
    assert [(c.name, c.arrow_type) for c in output.columns] == [("choice", ENUM_TYPE)]
    assert output.parse("ham", "stop", 4).values == {"choice": "ham"}
    assert "'sp' is not one of the choices ['spam', 'ham']" in output.parse("sp", "stop", 4).error
    assert "before the choice was complete" in output.parse("sp", "length", 1).error
    assert output.params.choice == ["spam", "ham"]


def test_a_row_that_could_not_run_keeps_its_own_error_and_null_columns():
    row = PromptRow("p", 0, "r1", None, SamplingConfig(), SamplingParams(), error="prompt: is null",
                    output=StructuredOutput(Part))
    record = result_record(row, None, "model")
    assert record["error"] == "prompt: is null" and record["name"] is None and record["count"] is None


def test_parse_rate_check_counts_generated_rows_and_no_error_rows_does_not():
    output = StructuredOutput(Part)
    rows = [PromptRow("p", i, f"r{i}", "x", SamplingConfig(), SamplingParams(), output=output) for i in range(4)]
    rows[3].fail("prompt: is empty")
    texts = ['{"name":"a","count":1}', '{"name":"b","count":2}', '{"name":']
    records = [result_record(r, _request_output(t, "length"), "m") for r, t in zip(rows, texts)]
    table = records_table([*records, result_record(rows[3], None, "m")], output)
    outcomes = evaluate(table, CheckThresholds(max_error_rate=0.25, min_parse_rate=0.5), structured=True)
    assert outcomes["parse_rate"].passed
    assert outcomes["parse_rate"].metadata == {"parse_rate": 0.6667, "parsed_rows": 2, "failed_rows": 1,
                                               "min_parse_rate": 0.5}
    assert outcomes["no_error_rows"].metadata["rows"] == 1 and outcomes["no_error_rows"].passed
    assert not evaluate(table, CheckThresholds(), structured=True)["parse_rate"].passed
    assert evaluate(table, CheckThresholds(), structured=False)["parse_rate"].passed  # free text here
    assert "parse_rate" not in evaluate(table, CheckThresholds())


@pytest.mark.parametrize("kwargs, message", [
    ({"output_schema": Part, "choices": ["a"]}, "output_schema/choices: give exactly one of output_schema and choices"),
    ({"output_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
     "output_schema is not a valid JSON schema at properties/a/type: 'strin' is not valid"),
    ({"output_schema": {"type": "array", "items": {"type": "string"}}}, "must describe a JSON object with properties"),
    ({"output_schema": {"type": "object", "properties": {"error": {"type": "string"}, "model": {"type": "string"}}}},
     "output field(s) ['error', 'model'] would replace the generation table's column(s)"),
    ({"output_schema": "missing.json"}, "output_schema: cannot read a JSON schema from"),
    ({"choices": []}, "choices must be a non-empty list of non-empty strings"),
    ({"choices": ["a", "a"]}, "choices repeat a label"),
    ({"choices_by_partition": {"c": ["x"]}}, "choices_by_partition names ['c'], which match no partition key"),
    ({"output_schema_by_partition": {"b": {"type": "object"}}}, "output_schema_by_partition['b']: output_schema must"),
    ({"output_schema_by_partition": {"*": Part}, "choices_by_partition": {"b": ["x"]}},
     "partition 'b' is named by output_schema_by_partition ('*') and by choices_by_partition ('b')"),
])
def test_bad_structured_output_settings_are_definition_errors(kwargs, message):
    with pytest.raises(dg.DagsterInvalidDefinitionError) as raised:
        build_generation_asset("gen", upstream="prompts", partitions_def=PARTS, **kwargs)
    assert message in str(raised.value) and str(raised.value).startswith("gen: ")


def test_the_definition_declares_the_columns_the_check_and_the_code_version():
    def build(**kwargs):
        return build_generation_asset("gen", upstream="prompts", partitions_def=PARTS, **kwargs)

    free, typed = build(), build(output_schema=Part)
    columns = typed.specs_by_key[dg.AssetKey("gen")].metadata["dagster/column_schema"].columns
    assert [(c.name, c.type) for c in columns[-2:]] == [("name", "string"), ("count", "int64")]
    assert "parse_rate" in {c.name for c in typed.check_specs}
    assert "parse_rate" not in {c.name for c in free.check_specs}
    assert "parse_rate" in {c.name for c in build(choices_by_partition={"b": ["x", "y"]}).check_specs}
    versions = {a.code_versions_by_key[dg.AssetKey("gen")] for a in
                (free, typed, build(choices=["x", "y"]), build(choices=["x", "z"]))}
    assert len(versions) == 4


def test_each_partition_takes_its_own_output():
    days = dg.DailyPartitionsDefinition(start_date="2024-06-01", end_date="2024-06-05")
    spec = GenerationSpec(name="gen", upstream="prompts", output_schema=Part,
                          output_schema_by_partition={"2024-06-03": None},
                          choices_by_partition={"2024-06-0[24]": ["x", "y"]})
    outputs = output_choice(spec, days)
    assert [c.name for c in outputs.for_partition("2024-06-01").columns] == ["name", "count"]
    assert outputs.for_partition("2024-06-02").choices == ("x", "y")
    assert outputs.for_partition("2024-06-03") is None  # free text
    assert outputs.for_partition("2024-06-04").choices == ("x", "y")
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="needs a partitions_def"):
        build_generation_asset("gen", upstream="prompts", choices_by_partition={"b": ["x"]})


def test_component_takes_a_schema_inline_or_from_a_file(tmp_path):
    (tmp_path / "part.schema.json").write_text(json.dumps(Part.model_json_schema()))

    def columns(**attributes):
        component = GenerationComponent(name="gen", upstream="prompts", partitions=["a", "b"], **attributes)
        [asset] = component.build_defs(_load_context(tmp_path)).assets
        return [c.name for c in asset.specs_by_key[dg.AssetKey("gen")].metadata["dagster/column_schema"].columns]

    assert columns(output_schema="part.schema.json")[-2:] == ["name", "count"]
    assert columns(output_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}})[-1] == "ok"
    assert columns(choices=["x", "y"])[-1] == "choice"
    assert columns(output_schema_by_partition={"a": "part.schema.json", "b": None})[-1] == "error"
    with pytest.raises(dg.DagsterInvalidDefinitionError, match=r"output_schema: cannot read a JSON schema from .*missing"):
        columns(output_schema="missing.json")


def _load_context(folder):
    class Context:
        path = folder

    return Context()


def _request_output(text: str, finish_reason: str = "stop") -> RequestOutput:
    completion = CompletionOutput(0, text, [5] * 3, finish_reason=finish_reason)
    return RequestOutput("r", "prompt", [1, 2], [completion], True)
