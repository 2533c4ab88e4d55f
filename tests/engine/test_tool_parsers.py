"""The tool-call parsers on recorded-style answers of each format: the same calls read to the
same OpenAI-shaped structure whatever the format, a broken call gives an error and loses
nothing (never an exception): the calls that parse are returned beside it, a named call whose
arguments are not a JSON object is returned as written, a call that cannot be read stays in
the content as the model wrote it; plain answers stay plain, ids are reproducible and in the
format's style, and marker tokens hidden from the user's text are found through the token
ids. No model runs here."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.outputs import FunctionCall
from engine.tool_parsers import TOOL_CALL_PARSERS, ToolCallResult, detect_tool_parser, tool_parser
from tests.tiny_models import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"timezone": "Europe/Paris"})
UNICODE = ("search", {"query": "東京 café 🙂", "lang": "日本語"})
NESTED = ("book", {"guests": [{"name": "Zoë", "age": 30}],
                   "options": {"breakfast": True, "budget": {"max": 250.5, "currency": "EUR"}}, "note": None})

# Each case: the calls and the content that every format's answer below must read to.
EXPECTED = {
    "one": ("", [WEATHER]),
    "several": ("", [WEATHER, TIME]),
    "content_before": ("Let me check the weather.", [WEATHER]),
    "unicode": ("", [UNICODE]),
    "nested": ("", [NESTED]),
}

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _ds(name: str, arguments: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def _ds31(name: str, arguments: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{arguments}{DS_CALL_END}"


# What the models write (special tokens as text), one case of EXPECTED each.
ANSWERS = {
    "hermes": {
        "one": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "several": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
        "content_before": 'Let me check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                          '{"city": "Paris", "days": 3}}\n</tool_call>',
        "unicode": '<tool_call>\n{"name": "search", "arguments": {"query": "東京 café 🙂", "lang": "日本語"}}\n'
                   '</tool_call>',
        "nested": '<tool_call>\n{"name": "book", "arguments": {"guests": [{"name": "Zo\\u00eb", "age": 30}], '
                  '"options": {"breakfast": true, "budget": {"max": 250.5, "currency": "EUR"}}, "note": null}}\n'
                  '</tool_call>',
    },
    "llama3_json": {
        "one": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        "several": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        "content_before": 'Let me check the weather.<|python_tag|>{"name": "get_weather", "parameters": '
                          '{"city": "Paris", "days": 3}}',
        "unicode": '<|python_tag|>{"name": "search", "arguments": {"query": "東京 café 🙂", "lang": "日本語"}}',
        "nested": '{"name": "book", "parameters": {"guests": [{"name": "Zoë", "age": 30}], "options": '
                  '{"breakfast": true, "budget": {"max": 250.5, "currency": "EUR"}}, "note": null}}',
    },
    "mistral": {
        "one": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        "several": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
                   '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}',
        "content_before": 'Let me check the weather.[TOOL_CALLS] [{"name": "get_weather", "arguments": '
                          '{"city": "Paris", "days": 3}}]',
        "unicode": '[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{"query": "東京 café 🙂", "lang": "日本語"}',
        "nested": '[TOOL_CALLS]book[ARGS]{"guests": [{"name": "Zoë", "age": 30}], "options": '
                  '{"breakfast": true, "budget": {"max": 250.5, "currency": "EUR"}}, "note": null}',
    },
    "pythonic": {
        "one": '[get_weather(city="Paris", days=3)]',
        "several": "[get_weather(city='Paris', days=3), get_time(timezone='Europe/Paris')]",
        "content_before": 'Let me check the weather.<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>',
        "unicode": '[search(query="東京 café 🙂", lang="日本語")]',
        "nested": '[book(guests=[{"name": "Zoë", "age": 30}], options={"breakfast": True, "budget": '
                  '{"max": 250.5, "currency": "EUR"}}, note=None)]',
    },
    "deepseek_v3": {
        "one": DS_CALLS + _ds("get_weather", '{"city": "Paris", "days": 3}') + DS_CALLS_END,
        "several": DS_CALLS + _ds("get_weather", '{"city": "Paris", "days": 3}')
                   + "\n" + _ds("get_time", '{"timezone": "Europe/Paris"}') + DS_CALLS_END,
        "content_before": "Let me check the weather.\n" + DS_CALLS
                          + f'{DS_CALL}get_weather{DS_SEP}{{"city": "Paris", "days": 3}}{DS_CALL_END}'  # V3.1
                          + DS_CALLS_END,
        "unicode": DS_CALLS + _ds("search", '{"query": "東京 café 🙂", "lang": "日本語"}') + DS_CALLS_END,
        "nested": DS_CALLS + _ds("book", '{"guests": [{"name": "Zoë", "age": 30}], "options": {"breakfast": true, '
                                         '"budget": {"max": 250.5, "currency": "EUR"}}, "note": null}') + DS_CALLS_END,
    },
    "deepseek_v31": {
        "one": DS_CALLS + _ds31("get_weather", '{"city": "Paris", "days": 3}') + DS_CALLS_END,
        "several": DS_CALLS + _ds31("get_weather", '{"city":"Paris","days":3}')
                   + _ds31("get_time", '{"timezone": "Europe/Paris"}') + DS_CALLS_END,
        "content_before": "Let me check the weather.\n\n" + DS_CALLS
                          + _ds31("get_weather", '{"city": "Paris", "days": 3}') + DS_CALLS_END,
        "unicode": DS_CALLS + _ds31("search", '{"query": "東京 café 🙂", "lang": "日本語"}') + DS_CALLS_END,
        "nested": DS_CALLS + _ds31("book", '{"guests": [{"name": "Zoë", "age": 30}], "options": {"breakfast": true, '
                                           '"budget": {"max": 250.5, "currency": "EUR"}}, "note": null}')
                  + DS_CALLS_END,
    },
}



def _harmony(name: str, arguments: str, recipient_in_role: bool = False) -> str:
    """A harmony call message as the answer after the analysis holds it (from inside its header)."""
    if recipient_in_role:
        return f" to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>"
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}<|call|>"


ANSWERS["openai"] = {
    "one": _harmony("get_weather", '{"city": "Paris", "days": 3}'),
    "several": _harmony("get_weather", '{"city": "Paris", "days": 3}') + "<|start|>assistant"
               + _harmony("get_time", '{"timezone": "Europe/Paris"}', recipient_in_role=True),
    "content_before": "<|channel|>commentary<|message|>Let me check the weather.<|end|><|start|>assistant"
                      + _harmony("get_weather", '{"city": "Paris", "days": 3}'),
    "unicode": _harmony("search", '{"query": "東京 café 🙂", "lang": "日本語"}', recipient_in_role=True),
    "nested": _harmony("book", '{"guests": [{"name": "Zoë", "age": 30}], "options": {"breakfast": true, '
                               '"budget": {"max": 250.5, "currency": "EUR"}}, "note": null}'),
}

# Calls that cannot be read (not delimited, or naming no function), alone in their answer: the
# answer and a piece of the error it must give; the text stays as the model wrote it.
UNREADABLE = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
         "tool call 1: the call is not valid JSON"),
        ('<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', "tool call 1: missing a function name"),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "tool call 1: the call is not valid JSON"),
        ('<tool_call>["get_weather", {"city": "Paris"}]</tool_call>', "tool call 1: expected an object"),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"', "tool call 1: the call is not valid JSON"),
        ('{"name": 7, "parameters": {"city": "Paris"}}', "tool call 1: missing a function name"),
        ('Here: {"name": "get_weather", "parameters": {"city": "Paris"', "tool call 1: the call is not valid JSON"),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]', "tool call 1: the call is not valid"),
        ('[TOOL_CALLS][{"arguments": {"city": "Paris"}}]', "tool call 1: missing a function name"),
        ("[TOOL_CALLS] get weather in Paris", "tool call 1: expected a JSON list of calls"),
    ],
    "pythonic": [
        ("[get_weather(city=paris)]", "tool call 1: get_weather: argument 'city' is not a literal JSON value"),
        ("[f(x=1 + 2)]", "argument 'x' is not a literal JSON value"),
        ('[get_weather("Paris")]', "tool call 1: get_weather: arguments must be passed by keyword"),
        ("[f(x={1, 2})]", "tool call 1: f: argument 'x' is not a literal JSON value"),
        ("[f(x=b'z'), g(y=1e999)]", "tool call 1: f: argument 'x' is not a literal JSON value"),
        ('[get_weather(city="Paris"', "tool call 1: not a Python call"),
    ],
    "openai": [
        (_harmony("", '{"city": "Paris"}'), "tool call 1: the recipient names no function"),
    ],
    "deepseek_v3": [
        (DS_CALLS + f"{DS_CALL}get_weather{DS_CALL_END}" + DS_CALLS_END, "tool call 1: expected type"),
        ("Let me look.\n" + DS_CALLS + "get_weather", "tool call 1: the section of calls holds no"),
    ],
    "deepseek_v31": [
        (DS_CALLS + f"{DS_CALL}get_weather{DS_CALL_END}" + DS_CALLS_END, "tool call 1: expected name"),
        (DS_CALLS + 'get_weather{"city": "Paris"}' + DS_CALLS_END, "tool call 1: the section of calls holds no"),
    ],
}

# Named calls whose arguments are not a JSON object (not JSON, cut, a list, a string): the
# answer and its calls as (name, arguments as written: a JSON value as JSON, a format's
# arguments text as it is); the error names the call.
NOT_AN_OBJECT = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>', [("get_weather", "[1, 2]")]),
        ('<tool_call>{"name": "f", "arguments": "hello"}</tool_call>', [("f", '"hello"')]),
        ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', [("f", '{"x": NaN}')]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": "[1, 2]"}', [("get_weather", '"[1, 2]"')]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]', [("get_weather", "[1]")]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"', [("get_weather", '{"city": "Paris"')]),
    ],
    "openai": [
        (_harmony("get_weather", '{"city": Paris}'), [("get_weather", '{"city": Paris}')]),
        (_harmony("get_weather", "[1, 2]"), [("get_weather", "[1, 2]")]),
        (_harmony("get_weather", '{"city": "Par'), [("get_weather", '{"city": "Par')]),
    ],
    "deepseek_v3": [
        (DS_CALLS + _ds("get_weather", '{"city": Paris}') + DS_CALLS_END, [("get_weather", '{"city": Paris}')]),
        (DS_CALLS + _ds("get_weather", "[1, 2]") + DS_CALLS_END, [("get_weather", "[1, 2]")]),
    ],
    "deepseek_v31": [
        (DS_CALLS + _ds31("get_weather", '{"city": Paris}') + DS_CALLS_END, [("get_weather", '{"city": Paris}')]),
        (DS_CALLS + _ds31("get_weather", '{"city": "Par'), [("get_weather", '{"city": "Par')]),
    ],
}

# A broken call beside good ones: the answer, the calls returned (name, arguments as JSON
# values), the content (the broken call's text among it, as written) and a piece of the error.
BESIDE_GOOD_CALLS = {
    "hermes": [
        ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"x": }}'
         '</tool_call>', [("f", {})], '<tool_call>{"name": "g", "arguments": {"x": }}</tool_call>',
         "tool call 2: the call is not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": 5}</tool_call>',
         [("f", {}), ("g", 5)], "", "tool call 2: arguments are not a JSON object"),
    ],
    "llama3_json": [
        ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": }}', [("f", {})],
         '{"name": "g", "parameters": {"x": }}', "tool call 2: the call is not valid JSON"),
        ('{"name": "f", "parameters": {}}; {"city": "Paris"}', [("f", {})], '{"city": "Paris"}',
         "tool call 2: expected"),
    ],
    "mistral": [
        ('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]get weather in Paris', [("f", {})], "[TOOL_CALLS]get weather in Paris",
         "tool call 2: expected a JSON list of calls"),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"arguments": {}}, {"name": "g", "arguments": {"x": 1}}]',
         [("f", {}), ("g", {"x": 1})], '{"arguments": {}}', "tool call 2: missing a function name"),
    ],
    "pythonic": [
        ('[f(x=1), g(cmd=__import__("os").system("ls"))]', [("f", {"x": 1})], 'g(cmd=__import__("os").system("ls"))',
         "tool call 2: g: argument 'cmd' is not a literal JSON value"),
        ("[f(x=1), 3]", [("f", {"x": 1})], "3", "tool call 2: expected a call"),
        ("[f(a='x 'y'), g(b=2)]", [], "", "tool call 1: not a Python call"),  # the quote swallows the rest
        ("[f(a='it''s'), g(b=2)]", [("f", {"a": "its"}), ("g", {"b": 2})], "", None),
    ],
    "openai": [
        (_harmony("", "{}") + "<|start|>assistant" + _harmony("f", "{}"), [("f", {})],
         "<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>",
         "tool call 1: the recipient names no function"),
    ],
    "deepseek_v3": [
        (DS_CALLS + f"{DS_CALL}get_weather{DS_CALL_END}" + _ds("f", "{}") + DS_CALLS_END, [("f", {})],
         f"{DS_CALL}get_weather{DS_CALL_END}", "tool call 1: expected type"),
    ],
}


# Answers with no call, some of them close to one.
PLAIN = [
    "The weather in Paris is sunny, 21 °C.",
    "",
    '{"name": "Alice", "age": 3}',
    '{"city": "Paris"}',
    "[1, 2, 3]",
    "Use the tool like this: get_weather(city='Paris').",
    "<|python_tag|>print(sum(range(10)))",
]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tool_tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.fixture
def tokenizer(tokenizer_folder):
    """A fresh copy of the tiny tokenizer (tests add tokens to it)."""
    return AutoTokenizer.from_pretrained(tokenizer_folder)


def _calls(result: ToolCallResult) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in result.tool_calls or []]


@pytest.mark.parametrize("case", EXPECTED)
@pytest.mark.parametrize("parser_name", ANSWERS)
def test_every_format_reads_the_same_calls(parser_name, case, tokenizer):
    text = ANSWERS[parser_name][case]
    result = tool_parser(parser_name, tokenizer).parse(text, tokenizer.encode(text, add_special_tokens=False))
    content, calls = EXPECTED[case]
    assert result.error is None, result.error
    assert (result.content, _calls(result)) == (content, calls)
    ids = TOOL_CALL_PARSERS[parser_name].call_ids
    id_pattern = re.escape(ids.prefix) + f"[{re.escape(ids.alphabet)}]{{{ids.length}}}"
    for call, (_, arguments) in zip(result.tool_calls, calls):
        assert call.type == "function" and re.fullmatch(id_pattern, call.id), call.id
        assert call.function.arguments == json.dumps(arguments, ensure_ascii=False)  # one form, unicode as is
    assert len({call.id for call in result.tool_calls}) == len(calls)


def test_the_same_call_is_the_same_function_whatever_the_format():
    functions = {name: [call.function for call in tool_parser(name, None).parse(answers["nested"], []).tool_calls]
                 for name, answers in ANSWERS.items()}
    expected = [FunctionCall(NESTED[0], json.dumps(NESTED[1], ensure_ascii=False))]
    assert functions == {name: expected for name in ANSWERS}


@pytest.mark.parametrize(("parser_name", "text", "error"),
                         [(name, text, error) for name, cases in UNREADABLE.items() for text, error in cases])
def test_a_call_that_cannot_be_read_gives_an_error_and_the_text_unchanged(parser_name, text, error, tokenizer):
    result = tool_parser(parser_name, tokenizer).parse(text, tokenizer.encode(text, add_special_tokens=False))
    assert result.content == text and result.tool_calls is None
    assert result.error is not None and error in result.error, result.error


@pytest.mark.parametrize(("parser_name", "text", "calls"),
                         [(name, text, calls) for name, cases in NOT_AN_OBJECT.items() for text, calls in cases])
def test_a_named_call_whose_arguments_are_not_an_object_is_returned_as_written_and_named(parser_name, text, calls,
                                                                                       tokenizer):
    """vLLM passes such a call on; so do we, and the error flags the row (nothing is lost,
    nothing is taken for a good call)."""
    result = tool_parser(parser_name, tokenizer).parse(text, tokenizer.encode(text, add_special_tokens=False))
    assert [(call.function.name, call.function.arguments) for call in result.tool_calls] == calls
    assert result.content == ""
    assert result.error.startswith("tool call 1: arguments are not a JSON object"), result.error


@pytest.mark.parametrize(("parser_name", "text", "calls", "content", "error"),
                         [(name, *case) for name, cases in BESIDE_GOOD_CALLS.items() for case in cases])
def test_a_broken_call_never_takes_the_good_calls_with_it(parser_name, text, calls, content, error, tokenizer):
    """One call that does not parse left the whole answer without calls; now the calls that
    parse are returned, the broken one's text stays in the content and the error names it."""
    result = tool_parser(parser_name, tokenizer).parse(text, tokenizer.encode(text, add_special_tokens=False))
    if not calls:  # nothing parses: the text as written
        assert (result.content, result.tool_calls) == (text, None) and error in result.error
        return
    assert [(call.function.name, json.loads(call.function.arguments)) for call in result.tool_calls] == calls
    assert result.content == content
    assert result.error == error if error is None else error in result.error, result.error


@pytest.mark.parametrize("text", PLAIN)
@pytest.mark.parametrize("parser_name", ANSWERS)
def test_an_answer_without_a_call_is_plain_content(parser_name, text, tokenizer):
    result = tool_parser(parser_name, tokenizer).parse(text, tokenizer.encode(text, add_special_tokens=False))
    assert result == ToolCallResult(content=text, tool_calls=None, error=None)


@pytest.mark.parametrize(("parser_name", "text"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + "[" * 5000),
    ("mistral", "[TOOL_CALLS]" + "[" * 5000),
    ("pythonic", "[f(x=" + "[" * 5000 + ")]"),
])
def test_a_model_stuck_repeating_brackets_gives_an_error(parser_name, text):
    result = tool_parser(parser_name, None).parse(text, [])
    assert result.content == text and result.tool_calls is None and result.error


def test_call_ids_are_reproducible_and_differ_between_answers(tokenizer):
    text = ANSWERS["hermes"]["several"]
    first = tool_parser("hermes", tokenizer).parse(text, [])
    again = tool_parser("hermes", None).parse(text, [])
    assert [call.id for call in first.tool_calls] == [call.id for call in again.tool_calls]
    assert first.tool_calls[0].id != first.tool_calls[1].id
    other = tool_parser("hermes", None).parse(text.replace("Paris", "Lyon"), [])
    assert other.tool_calls[0].id != first.tool_calls[0].id


def test_text_around_the_calls_is_content():
    hermes = tool_parser("hermes", None).parse('Checking.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
                                               "Done.", [])
    assert (hermes.content, _calls(hermes)) == ("Checking.\nDone.", [("f", {})])
    llama = tool_parser("llama3_json", None).parse('{"name": "f", "parameters": {}}\nThat is the call.', [])
    assert (llama.content, _calls(llama)) == ("That is the call.", [("f", {})])
    pythonic = tool_parser("pythonic", None).parse("<|python_start|>[f()]<|python_end|> Sent.", [])
    assert (pythonic.content, _calls(pythonic)) == ("Sent.", [("f", {})])


def test_an_unclosed_last_hermes_call_parses_when_its_json_is_complete():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    result = tool_parser("hermes", None).parse(text, [])
    assert (result.content, _calls(result), result.error) == ("Sure.", [WEATHER], None)


def test_arguments_given_as_a_json_string_are_read_as_their_object():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}</tool_call>'
    assert _calls(tool_parser("hermes", None).parse(text, [])) == [WEATHER]


def _with_special_tokens(tokenizer, tokens: list[str]):
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


@pytest.mark.parametrize("written", [
    'Let me check the weather.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    'Let me check the weather.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
], ids=["pre_v11", "v11"])
def test_mistral_finds_its_special_markers_through_the_token_ids(written, tokenizer):
    tokenizer = _with_special_tokens(tokenizer, ["[TOOL_CALLS]", "[ARGS]"])
    token_ids = tokenizer.encode(written, add_special_tokens=False) + [tokenizer.eos_token_id]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "[TOOL_CALLS]" not in text and "[ARGS]" not in text
    parser = tool_parser("mistral", tokenizer)
    result = parser.parse(text, token_ids)
    assert (result.content, _calls(result), result.error) == ("Let me check the weather.", [WEATHER], None)
    assert parser.parse(text, []) == ToolCallResult(text, None, None)  # without its tokens the marker is unseen


def test_a_broken_call_behind_a_hidden_marker_keeps_the_text_with_its_markers(tokenizer):
    """The user's text lacks the special markers; a call that cannot be read keeps them in
    the content, so that what the model wrote can be read (`get weather` alone hides the
    call), beside the calls that parse too; a cut call is returned, its arguments as written."""
    tokenizer = _with_special_tokens(tokenizer, ["[TOOL_CALLS]", "[ARGS]"])
    for written, content, calls in [
            ("Checking.[TOOL_CALLS] get weather in Paris", "Checking.[TOOL_CALLS] get weather in Paris", None),
            ("Checking.[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS] get weather", "Checking.\n[TOOL_CALLS] get weather",
             [("f", "{}")]),
            ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "Checking.", [("get_weather", '{"city": "Par')])]:
        token_ids = tokenizer.encode(written, add_special_tokens=False)
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        result = tool_parser("mistral", tokenizer).parse(text, token_ids)
        assert result.content == content and result.error.startswith("tool call "), result
        assert calls == (result.tool_calls and [(call.function.name, call.function.arguments)
                                                for call in result.tool_calls])


def test_mistral_call_ids_are_nine_alphanumerics_derived_from_the_output(tokenizer):
    """Mistral's chat templates take back only 9-character alphanumeric ids (vLLM makes
    those); OpenAI's `call_...` ids broke a conversation fed back. The same output still
    gives the same ids."""
    text = ANSWERS["mistral"]["several"]
    first = tool_parser("mistral", tokenizer).parse(text, [])
    again = tool_parser("mistral", None).parse(text, [])
    ids = [call.id for call in first.tool_calls]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", call_id) for call_id in ids), ids
    assert ids == [call.id for call in again.tool_calls] and len(set(ids)) == 2
    other = tool_parser("mistral", None).parse(text.replace("Paris", "Lyon"), [])
    assert other.tool_calls[0].id != ids[0]


@pytest.mark.parametrize("parser_name", ["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize("text", [
    "Let me look that up." + DS_CALLS + "get_weather",
    DS_CALLS + 'foo' + DS_SEP + '{"x":1}' + DS_CALLS_END,
], ids=["cut_off", "no_call_markers"])
def test_a_deepseek_section_without_a_call_keeps_the_text_and_says_why(parser_name, text):
    """A section of calls that holds no call that parses was cut from the text silently."""
    result = tool_parser(parser_name, None).parse(text, [])
    assert result.content == text and result.tool_calls is None
    assert result.error.startswith("tool call 1: the section of calls holds no")


def test_a_marker_kept_in_the_text_is_read_from_the_text(tokenizer):
    """Qwen's `<tool_call>` is an added token that decoding keeps: the text has it already."""
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    text = ANSWERS["hermes"]["content_before"]
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == text
    result = tool_parser("hermes", tokenizer).parse(text, token_ids)
    assert (result.content, _calls(result)) == EXPECTED["content_before"]


def _template_with(tokenizer, template: str):
    tokenizer.chat_template = template
    return tokenizer


def _with_deepseek_markers(tokenizer):
    """DeepSeek's call markers, plain added tokens of its tokenizers (kept in decoded text)."""
    tokenizer.add_tokens([DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP])
    return tokenizer


# How each chat template writes an earlier call (the part of DeepSeek's templates that differs).
DEEPSEEK_V3_TEMPLATE = ("{% for tool in message['tool_calls'] %}{{'<｜tool▁call▁begin｜>' + tool['type'] + "
                        "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
                        "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{% endfor %}")
DEEPSEEK_V31_TEMPLATE = ("{% if not thinking %}</think>{% endif %}{% for tool in message['tool_calls'] %}"
                         "{{'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + "
                         "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{% endfor %}")


@pytest.mark.parametrize(("change", "expected"), [
    (lambda tok: tok, None),
    (lambda tok: tok.add_tokens(["<tool_call>", "</tool_call>"]) and tok, "hermes"),
    (lambda tok: tok.add_tokens(["<tool_call>"]) and tok, None),
    (lambda tok: _with_special_tokens(tok, ["[TOOL_CALLS]", "[ARGS]"]), "mistral"),
    (lambda tok: _template_with(_with_special_tokens(tok, ["<|python_tag|>"]),
                                "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"), "llama3_json"),
    (lambda tok: _template_with(_with_special_tokens(tok, ["<|python_tag|>"]), "{{ messages }}"), None),
    (lambda tok: _with_special_tokens(tok, [DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP]), "deepseek_v3"),
    (lambda tok: _template_with(_with_deepseek_markers(tok), DEEPSEEK_V3_TEMPLATE), "deepseek_v3"),
    (lambda tok: _template_with(_with_deepseek_markers(tok), DEEPSEEK_V31_TEMPLATE), "deepseek_v31"),
    (lambda tok: _with_special_tokens(tok, ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>"]),
     "openai"),
    (lambda tok: _with_special_tokens(tok, ["<|start|>", "<|channel|>", "<|message|>", "<|call|>"]), None),
], ids=["plain", "hermes", "half_hermes", "mistral", "llama3_json", "python_tag_without_tools", "deepseek_v3",
        "deepseek_v3_template", "deepseek_v31_template", "harmony", "harmony_without_constrain"])
def test_detect_tool_parser_reads_the_marker_tokens(change, expected, tokenizer):
    assert detect_tool_parser(change(tokenizer)) == expected


def test_parsers_by_name(tokenizer):
    assert {"deepseek_v3", "deepseek_v31", "hermes", "llama3_json", "mistral", "openai", "pythonic"} \
        <= set(TOOL_CALL_PARSERS)
    assert all(tool_parser(name, tokenizer).name == name for name in TOOL_CALL_PARSERS)
    with pytest.raises(ValueError, match=r"tool_call_parser='nope' is not one of \['deepseek_v3', 'deepseek_v31', "):
        tool_parser("nope", tokenizer)


def test_importing_the_parsers_loads_no_model_code():
    loaded = subprocess.run(
        [sys.executable, "-c",
         "import sys, engine.tool_parsers; print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
