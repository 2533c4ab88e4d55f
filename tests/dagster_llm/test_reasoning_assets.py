"""Reasoning models and tool calls as columns: a tiny random Qwen3 (its real chat template)
that opens and closes <think> by itself, materialized with thinking on and off, a reasoning
cut by a row's max_tokens, tools in the rendered prompt; tool calls, malformed calls and a
tool's typed argument columns from constructed engine outputs; definition errors; resuming
from rows saved before these columns existed."""

import json
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dagster_llm.core.prompts
import engine
from dagster_llm import (
    GenerationComponent, GenerationRun, GenerationSpec, LLMResource, ParquetIOManager, PartitionFiles,
    PartitionInput, RunOptions, SamplingConfig, build_generation_asset, partition_file,
)
from dagster_llm.core.checks import evaluate
from dagster_llm.core.prompts import PartitionSettings, PromptRow, PromptTableRules, read_rows
from dagster_llm.core.schema import TOOL_CALLS_TYPE, ToolArguments, records_table, result_record
from dagster_llm.core.structured import ENUM_TYPE
from dagster_llm.core.table_store import POSITION_COLUMN
from engine import CompletionOutput, RequestOutput, SamplingParams
from engine.outputs import FunctionCall, ToolCall
from tests.dagster_llm.test_generation_asset import latest
from tests.reasoning_models import build_reasoning_model

SPAM = {"type": "object", "properties": {"label": {"type": "string", "enum": ["spam", "ham"]},
                                         "sure": {"type": "boolean"}},
        "required": ["label", "sure"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city."}, "days": {"type": "integer", "minimum": 1}}}}}
GREEDY = SamplingConfig(temperature=0, max_tokens=96)
# Prompts whose greedy reasoning ends (after 6 to 13 tokens; others make this random model
# repeat <think> until max_tokens); the third row's own max_tokens cuts its reasoning.
MESSAGES = pd.DataFrame({"id": ["m1", "m2", "m3"], "prompt": ["Win a prize now", "Meeting at 3pm", "Cheap pills"],
                         "max_tokens": [None, None, 2]})
PARTS = dg.StaticPartitionsDefinition(["a"])
REASONING_COLUMNS = [("reasoning", pa.string()), ("reasoning_tokens", pa.int32()), ("tool_calls", TOOL_CALLS_TYPE)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_reasoning_model(tmp_path_factory.mktemp("qwen3"), "qwen3", favour={"<think>": 6.0, "</think>": 3.0})


@pytest.fixture
def resources(qwen3, tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_LLM_OUTPUT_DIR", str(tmp_path / "out"))
    return {"llm": LLMResource(model_id=str(qwen3), dtype="float32", kv_cache_memory=16 << 20),
            "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables"))}


@dg.asset(partitions_def=PARTS, backfill_policy=dg.BackfillPolicy.single_run())
def messages() -> pd.DataFrame:
    return MESSAGES


def read(resources, name):
    return pq.read_table(partition_file(Path(resources["io_manager"].base_path), dg.AssetKey(name), "a"))


def test_thinking_on_and_off_fill_reasoning_and_typed_columns_and_a_cut_reasoning_fails_its_check(resources):
    thinking = build_generation_asset("thinking", upstream=messages, chat=True, output_schema=SPAM, sampling=GREEDY)
    plain = build_generation_asset("plain", upstream=messages, chat=True, output_schema=SPAM, sampling=GREEDY,
                                   chat_template_kwargs={"enable_thinking": False})
    with dg.instance_for_test() as instance:
        result = dg.materialize([messages, thinking, plain], partition_key="a", resources=resources,
                                instance=instance)
        on, off = read(resources, "thinking"), read(resources, "plain")
        assert [(f.name, f.type) for f in on.schema if f.name in dict(REASONING_COLUMNS)] == REASONING_COLUMNS
        assert on.schema.field("label").type == ENUM_TYPE and on.schema.field("sure").type == pa.bool_()
        *answered, cut = on.to_pylist()
        for row in answered:
            assert row["error"] is None and row["reasoning"] and 0 < row["reasoning_tokens"] < row["completion_tokens"]
            assert json.loads(row["generated_text"]) == {"label": row["label"], "sure": row["sure"]}
            assert row["label"] in ("spam", "ham") and row["tool_calls"] is None
        assert cut["error"].startswith("the reasoning did not end within max_tokens=2: raise max_tokens"), cut
        assert (cut["generated_text"], cut["finish_reason"], cut["label"], cut["reasoning_tokens"]) == ("", "length",
                                                                                                       None, 2)
        for row in off.to_pylist()[:2]:
            assert row["error"] is None and row["reasoning"] is None and row["reasoning_tokens"] == 0
            assert json.loads(row["generated_text"]) == {"label": row["label"], "sure": row["sure"]}

        checks = {(e.asset_key.path[0], e.check_name): e for e in result.get_asset_check_evaluations()}
        unfinished = checks[("thinking", "unfinished_reasoning")]
        assert not unfinished.passed and unfinished.metadata["rows"].value == 1
        assert checks[("thinking", "parse_rate")].passed and checks[("thinking", "no_empty_generations")].passed
        assert checks[("plain", "unfinished_reasoning")].passed
        meta = latest(instance, "thinking", "a").metadata
        assert meta["reasoning_tokens"].value == sum(on["reasoning_tokens"].to_pylist()) > 0
        assert meta["tool_call_rows"].value == 0 and meta["error_rows"].value == 1
        columns = {c.name: c for c in meta["dagster/column_schema"].value.columns}
        assert columns["tool_calls"].type == str(TOOL_CALLS_TYPE) and "reasoning section" in columns["reasoning"].description
        assert meta["dagster/column_lineage"].value.deps_by_column["reasoning"][0].column_name == "prompt"


@pytest.mark.parametrize("tool_choice", [None, "none"])
def test_tools_reach_the_rendered_prompt_and_the_table_has_their_columns(resources, monkeypatch, tool_choice):
    """The tools go to the template under "none" too; the prompt tells the engine's tool
    parser to leave the calls of a "none" row in its text (as vLLM does)."""
    rendered = []
    render = dagster_llm.core.prompts.render_chat

    def recording_render(*args, **kwargs):
        rendered.append(render(*args, **kwargs))
        return rendered[-1]

    monkeypatch.setattr(dagster_llm.core.prompts, "render_chat", recording_render)
    gen = build_generation_asset("gen", upstream=messages, chat=True, tools=[WEATHER], tool_choice=tool_choice,
                                 chat_template_kwargs={"enable_thinking": False},
                                 sampling=SamplingConfig(temperature=0, max_tokens=4))
    with dg.instance_for_test() as instance:
        assert dg.materialize([messages, gen], partition_key="a", resources=resources, instance=instance).success
        meta = latest(instance, "gen", "a").metadata
    assert len(rendered) == 3 and all('<tools>\n{"type": "function", "function": {"name": "get_weather"'
                                      in prompt["prompt"] for prompt in rendered)
    assert all(prompt.get("tool_choice") == tool_choice for prompt in rendered)
    table = read(resources, "gen")
    assert table.schema.field("tool_calls").type == TOOL_CALLS_TYPE
    assert [(f.name, f.type) for f in table.schema][-2:] == [("city", pa.string()), ("days", pa.int64())]
    assert table["tool_calls"].null_count == 3 and table["city"].null_count == 3  # the random model calls nothing
    assert meta["tool_call_rows"].value == 0
    columns = {c.name: c for c in meta["dagster/column_schema"].value.columns}
    assert columns["city"].description.startswith("Argument 'city' of the first call of tool 'get_weather': The city")


def test_tools_and_template_arguments_change_the_settings_digest_and_the_code_version():
    def code_version(**options):
        gen = build_generation_asset("gen", upstream="prompts", partitions_def=PARTS, **options)
        return gen.code_versions_by_key[dg.AssetKey("gen")]

    other_tool = {"type": "function", "function": {**WEATHER["function"], "description": "Tomorrow's weather."}}
    versions = [code_version(), code_version(tools=[WEATHER]), code_version(tools=[other_tool]),
                code_version(chat_template_kwargs={"enable_thinking": False}),
                code_version(chat_template_kwargs={"enable_thinking": True})]
    assert len(set(versions)) == len(versions)
    assert code_version(tools=[WEATHER]) == versions[1]
    digests = {GenerationSpec(name="gen", upstream="p", **options).settings_digest()
               for options in ({}, {"tools": [WEATHER]}, {"chat_template_kwargs": {"enable_thinking": False}})}
    assert len(digests) == 3


# A tool whose arguments are bounded (enums, a boolean): a random model's JSON ends soon.
TRIAGE = {"type": "function", "function": {"name": "triage", "parameters": {
    "type": "object", "properties": {"label": {"enum": ["spam", "ham"]}, "urgent": {"type": "boolean"}},
    "required": ["label", "urgent"], "additionalProperties": False}}}
ESCALATE = {"type": "function", "function": {"name": "escalate", "parameters": {
    "type": "object", "properties": {"team": {"enum": ["support", "sales"]}}, "required": ["team"],
    "additionalProperties": False}}}


@dg.asset(partitions_def=PARTS, backfill_policy=dg.BackfillPolicy.single_run())
def tickets() -> pd.DataFrame:
    return pd.DataFrame({"id": ["t1", "t2", "t3"], "prompt": ["Win a prize now", "Meeting at 3pm", "Cheap pills"]})


def test_a_forced_tool_choice_gives_every_row_its_calls(resources):
    """tool_choice "required" and a named tool on the tiny random model (thinking off: this
    one's greedy reasoning rambles past max_tokens with tools in its prompt;
    tests/engine/test_tool_choice.py has the grammar after the reasoning): every row's answer
    is calls, in the tool_calls column, the named tool's arguments in its typed columns;
    generated_text is empty, as vLLM's content."""
    options = {"chat": True, "sampling": SamplingConfig(temperature=0, max_tokens=200),
               "chat_template_kwargs": {"enable_thinking": False}}
    named = build_generation_asset("named", upstream=tickets, tools=[TRIAGE],
                                   tool_choice={"type": "function", "function": {"name": "triage"}}, **options)
    required = build_generation_asset("required", upstream=tickets, tools=[TRIAGE, ESCALATE], tool_choice="required",
                                      **options)
    with dg.instance_for_test() as instance:
        assert dg.materialize([tickets, named, required], partition_key="a", resources=resources,
                              instance=instance).success
        meta = {name: latest(instance, name, "a").metadata for name in ("named", "required")}
    for name in ("named", "required"):
        rows = read(resources, name).to_pylist()
        assert meta[name]["tool_call_rows"].value == 3 and meta[name]["error_rows"].value == 0
        for row in rows:
            assert row["error"] is None and row["generated_text"] == "" and row["tool_calls"], row
            assert row["reasoning"] is None
            for found in row["tool_calls"]:
                assert found["name"] in ("triage", "escalate") and found["id"].startswith("call_")
                assert set(json.loads(found["arguments"])) == ({"label", "urgent"} if found["name"] == "triage"
                                                                else {"team"})
    for row in read(resources, "named").to_pylist():
        [found] = row["tool_calls"]
        assert json.loads(found["arguments"]) == {"label": row["label"], "urgent": row["urgent"]}


def test_tool_choice_enters_the_code_version_and_every_rows_digest():
    def spec(**options):
        return GenerationSpec(name="gen", upstream="p", tools=[TRIAGE], **options)

    named = {"type": "function", "function": {"name": "triage"}}
    choices = [None, "none", "required", named]
    assert len({spec(tool_choice=choice).settings_digest() for choice in choices}) == len(choices)
    assert len({spec(tool_choice=choice).row_settings_digest() for choice in choices}) == len(choices)
    code_versions = {build_generation_asset("gen", upstream="prompts", partitions_def=PARTS, tools=[TRIAGE],
                                            tool_choice=choice).code_versions_by_key[dg.AssetKey("gen")]
                     for choice in choices}
    assert len(code_versions) == len(choices)


@pytest.mark.parametrize("options, message", [
    ({"tool_choice": "required"}, "gen: tool_choice: 'required' needs tools to call: give tools"),
    ({"tools": [TRIAGE], "tool_choice": {"type": "function", "function": {"name": "triag"}}},
     "gen: tool_choice.function.name: 'triag' is none of the tools ('triage')"),
    ({"tools": [TRIAGE], "tool_choice": "always"}, "gen: tool_choice: must be 'auto', 'none', 'required'"),
    ({"tools": [TRIAGE], "tool_choice": "required", "choices": ["a", "b"]},
     "gen: tool_choice 'required' makes every answer tool calls, by a grammar of their own, and "
     "output_schema/choices also applies to some partition: drop one of the two"),
    ({"tools": [TRIAGE], "tool_choice": "required", "beam_search_by_partition": {"a": {"beam_width": 2}}},
     "gen: tool_choice 'required' makes every answer tool calls, by a grammar of their own, and beam_search"),
])
def test_a_tool_choice_that_cannot_run_is_a_definition_error(options, message):
    with pytest.raises(dg.DagsterInvalidDefinitionError) as raised:
        build_generation_asset("gen", upstream="prompts", partitions_def=PARTS, **options)
    assert str(raised.value).startswith(message), str(raised.value)


def call(name, arguments, index=1):
    return ToolCall(f"call_{index}", FunctionCall(name, json.dumps(arguments)))


def request_output(text="", finish_reason="stop", stop_reason=None, **fields) -> RequestOutput:
    completion = CompletionOutput(0, text, [5] * 12, finish_reason=finish_reason, stop_reason=stop_reason, **fields)
    return RequestOutput("r", "prompt", [1, 2], [completion], True)


def prompt_row(max_tokens=12) -> PromptRow:
    return PromptRow("a", 0, "r1", "prompt", SamplingConfig(), SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("fields, cells, error", [
    ({"tool_calls": [call("get_weather", {"city": "Oslo", "days": 2}), call("get_weather", {"city": "Rome"}, 2)]},
     {"city": "Oslo", "days": 2}, None),
    ({"tool_calls": [call("get_time", {"zone": "UTC"})]}, {"city": None, "days": None},
     "tool call 1 names 'get_time', not the declared tool 'get_weather': its arguments fill no columns"),
    ({"tool_calls": [call("get_weather", {"city": "Oslo", "days": "many"})]}, {"city": None, "days": None},
     "tool call 1 (get_weather): arguments: days: 'many' is not of type 'integer'"),
    # A broken call is the row's error, and loses nothing: a named call is in tool_calls, its arguments as
    # written; one that cannot be read stays in generated_text beside the calls that parse.
    ({"tool_calls": [ToolCall("call_1", FunctionCall("get_weather", "[]"))],
      "tool_call_error": "tool call 1: arguments are not a JSON object (got list): '[]'"}, {"city": None, "days": None},
     "tool_calls: tool call 1: arguments are not a JSON object (got list): '[]' (kept as the model wrote it: in "
     "tool_calls where the call is named, else in generated_text)"),
    ({"text": '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',
      "tool_calls": [call("get_weather", {"city": "Oslo"})],
      "tool_call_error": "tool call 2: the call is not valid JSON"}, {"city": None, "days": None},
     "tool_calls: tool call 2: the call is not valid JSON (kept as the model wrote it"),
    ({"text": "Sunny.", "reasoning": "Easy."}, {"city": None, "days": None}, None),
    ({"reasoning": "Hmm", "reasoning_ended": False, "num_reasoning_tokens": 12, "finish_reason": "length"},
     {"city": None, "days": None}, "the reasoning did not end within max_tokens=12: raise max_tokens (the sampling"),
    ({"reasoning": "Hmm", "reasoning_ended": False, "num_reasoning_tokens": 5}, {"city": None, "days": None},
     "the reasoning did not end: the completion ended at EOS inside it: sample again"),
    ({"reasoning": "Hmm", "reasoning_ended": False, "stop_reason": "###"}, {"city": None, "days": None},
     "the reasoning did not end: the completion stopped at '###' (a stop string or token) inside it: drop that stop"),
])
def test_records_hold_tool_calls_their_typed_arguments_and_the_reason_an_answer_is_missing(fields, cells, error):
    tool = ToolArguments.of([WEATHER])
    record = result_record(prompt_row(), request_output(**fields), "model", tool)
    assert {name: record[name] for name in cells} == cells
    assert record["error"] is None if error is None else record["error"].startswith(error), record["error"]
    calls = fields.get("tool_calls")
    assert record["tool_calls"] == ([{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                     for c in calls] if calls else None)
    assert record["generated_text"] == fields.get("text", "") and record["reasoning"] == fields.get("reasoning")
    table = records_table([record], tool=tool)
    assert table.schema.field("days").type == pa.int64() and table["tool_calls"].type == TOOL_CALLS_TYPE
    outcomes = evaluate(table, GenerationSpec(name="gen", upstream="p").thresholds())
    # A call with no text besides it is not an empty generation; a reasoning that never ended
    # counts in its own check only.
    assert outcomes["no_empty_generations"].passed
    assert outcomes["unfinished_reasoning"].passed is (fields.get("reasoning_ended") is not False)


def test_only_one_tool_with_parameters_gets_argument_columns():
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    assert ToolArguments.of([WEATHER, other]) is None and ToolArguments.of([other]) is None
    assert ToolArguments.of(None) is None and [c.name for c in ToolArguments.of([WEATHER]).columns] == ["city", "days"]


def tool(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


@pytest.mark.parametrize("options, message", [
    ({"tools": [{"type": "function"}]}, "gen: tools[0]: is not a function tool; write each tool as {'type': 'function'"),
    ({"tools": [tool(), {"type": "function", "function": {"parameters": {"type": "object"}}}]},
     "gen: tools[1].function.name: give the function a name (a non-empty string), got None"),
    ({"tools": [tool(), tool()]}, "gen: tools[1].function.name: 'f' names an earlier tool too"),
    ({"tools": [tool(parameters={"type": "array"})]},
     "gen: tools[0].function.parameters: must be the JSON schema of an object"),
    ({"tools": [tool(parameters={"type": "object", "properties": {"x": {"type": "strin"}}})]},
     "gen: tools[0].function.parameters: is not a valid JSON schema at properties/x/type: "),
    ({"tools": [tool(parameters={"type": "object", "properties": {"id": {"type": "string"}}})]},
     "gen: tools[0]: the parameter(s) ['id'] of tool 'f' would replace the generation table's column(s)"),
    ({"tools": [WEATHER], "output_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
     "gen: tools[0]: the parameter(s) ['city'] of tool 'get_weather' are also fields of the structured output"),
    ({"output_schema": {"type": "object", "properties": {"reasoning": {"type": "string"}}}},
     "gen: output_schema/choices: output field(s) ['reasoning'] would replace the generation table's column(s)"),
])
def test_bad_tools_and_clashing_columns_are_definition_errors(options, message):
    with pytest.raises(dg.DagsterInvalidDefinitionError) as raised:
        build_generation_asset("gen", upstream="prompts", partitions_def=PARTS, **options)
    assert str(raised.value).startswith(message), str(raised.value)


def test_the_component_takes_tools_and_template_arguments_from_yaml():
    component = GenerationComponent.resolve_from_yaml("""
name: gen
upstream: prompts
chat: true
partitions: [a]
chat_template_kwargs: {enable_thinking: false}
tools:
  - type: function
    function:
      name: get_weather
      parameters: {type: object, properties: {city: {type: string}}}
""")
    assert component.chat_template_kwargs == {"enable_thinking": False}
    [asset] = dg.build_defs_for_component(component).assets
    columns = asset.specs_by_key[dg.AssetKey("gen")].metadata["dagster/column_schema"].columns
    assert columns[-1].name == "city"
    broken = component.model_copy(update={"tools": [{"type": "function", "function": {"name": "x"}}]})
    with pytest.raises(dg.DagsterInvalidDefinitionError, match=r"^gen: tools\[0\].function.parameters: must be"):
        dg.build_defs_for_component(broken)


def test_rows_saved_before_the_reasoning_columns_existed_resume_with_them_null(qwen3, tmp_path):
    """A shard of the partition's data version written without the new columns (as by the
    code before them) is resumed: its rows come back with those columns null, not an error."""
    files = PartitionFiles(tmp_path / "gen" / "a.parquet")
    options = RunOptions(model_id="qwen3", code_version="1")
    rules = PromptTableRules(chat=True)
    with engine.LLM(str(qwen3), dtype="float32", kv_cache_memory=16 << 20) as llm:
        def partition() -> PartitionInput:
            settings = PartitionSettings("a", GREEDY, None, None, llm.get_default_sampling_params())
            return PartitionInput("a", read_rows(MESSAGES.drop(columns="max_tokens"), settings, rules,
                                                 llm.get_tokenizer()), files)

        [first] = GenerationRun(llm, {}, options, lambda _: None).generate([partition()])
        assert first.stats.reasoning_tokens == sum(first.table["reasoning_tokens"].to_pylist()) > 0
        old = first.table.drop_columns([name for name, _ in REASONING_COLUMNS])
        files.path.unlink()
        files.append_shard(first.data_version, old.append_column(POSITION_COLUMN, pa.array([0, 1, 2], pa.int32())))
        [resumed] = GenerationRun(llm, {}, options, lambda _: None).generate([partition()])
    assert (resumed.stats.resumed_rows, resumed.stats.generated_rows, resumed.stats.reasoning_tokens) == (3, 0, 0)
    assert resumed.table.drop_columns([name for name, _ in REASONING_COLUMNS]).equals(old)
    assert all(resumed.table[name].null_count == 3 for name, _ in REASONING_COLUMNS)
    assert pq.read_table(files.path).schema.names == resumed.table.schema.names
