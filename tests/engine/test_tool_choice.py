"""tool_choice "required" and a named function (`engine.entrypoints.tool_choice`): the choice checked
against its tools before anything runs, the grammar of the calls, and on a tiny random
Qwen3-shaped model, thinking off and on, a parseable call on every row of a batch, in
`LLM.chat` and in `run_batch` (random weights: the grammar makes it exact)."""

import json
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.entrypoints.openai.batch import BatchRun, run_batch_file
from engine.entrypoints.openai.protocol import CHAT_URL, INVALID_REQUEST
from engine.entrypoints.tool_choice import REQUIRED, ToolChoiceError, constrained, resolve_tool_choice
from tests.reasoning_models import build_reasoning_model

# Bounded arguments (enums, a small integer, a boolean): a random model's JSON ends soon.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}
QUESTIONS = [[{"role": "user", "content": f"Question {i}: the weather, or the time?"}] for i in range(6)]
THINKING_OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_reasoning_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(str(folder), dtype="float32") as llm:
        yield llm


def thinking_bias(tokenizer) -> dict[int, float]:
    """A random model that opens its reasoning at once and closes it soon (it would ramble
    until max_tokens), and does not stop inside it."""
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return {think: 4.0, end: 3.0, tokenizer.eos_token_id: -8.0}


def sampling(llm: LLM, thinking: bool) -> list[SamplingParams]:
    bias = thinking_bias(llm.get_tokenizer()) if thinking else None
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=300, logit_bias=bias)
            for seed in range(len(QUESTIONS))]


def check_calls(completion, named: bool) -> None:
    """A completion of a forced choice: its calls only, each of a tool, with arguments its schema takes."""
    assert completion.reasoning_ended is not False and completion.tool_call_error is None, completion
    assert completion.text == "" and completion.tool_calls, completion
    if named:
        assert [call.function.name for call in completion.tool_calls] == ["get_time"]
    for call in completion.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- the choice and its grammar, without a model ----------------------------------------------


@pytest.mark.parametrize(("tool_choice", "tools", "message"), [
    ("always", TOOLS, "tool_choice: must be 'auto', 'none', 'required' or a named function"),
    (5, TOOLS, "tool_choice: must be"),
    ("required", None, "tool_choice: 'required' needs tools to call: give tools, or drop tool_choice"),
    ("required", [], "tool_choice: 'required' needs tools"),
    ({"type": "function", "function": {"name": "get_wether"}}, TOOLS,
     "tool_choice.function.name: 'get_wether' is none of the tools ('get_weather', 'get_time')"),
    ({"type": "function", "function": {}}, TOOLS, "tool_choice.function.name: give the name"),
    ({"type": "function", "function": {"name": "f"}}, [{"name": "f"}], "tools[0]: expected {'type': 'function'"),
    ("required", [WEATHER, {"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[1].function.parameters: must be a JSON schema (an object)"),
])
def test_a_choice_that_does_not_fit_its_tools_names_the_field(tool_choice, tools, message):
    with pytest.raises(ToolChoiceError) as raised:
        resolve_tool_choice(tool_choice, tools)
    assert str(raised.value).startswith(message), raised.value


def test_the_grammar_of_required_is_a_non_empty_array_of_each_tools_calls():
    """vLLM's schema: each item one tool's name (an enum of one) and its parameters (none: an
    empty object), the tools' $defs gathered at the top where their $refs point; a named
    function's is its parameters, the whole answer being the arguments."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    located = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}, "$defs": {"point": point}}}}
    bare = {"type": "function", "function": {"name": "ping"}}
    grammar = resolve_tool_choice(REQUIRED, [located, bare]).grammar()
    assert grammar.disable_any_whitespace and grammar.json == {
        "type": "array", "minItems": 1, "$defs": {"point": point},
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["locate"]},
                            "parameters": {"type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["ping"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]}}
    assert "$defs" in located["function"]["parameters"]  # the tool itself is left as it was
    assert resolve_tool_choice(NAMED, TOOLS).grammar().json == TIME["function"]["parameters"]
    assert resolve_tool_choice("auto", TOOLS).grammar() is None and resolve_tool_choice("none", TOOLS).grammar() is None
    clash = {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "$defs": {"point": {}}}}}
    with pytest.raises(ToolChoiceError, match=r"tools\[1\].function.parameters.\$defs.point: an earlier tool"):
        resolve_tool_choice(REQUIRED, [located, clash])


def test_a_forced_choice_and_another_constraint_are_refused():
    """vLLM refuses a named choice beside a structured output (and drops the structured
    output of "required" with a warning); both are refused here, naming the other constraint."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    for choice in ("required", NAMED):
        with pytest.raises(ToolChoiceError, match="also constrains it \\(regex\\): keep one of them"):
            constrained(params, resolve_tool_choice(choice, TOOLS))
    assert constrained(params, resolve_tool_choice("auto", TOOLS)) is params


# -- LLM.chat on a tiny random model -------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinking_on"])
def test_every_row_of_a_batch_calls_a_tool(llm, tool_choice, thinking):
    """Sampled random weights, six rows: each calls as the choice says, with arguments its
    tool's schema takes; with thinking, the grammar waits for the reasoning to end."""
    outputs = llm.chat(QUESTIONS, sampling(llm, thinking), tools=TOOLS, tool_choice=tool_choice, use_tqdm=False,
                       chat_template_kwargs=None if thinking else THINKING_OFF)
    for output in outputs:
        check_calls(output.outputs[0], named=tool_choice is NAMED)
    reasoned = [o.outputs[0] for o in outputs if o.outputs[0].reasoning is not None]
    if thinking:
        assert len(reasoned) == len(QUESTIONS) and all(c.num_reasoning_tokens > 2 for c in reasoned)
    else:
        assert not reasoned


def test_the_calls_come_from_the_grammar_not_from_the_tool_parser(folder):
    """llama3_json reads an answer {"name": ..., "parameters": {...}} as a call of that name:
    here it is the arguments of a named tool that takes a name and parameters, and the call
    is read from what the grammar made."""
    register = {"type": "function", "function": {"name": "register", "parameters": {
        "type": "object", "properties": {"name": {"enum": ["Ann", "Bob"]},
                                         "parameters": {"type": "object", "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False}}}
    choice = {"type": "function", "function": {"name": "register"}}
    with LLM(str(folder), dtype="float32", tool_call_parser="llama3_json") as llm:
        params = SamplingParams(temperature=0, max_tokens=40)
        [misread] = llm.chat(QUESTIONS[0], constrained(params, resolve_tool_choice(choice, [register])),
                             tools=[register], chat_template_kwargs=THINKING_OFF, use_tqdm=False)
        [output] = llm.chat(QUESTIONS[0], params, tools=[register], tool_choice=choice,
                            chat_template_kwargs=THINKING_OFF, use_tqdm=False)
    assert output.outputs[0].token_ids == misread.outputs[0].token_ids
    assert misread.outputs[0].tool_calls[0].function.name in ("Ann", "Bob")  # the engine's parser's reading
    [call] = output.outputs[0].tool_calls
    assert call.function.name == "register"
    assert json.loads(call.function.arguments) in ({"name": "Ann", "parameters": {}}, {"name": "Bob", "parameters": {}})


def test_none_leaves_a_call_the_model_writes_anyway_in_the_text(llm):
    """vLLM reads no calls under tool_choice "none" (the tools still go to the template); a
    regex stands in for a model that calls anyway, and "auto" reads the same answer's call."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    params = SamplingParams(temperature=0, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(regex=call.replace("{", "\\{")
                                                                       .replace("}", "\\}")))
    outputs = {choice: llm.chat(QUESTIONS[0], params, tools=TOOLS, tool_choice=choice,
                                chat_template_kwargs=THINKING_OFF, use_tqdm=False)[0].outputs[0]
               for choice in ("none", "auto")}
    assert outputs["none"].token_ids == outputs["auto"].token_ids
    assert (outputs["none"].text, outputs["none"].tool_calls, outputs["none"].tool_call_error) == (call, None, None)
    assert [c.function.name for c in outputs["auto"].tool_calls] == ["get_time"] and outputs["auto"].text == ""


def test_a_json_cut_by_max_tokens_keeps_its_text_and_says_why(llm):
    [output] = llm.chat(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=4), tools=TOOLS, tool_choice="required",
                        chat_template_kwargs=THINKING_OFF, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and completion.tool_calls is None
    assert completion.text.startswith("[") and "tool call 1: the array of calls is not valid JSON" in completion.tool_call_error


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name: 'nope'"),
    ({"tool_choice": "required", "tools": None}, "tool_choice: 'required' needs tools"),
    ({"tool_choice": "required", "sampling_params": SamplingParams(structured_outputs=StructuredOutputsParams(
        json={"type": "object"}))}, "tool_choice: 'required' makes the answer tool calls, and sampling_params also"),
    ({"tool_choice": NAMED, "sampling_params": [SamplingParams(), SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["a"]))]}, "and sampling_params[1] also constrains"),
    ({"tool_choice": "required", "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strnig"}}}}}]},
     'chat: tools[1].function.parameters: does not compile: Unsupported type "strnig": tool_choice'),
])
def test_chat_refuses_a_bad_tool_choice_before_anything_runs(llm, kwargs, message):
    before = llm.get_stats().num_generated_tokens
    with pytest.raises(ValueError) as raised:
        llm.chat(QUESTIONS[:2], **{"tools": TOOLS, **kwargs}, use_tqdm=False)
    assert message in str(raised.value)
    assert llm.get_stats().num_generated_tokens == before


# -- run_batch ---------------------------------------------------------------------------------


def test_run_batch_answers_forced_choices_on_every_line_and_refuses_bad_ones(folder, tmp_path):
    """As vLLM's run-batch tests check: with tool_choice "required" each response has tool
    calls (id, type "function", a tool's name), and a reasoning model's reasoning is
    `message.reasoning`; a named choice finishes with "stop" (as OpenAI and vLLM answer a
    call forced by name). A bad tool choice is its line's error, and the others run."""
    bias = {str(token): value for token, value in thinking_bias(AutoTokenizer.from_pretrained(folder)).items()}
    good = {f"{kind}-{i}": {"messages": QUESTIONS[i], "tools": TOOLS, "tool_choice": choice, "seed": i,
                            "max_completion_tokens": 300, "temperature": 1.0,
                            **({"logit_bias": bias} if kind.endswith("thinking") else
                               {"chat_template_kwargs": THINKING_OFF})}
            for i in range(3) for kind, choice in (("required-thinking", "required"), ("named", NAMED))}
    bad = {"bad-name": {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
           "bad-no-tools": {"tool_choice": "required", "tools": None},
           "bad-both": {"tool_choice": NAMED, "response_format": {"type": "json_object"}},
           "bad-schema": {"tool_choice": "required", "tools": [{"type": "function", "function": {
               "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strnig"}}}}}]}}
    bodies = {**good, **{cid: {"messages": QUESTIONS[0], "tools": TOOLS, **fields} for cid, fields in bad.items()}}
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": CHAT_URL, "body": body}) + "\n"
                              for cid, body in bodies.items()))
    summary = run_batch_file(str(source), str(out), BatchRun(str(folder), settings={"dtype": "float32"}))
    assert (summary.ok, summary.errors) == (len(good), len(bad))
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for cid in good:
        [choice] = records[cid]["response"]["body"]["choices"]
        message = choice["message"]
        assert message["content"] is None and "reasoning_content" not in message
        assert choice["finish_reason"] == ("stop" if cid.startswith("named") else "tool_calls")
        for call in message["tool_calls"]:
            assert call["id"].startswith("call_") and call["type"] == "function"
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        assert bool(message.get("reasoning")) == cid.startswith("required-thinking")
    errors = {cid: records[cid]["error"] for cid in bad}
    assert {e["code"] for e in errors.values()} == {INVALID_REQUEST}
    assert errors["bad-name"]["message"].startswith("line 7: tool_choice.function.name: 'nope' is none of the tools")
    assert "tool_choice: 'required' needs tools" in errors["bad-no-tools"]["message"]
    assert "and response_format also constrains it (json_object): keep one" in errors["bad-both"]["message"]
    assert 'tools[0].function.parameters: does not compile: Unsupported type "strnig"' in errors["bad-schema"]["message"]
