"""vLLM's tests/tool_parsers/test_hermes_tool_parser.py (Qwen3's tokenizer, its `<tool_call>`
markers plain added tokens). vLLM's streaming tests at several stream intervals check the
final call of the same output: each output is one case here (the engine's path is token
by token for all of them)."""

import json

from tests.parser_conformance import Case

SOURCE = "tests/tool_parsers/test_hermes_tool_parser.py"
TRIGGER = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
BARE_STRING = '<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>'


def _case(name: str, output: str, expected: dict, **kwargs) -> Case:
    return Case(f"hermes-{name}", f"{SOURCE}::{name}", "qwen3", output, expected, tools="hermes", **kwargs)


def _string_arguments(name: str, function: str, arguments: str) -> Case:
    """A call whose "arguments" is a JSON string: vLLM reads a string holding a JSON object as
    that object and passes any other string on as a JSON string (ours too, the call named in
    tool_call_error: its arguments are not an object)."""
    output = "<tool_call>" + json.dumps({"name": function, "arguments": arguments}) + "</tool_call>"
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return _case(name, output, {"tool_calls": [(function, value)]})
    return _case(name, output, {"tool_calls": [(function, arguments)], "arguments_text": [json.dumps(arguments)]})


CASES = [
    _case("streaming_just_forward_text", "This is some prior text that has nothing to do with tool calling.",
          {"content": "This is some prior text that has nothing to do with tool calling.", "tool_calls": None}),
    # ::test_hermes_parser_streaming_failure_case_bug_19056 and
    # ::test_hermes_streaming_boolean_args_with_stream_interval stream the same output and expect the same call.
    _case("non_streaming_tool_call_between_tags", TRIGGER,
          {"tool_calls": [("final_answer", {"trigger": True})], "arguments_text": ['{"trigger": true}']}),
    _case("streaming", '<tool_call>{"name": "get_current_temperature","arguments": {"location":"San Francisco, '
                       'California, United States", "unit": "celsius"}}</tool_call>',
          {"tool_calls": [("get_current_temperature",
                           {"location": "San Francisco, California, United States", "unit": "celsius"})]}),
    _case("streaming_tool_call_with_stream_interval",
          '<tool_call>{"name": "get_current_temperature", "arguments": {"location": "San Francisco", '
          '"unit": "celsius"}}</tool_call>',
          {"tool_calls": [("get_current_temperature", {"location": "San Francisco", "unit": "celsius"})]}),
    _case("streaming_content_then_tool_call_with_stream_interval",
          'Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}</tool_call>',
          {"content": "Sure, let me check the weather.", "tool_calls": [("get_weather", {"city": "NYC"})]}),
    _case("streaming_multiple_tool_calls_with_stream_interval",
          '<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
          '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>',
          {"tool_calls": [("search", {"q": "cats"}), ("search", {"q": "dogs"})]}),
    _case("streaming_just_forward_text_with_stream_interval", "This is plain text with no tool calling involved.",
          {"content": "This is plain text with no tool calling involved.", "tool_calls": None}),
    _case("non_streaming_no_tool_call", "This is not a tool call.", {"tool_calls": None}),
    _case("non_streaming_tool_call_until_eos", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
          {"tool_calls": [("final_answer", {"trigger": True})], "arguments_text": ['{"trigger": true}']}),
    _case("non_streaming_tool_call_invalid_json",
          '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
          {"tool_calls": None}),
    _case("non_streaming_serialized_arguments",
          '<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>',
          {"tool_calls": [("get_db_config", {"param": "max_connections"})]}),
    _case("streaming_serialized_arguments_with_stream_interval",
          '<tool_call>{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}</tool_call>',
          {"tool_calls": [("get_db_config", {"param": "max_connections"})]}),
    _case("non_streaming_bare_string_arguments", BARE_STRING,
          {"tool_calls": [("do_thing", "hello")], "arguments_text": ['"hello"']}),
    _string_arguments("streaming_string_arguments_match_non_streaming[object]", "f", '{"param": "max_connections"}'),
    _string_arguments("streaming_string_arguments_match_non_streaming[hello]", "f", "hello"),
    _string_arguments("streaming_string_arguments_match_non_streaming[braces]", "f", "{hello world}"),
    _string_arguments("streaming_string_arguments_match_non_streaming[open_bracket]", "f", "[oops"),
    _string_arguments("streaming_string_arguments_match_non_streaming[tail_text]", "f", '{"a": 1} tail text'),
    _case("streaming_content_and_tool_call_in_single_chunk",
          'Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
          {"content": "Hi!", "tool_calls": [("f", {"x": 1})]}),
]
