"""qwen3_coder and kimi_k2 beyond vLLM's cases (tests/parser_cases/): the tokenizer implies
them, qwen3_coder converts each parameter by the request's tool schema (and leaves them text
without one), broken calls give an error and the text, Kimi's ids are the model's, and the
request's tools travel from `LLM.chat` and a batch line to the parser: on a tiny random
model whose chat template writes XML calls, forced to call by a regex."""

import json

import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.entrypoints.chat_utils import render_chat
from engine.entrypoints.openai.protocol import CHAT_URL
from engine.entrypoints.openai.serving import generation_request
from engine.tool_parsers import detect_tool_parser, tool_parser
from tests.reasoning_models import build_reasoning_model
from tests.tiny_models import build_tokenizer

KIMI_MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_end|>", "<|tool_call_argument_begin|>"]
# A chat template that writes Qwen3-Coder's XML calls (Qwen3-Coder's own, shortened to what the tests need).
XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>{% for tool in tools %}"
    "{{ tool | tojson }}{% endfor %}</tools>\nCall one as:\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "Weather in Oslo for three days?"}]


def _xml_call(function: str, **values: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


def _kimi_call(call_id: str, arguments: str) -> str:
    return f"<|tool_calls_section_begin|><|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{arguments}" \
           "<|tool_call_end|><|tool_calls_section_end|>"


def _tool(properties: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties}}}]


def _arguments(parser: str, text: str, tools: object = None) -> dict:
    result = tool_parser(parser, None).parse(text, [], tools)
    assert result.error is None, result.error
    [call] = result.tool_calls
    return json.loads(call.function.arguments)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("new_parsers_tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.mark.parametrize(("special", "plain", "template", "expected"), [
    ([], ["<tool_call>", "</tool_call>"], XML_TEMPLATE, "qwen3_coder"),
    ([], ["<tool_call>", "</tool_call>"], "{{ messages }}<tool_call>{{ tools | tojson }}</tool_call>", "hermes"),
    ([], ["<tool_call>"], XML_TEMPLATE, None),
    (KIMI_MARKERS, [], "{{ messages }}", "kimi_k2"),
    (KIMI_MARKERS[2:], [], "{{ messages }}", None),
], ids=["xml_template", "json_template", "half_hermes", "kimi", "kimi_without_section"])
def test_the_tokenizer_implies_the_parser(special, plain, template, expected, tokenizer_folder):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.add_tokens(plain)
    tokenizer.chat_template = template
    assert detect_tool_parser(tokenizer) == expected


@pytest.mark.parametrize(("schema", "text", "value"), [
    ({"type": "integer"}, "7", 7),
    ({"type": "integer"}, "seven", "seven"),  # not an integer: the text
    ({"type": "number"}, "3.0", 3),  # a whole number reads as an integer, as vLLM does
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "1e400", "1e400"),  # infinite: no JSON number, the text
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "yes", False),  # vLLM's rule: anything but true is false
    ({"type": "array"}, "['a', 1, None]", ["a", 1, None]),  # a Python literal
    ({"type": "object"}, "{1, 2}", "{1, 2}"),  # a Python set is no JSON value: the text
    ({"type": "object"}, "{'a': ", "{'a': "),
    ({"type": "string"}, "None", "None"),
    ({"type": "string"}, " 42 ", " 42 "),
    ({"type": ["string", "null"]}, "42", "42"),
    ({"type": ["string", "null"]}, "None", None),
    ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, "12", 12),
    ({"type": "integer"}, "null", None),
    ({"description": "no type"}, "[1]", "[1]"),  # no type: a string
])
def test_a_parameter_reads_as_its_schemas_type(schema, text, value):
    output = _xml_call("f", x=text)
    assert _arguments("qwen3_coder", output, _tool({"x": schema})) == {"x": value}


def test_without_a_schema_every_value_stays_text():
    output = _xml_call("f", n="3", flag="true", data='{"a": 1}')
    expected = {"n": "3", "flag": "true", "data": '{"a": 1}'}
    assert _arguments("qwen3_coder", output) == expected  # no tools: a generate prompt
    assert _arguments("qwen3_coder", _xml_call("f", n="3"), _tool({"other": {"type": "integer"}})) == {"n": "3"}
    assert _arguments("qwen3_coder", _xml_call("g", n="3"), _tool({"n": {"type": "integer"}})) == {"n": "3"}


@pytest.mark.parametrize("tools", [5, "tools", [None, 3, {"function": "f"}, {"function": {"name": 1}}], {"a": 1}])
def test_tools_of_any_shape_are_read_without_raising(tools):
    assert _arguments("qwen3_coder", _xml_call("f", n="3"), tools) == {"n": "3"}
    result = tool_parser("kimi_k2", None).parse(_kimi_call("0", '{"n": 3}'), [], tools)
    assert result.tool_calls is None and "counter" in result.error


def test_the_responses_apis_flat_tools_read_the_same():
    flat = [{"type": "function", "name": "f",
             "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}]
    assert _arguments("qwen3_coder", _xml_call("f", n="3"), flat) == {"n": 3}


@pytest.mark.parametrize(("parser", "text", "error"), [
    ("qwen3_coder", "<tool_call>\n<function=get_weather\n</function>\n</tool_call>",
     "tool call 1: '<function=get_weather\\n</function>' names no function"),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>", "names no function"),
    ("kimi_k2", "Checking.<|tool_calls_section_begin|><|tool_calls_section_end|>", "the calls section holds no call"),
    ("kimi_k2", _kimi_call("functions.get_weather", "{}"), "is not a call id"),
])
def test_a_broken_call_gives_an_error_and_the_text(parser, text, error):
    result = tool_parser(parser, None).parse(text, [])
    assert result.content == text and result.tool_calls is None
    assert result.error is not None and error in result.error, result.error


@pytest.mark.parametrize("arguments", ['{"city": "Be', "[1]"])
def test_a_kimi_call_whose_arguments_are_not_an_object_is_kept_as_written_and_named(arguments):
    result = tool_parser("kimi_k2", None).parse(_kimi_call("functions.get_weather:0", arguments), [])
    assert [(call.id, call.function.name, call.function.arguments) for call in result.tool_calls] == \
        [("functions.get_weather:0", "get_weather", arguments)]
    assert result.error.startswith("tool call 1: arguments are not a JSON object"), result.error


def test_text_without_calls_is_content():
    for parser in ("qwen3_coder", "kimi_k2"):
        result = tool_parser(parser, None).parse("Use <tool_call> tags like this.", [])
        assert (result.content, result.tool_calls, result.error) == ("Use <tool_call> tags like this.", None, None)


def test_kimi_keeps_the_models_ids_and_qwen3_coder_makes_openais():
    kimi = tool_parser("kimi_k2", None).parse(_kimi_call("functions.get_weather:3", '{"city": "Oslo"}'), [])
    assert [(call.id, call.function.name) for call in kimi.tool_calls] == [("functions.get_weather:3", "get_weather")]
    [call] = tool_parser("qwen3_coder", None).parse(_xml_call("get_weather", city="Oslo"), []).tool_calls
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


def test_kimi_markers_hidden_from_the_text_are_found_through_the_token_ids(tokenizer_folder):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": KIMI_MARKERS})
    token_ids = tokenizer.encode("Checking. " + _kimi_call("functions.get_weather:0", '{"city": "Oslo"}'),
                                 add_special_tokens=False)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "<|tool_call_begin|>" not in text
    result = tool_parser("kimi_k2", tokenizer).parse(text, token_ids)
    assert (result.content, result.tool_calls[0].id) == ("Checking.", "functions.get_weather:0")


def test_a_chat_prompt_and_a_batch_line_carry_their_tools(tokenizer_folder):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.chat_template = XML_TEMPLATE
    assert render_chat(tokenizer, QUESTION, tools=[WEATHER])["tools"] == [WEATHER]
    assert "tools" not in render_chat(tokenizer, QUESTION)
    request = generation_request(CHAT_URL, {"messages": QUESTION, "tools": [WEATHER]}, tokenizer)
    assert request.prompts[0]["tools"] == [WEATHER]


@pytest.fixture(scope="module")
def xml_model(tmp_path_factory):
    folder = build_reasoning_model(tmp_path_factory.mktemp("qwen3_coder_model"), "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = XML_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_chat_reads_the_calls_by_its_tools_and_generate_without(xml_model):
    """The tokenizer implies qwen3_coder; a regex stands in for a model that calls the tool.
    The chat's completions (two of the request: the fork keeps the tools) read `days` as
    the integer its schema says; the same prompt and output through `generate`, which has
    no tools, leave it text."""
    call = (r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Oslo|Paris)\n</parameter>\n"
            r"<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>")
    def params(n: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=120,
                              structured_outputs=StructuredOutputsParams(regex=call))

    with LLM(xml_model, dtype="float32") as llm:
        assert llm.llm_engine.tool_parser.name == "qwen3_coder"
        [chat] = llm.chat(QUESTION, params(2), tools=[WEATHER], use_tqdm=False)
        prompt = llm.get_tokenizer().apply_chat_template(QUESTION, tools=[WEATHER], tokenize=False,
                                                        add_generation_prompt=True)
        [plain] = llm.generate([prompt], params(1), use_tqdm=False)
    for completion in chat.outputs:
        assert completion.text == "Checking." and completion.tool_call_error is None
        [tool_call] = completion.tool_calls
        arguments = json.loads(tool_call.function.arguments)
        assert tool_call.function.name == "get_weather" and isinstance(arguments["days"], int)
        assert arguments["city"] in ("Oslo", "Paris")
    [tool_call] = plain.outputs[0].tool_calls
    assert isinstance(json.loads(tool_call.function.arguments)["days"], str)
