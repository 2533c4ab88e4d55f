"""vLLM's tests/tool_parsers/test_deepseekv3_tool_parser.py: the configuration of its common
tool-parser tests (tests/tool_parsers/common_tests.py) for DeepSeek-V3's tokenizer, whose call
markers are plain added tokens. The common tests check the calls (names, and arguments by
JSON value), and that a malformed output is handled without an exception."""

from tests.parser_conformance import Case

SOURCE = "tests/tool_parsers/test_deepseekv3_tool_parser.py::TestDeepSeekV3ToolParser"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def _call(name: str, arguments: str) -> str:
    """One call as DeepSeek-V3 writes it, its arguments in a JSON code fence."""
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


def _case(name: str, output: str, expected: dict) -> Case:
    return Case(f"deepseek_v3-{name}", f"{SOURCE}::{name}", "deepseek_v3", output, expected, tools="deepseek_v3")


CASES = [
    _case("test_no_tool_calls", "How can I help you today? I can check weather for you.",
          {"content": "How can I help you today? I can check weather for you.", "tool_calls": None}),
    _case("test_single_tool_call_simple_args",
          CALLS_BEGIN + _call("get_weather", '{"city": "Tokyo", "unit": "celsius"}') + CALLS_END,
          {"tool_calls": [("get_weather", {"city": "Tokyo", "unit": "celsius"})]}),
    _case("test_parallel_tool_calls",
          CALLS_BEGIN + _call("get_weather", '{"city": "Tokyo", "unit": "celsius"}')
          + _call("search_hotels", '{"location": "Tokyo", "check_in": "2025-01-15"}') + CALLS_END,
          {"tool_calls": [("get_weather", {"city": "Tokyo", "unit": "celsius"}),
                          ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})]}),
    _case("test_various_data_types",
          CALLS_BEGIN + _call("test_function", '{"string_field": "hello", "int_field": 42, "float_field": 3.14, '
                                               '"bool_field": true, "null_field": null, '
                                               '"array_field": ["a", "b", "c"], "object_field": {"nested": "value"}, '
                                               '"empty_array": [], "empty_object": {}}') + CALLS_END,
          {"tool_calls": [("test_function", {"string_field": "hello", "int_field": 42, "float_field": 3.14,
                                             "bool_field": True, "null_field": None, "array_field": ["a", "b", "c"],
                                             "object_field": {"nested": "value"}, "empty_array": [],
                                             "empty_object": {}})]}),
    _case("test_empty_arguments", CALLS_BEGIN + _call("get_current_time", "{}") + CALLS_END,
          {"tool_calls": [("get_current_time", {})], "arguments_text": ["{}"]}),
    _case("test_surrounding_text",
          "Let me check the weather for you." + CALLS_BEGIN + _call("get_weather", '{"city": "Paris"}') + CALLS_END,
          {"tool_calls": [("get_weather", {"city": "Paris"})]}),
    _case("test_escaped_strings",
          CALLS_BEGIN + _call("send_message", '{"text": "He said \\"hello\\"", "path": "C:\\\\Users\\\\file", '
                                              '"newline": "line1\\nline2"}') + CALLS_END,
          {"tool_calls": [("send_message", {"text": 'He said "hello"', "path": "C:\\Users\\file",
                                            "newline": "line1\nline2"})]}),
    # test_malformed_input's outputs, which vLLM's common test only asks to be read without an exception.
    # A call cut inside its arguments: vLLM's parser passes the arguments on as written (its pattern does not
    # read the JSON), as ours does (and names the call in tool_call_error).
    _case("test_malformed_input[unclosed_arguments]",
          CALLS_BEGIN + _call("get_weather", '{"city": "Tokyo"') + CALLS_END,
          {"tool_calls": [("get_weather", '{"city": "Tokyo"')], "content": None}),
    # No call markers in the section: no call, and (as vLLM's V3.1 test asks of the same shape) the text
    # kept whole.
    _case("test_malformed_input[no_call_markers]",
          CALLS_BEGIN + 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Tokyo"}\n```' + CALLS_END,
          {"tool_calls": None,
           "content": CALLS_BEGIN + 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Tokyo"}\n```' + CALLS_END}),
]
