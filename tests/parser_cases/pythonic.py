"""vLLM's tests/tool_parsers/test_pythonic_tool_parser.py (a tokenizer without markers) and
test_llama4_pythonic_tool_parser.py (vLLM's `llama4_pythonic`; Llama 4's tokenizer, its
`<|python_start|>` and `<|python_end|>` special tokens): both formats are our `pythonic`.
vLLM's tests compare the arguments' text; ours is the same. Streaming and non-streaming
variants of one output are one case; the Llama 4 file's outputs that the first file already
has are not repeated."""

import json

from tests.parser_conformance import Case

PYTHONIC = "tests/tool_parsers/test_pythonic_tool_parser.py"
LLAMA4 = "tests/tool_parsers/test_llama4_pythonic_tool_parser.py"

WEATHER = ("get_weather", '{"city": "San Francisco", "metric": "celsius"}')
WEATHER_OUTPUT = "get_weather(city='San Francisco', metric='celsius')"
MORE_TYPES = ("register_user", '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, '
                               '"role": null, "passed_test": true, "aliases": ["John", "Johnny"]}')
MORE_TYPES_OUTPUT = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
                     "role=None, passed_test=True, aliases=['John', 'Johnny'])")
PARAMETERLESS = ("get_weather", "{}")
EMPTY_LIST = ("do_something_cool", '{"steps": []}')
LA = ("get_weather", '{"city": "LA", "metric": "C"}')
DOE = ("register_user", '{"name": "Doe", "age": 9}')


def _new(source: str, name: str, output: str, expected: dict, **kwargs) -> Case:
    prefix, family = ("llama4_pythonic", "llama4") if source == LLAMA4 else ("pythonic", "plain")
    return Case(f"{prefix}-{name}", f"{source}::{name}", family, output, expected, tools="pythonic", **kwargs)


def _case(source: str, name: str, output: str, calls: list[tuple[str, str]] | None, **content: str | None) -> Case:
    """`calls` as vLLM's tests write them, (name, arguments text); `content` where the test checks it."""
    expected = {"tool_calls": [(function, json.loads(text)) for function, text in calls] if calls else None,
                **content}
    if calls:
        expected["arguments_text"] = [text for _, text in calls]
    return _new(source, name, output, expected)


def _tool_call(name: str, output: str, calls: list[tuple[str, str]]) -> Case:
    """test_pythonic_tool_parser.py::test_tool_call: the calls, and no content."""
    return _case(PYTHONIC, f"tool_call[{name}]", output, calls, content=None)


def _salvaged(source: str, name: str, output: str, kept: tuple[str, str]) -> Case:
    """A block with one call that cannot be read beside a good one: the good one is returned
    (the other stays in the content, named in tool_call_error, where vLLM drops it)."""
    return _new(source, name, output, {"tool_calls": [(kept[0], json.loads(kept[1]))]})


CASES = [
    _case(PYTHONIC, "no_tool_call", "How can I help you today?", None,
          content="How can I help you today?"),
    _tool_call("simple", f"[{WEATHER_OUTPUT}]", [WEATHER]),
    _tool_call("more_types", f"[{MORE_TYPES_OUTPUT}]", [MORE_TYPES]),
    _tool_call("parameterless", "[get_weather()]", [PARAMETERLESS]),
    _tool_call("empty_dict", "[do_something_cool(additional_data={})]",
          [("do_something_cool", '{"additional_data": {}}')]),
    _tool_call("empty_list", "[do_something_cool(steps=[])]", [EMPTY_LIST]),
    _tool_call("escaped_string", r"""[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]""",
          [("get_weather", '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}')]),
    _tool_call("parallel_calls", f"[{WEATHER_OUTPUT}, {MORE_TYPES_OUTPUT}]", [WEATHER, MORE_TYPES]),
    _case(PYTHONIC, "streaming_tool_call_with_large_steps",
          f"[{WEATHER_OUTPUT}, get_weather(), do_something_cool(steps=[])]", [WEATHER, PARAMETERLESS, EMPTY_LIST],
          content=""),
    _salvaged(PYTHONIC, "bad_sibling_call_does_not_drop_good_calls", f"[bad(x=b'z'), {WEATHER_OUTPUT}]", WEATHER),
    _salvaged(PYTHONIC, "non_finite_argument_rejected", f"[calc(x=1e999), {WEATHER_OUTPUT}]", WEATHER),
    _salvaged(PYTHONIC, "good_call_survives_unparsable_sibling", f"[{WEATHER_OUTPUT}, f(a='x 'y', b='z')]", WEATHER),
    _case(PYTHONIC, "unrecoverable_block_still_reports_no_tool_call", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", None,
          content="[f(a='x 'y' 'z), g(b='p 'q' 'r)]"),
    _case(PYTHONIC, "streaming_mismatched_brackets_reported_once", "[foo(x=1])]", None),
    _case(LLAMA4, "tool_call[simple]", "[get_weather(city='LA', metric='C')]", [LA]),
    _case(LLAMA4, "tool_call[more_types]", "[register_user(name='Doe', age=9, address={'city': 'LA', 'state': 'CA'}, "
                                           "role=None, passed_test=True, aliases=['John', 'Johnny'])]",
          [("register_user", '{"name": "Doe", "age": 9, "address": {"city": "LA", "state": "CA"}, "role": null, '
                             '"passed_test": true, "aliases": ["John", "Johnny"]}')]),
    _case(LLAMA4, "tool_call[parallel_calls]", "[get_weather(city='LA',metric='C'),register_user(name='Doe',age=9)]",
          [LA, DOE]),
    _case(LLAMA4, "tool_call[python_tag]", "<|python_start|>[get_weather(city='LA', metric='C')]<|python_end|>", [LA]),
    _case(LLAMA4, "tool_call[parallel_calls_python_start_streaming]",
          "<|python_start|>[get_weather(city='LA', metric='C'),register_user(name='Doe', age=9)]", [LA, DOE]),
    _case(LLAMA4, "tool_call[parallel_calls_python_start]",
          "<|python_start|>[get_weather(city='LA', metric='C'), register_user(name='Doe', age=9)]", [LA, DOE]),
    _case(LLAMA4, "streaming_tool_call_with_large_steps",
          "<|python_start|>[get_weather(city='LA', metric='C'), get_weather(), do_something_cool(steps=[])]"
          "<|python_end|>", [LA, PARAMETERLESS, EMPTY_LIST], content=""),
    _salvaged(LLAMA4, "bad_sibling_call_does_not_drop_good_calls",
              "<|python_start|>[bad(x=b'z'), get_weather(city='LA', metric='C')]<|python_end|>", LA),
    _salvaged(LLAMA4, "non_finite_argument_rejected",
              "<|python_start|>[calc(x=1e999), get_weather(city='LA', metric='C')]<|python_end|>", LA),
    _case(LLAMA4, "streaming_mismatched_brackets_reported_once", "<|python_start|>[foo(x=1])]<|python_end|>", None),
]
