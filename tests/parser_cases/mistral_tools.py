"""vLLM's tests/tool_parsers/test_mistral_tool_parser.py: Mistral-7B-Instruct-v0.3's tokenizer
(before v11: `[TOOL_CALLS]` then a JSON list of calls) and Mistral-Small-3.2's (v11 and
later: `[TOOL_CALLS]name{...}`, the `[ARGS]` marker a decoded text lacks, or
`[TOOL_CALLS]name[ARGS]{...}` as the tokenizer writes it); the markers are control tokens.
vLLM's tests compare the arguments' text (json.dumps of the expected object); ours is the
same text. The ids (9 alphanumerics in vLLM's tests) are tests/engine/test_tool_parsers.py's."""

import json

from tests.parser_conformance import Case

SOURCE = "tests/tool_parsers/test_mistral_tool_parser.py"
ADD = ("add", {"a": 3.5, "b": 4})
WEATHER = ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})
DALLAS = ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})
BASH = ("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})
BASH_OUTPUT = 'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}'


def _case(name: str, output: str, calls: list[tuple[str, object]] | None, content: str | None, **kwargs) -> Case:
    """`calls`: (name, arguments as a JSON object, or as the text vLLM passes on where it is none)."""
    expected = {"tool_calls": calls, "content": content}
    if calls:
        expected["arguments_text"] = [arguments if isinstance(arguments, str) else json.dumps(arguments)
                                      for _, arguments in calls]
    return Case(f"mistral-{name}", f"{SOURCE}::{name}", "mistral", output, expected, tools="mistral", **kwargs)


def _unreadable(name: str, output: str, content: str | None) -> Case:
    """An output whose call cannot be read: vLLM drops it (or its marker) silently, ours keeps
    the text as written (markers written back) and names the call in tool_call_error."""
    return Case(f"mistral-{name}", f"{SOURCE}::{name}", "mistral", output, {"tool_calls": None, "content": content},
                tools="mistral", difference="broken_call_flagged", ours={"content": output, "error": True})


CASES = [
    _case("extract_tool_calls_no_tools", "This is a test", None, "This is a test"),
    # ::test_extract_tool_calls_pre_v11_tokenizer
    _case("pre_v11-single_tool_add", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', [ADD], None),
    _case("pre_v11-single_tool_weather", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": '
          '"San Francisco", "state": "CA", "unit": "celsius"}}]', [WEATHER], None),
    _case("pre_v11-argument_before_name", '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", '
          '"unit": "celsius"}, "name": "get_current_weather"}]', [WEATHER], None),
    _case("pre_v11-argument_before_name_and_name_in_argument",
          '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', [("get_age", {"name": "John Doe"})],
          None),
    _case("pre_v11-multiple_tools", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": '
          '"get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]',
          [ADD, WEATHER], None),
    _case("pre_v11-content_before_tool", 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
          [("add", {"a": 1, "b": 2})], "Hello"),
    # vLLM's streaming test of the same output keeps the trailing text ("\nextra trailing data").
    _case("pre_v11-trailing_data_after_json", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": '
          '"Dallas", "state": "TX", "unit": "fahrenheit"}}]\nextra trailing data', [DALLAS], None,
          difference="content_around_calls", ours={"content": "extra trailing data"}),
    _case("extract_tool_calls_pre_v11_regex_fallback",
          '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail', [("add", {"a": 1, "b": 2})],
          None, difference="content_around_calls", ours={"content": "junk\ntrail"}),
    _unreadable("extract_tool_calls_pre_v11_regex_fallback_fails", "[TOOL_CALLS] not json at all", "not json at all"),
    # ::test_extract_tool_calls (v11)
    _case("v11-single_tool_add", '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}',
          [("add_this_and_that", {"a": 3.5, "b": 4})], None),
    _case("v11-single_tool_weather", '[TOOL_CALLS]get_current_weather{"city": "San Francisco", "state": "CA", '
          '"unit": "celsius"}', [WEATHER], None),
    _case("v11-multiple_tool_calls", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}',
          [ADD, ("multiply", {"a": 3, "b": 6})], None),
    # The model stopped inside the arguments: the cut JSON text is passed on as the arguments (and named in
    # tool_call_error: not an object). vLLM's test and its expected text both end before the string's quote.
    _case("v11-complex", BASH_OUTPUT[:-2], [("bash", json.dumps(BASH[1])[:-2])], "hi{hi"),
    _case("v11-wrong_json", BASH_OUTPUT, [BASH], "hi{hi"),
    _unreadable("extract_tool_calls_v11_without_args_skipped", "[TOOL_CALLS]toolname_no_args", None),
    # ::test_extract_tool_calls_streaming_pre_v11_tokenizer
    _case("streaming_pre_v11-single_tool_add", '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
          [("add", {"a": 3, "b": 4})], ""),
    _case("streaming_pre_v11-single_tool_add_strings", '[TOOL_CALLS] [{"name": "add", "arguments":{"a": "3", '
          '"b": "4"}}]', [("add", {"a": "3", "b": "4"})], ""),
    # ::test_extract_tool_calls_streaming (v11: the tokenizer writes [ARGS])
    _case("streaming_v11-single_tool_add", '[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}', [("add", {"a": 3, "b": 4})], ""),
    _case("streaming_v11-single_tool_add_strings", '[TOOL_CALLS]add_two_strings[ARGS]{"a": "3", "b": "4"}',
          [("add_two_strings", {"a": "3", "b": "4"})], ""),
    _case("streaming_v11-multiple_tools", '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]get_current_weather'
          '[ARGS]{"city": "San Francisco", "state": "CA", "unit": "celsius"}', [ADD, WEATHER], ""),
    # ::test_extract_tool_calls_streaming_one_chunk
    _case("one_chunk-v11-content_before_tool", 'bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}',
          [("add_this_and_that", {"a": 3.5, "b": 4})], "bla"),
    _case("one_chunk-pre_v11-multiple_tools", '[TOOL_CALLS] [{"arguments": {"a": 3.5, "b": 4}, "name": "add"}, '
          '{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, "name": "get_current_weather"}]',
          [ADD, WEATHER], ""),
    _case("one_chunk-pre_v11-content_before_tool", 'Some text[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, '
          '"b": 2}}]', [("add", {"a": 1, "b": 2})], "Some text"),
    # ::test_fast_detokenization_text_detection (its content "Hello" streamed before the marker)
    _case("fast_detokenization_text_detection[v11]", 'Hello[TOOL_CALLS]add{"a": 1, "b": 2}',
          [("add", {"a": 1, "b": 2})], "Hello"),
    _case("fast_detokenization_text_detection[pre_v11]", '[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, '
          '"b": 2}}]', [("add", {"a": 1, "b": 2})], None),
]
