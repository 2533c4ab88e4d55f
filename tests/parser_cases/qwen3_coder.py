"""vLLM's tests/tool_parsers/test_qwen3coder_tool_parser.py and the cases of
tests/tool_parsers/test_qwen3_xml_coder_shared.py that hold for its qwen3_coder parser.

A streaming test whose whole output is another case's output is that case (one case here);
where vLLM's test checks less than the whole result (the name of a call, `in` on the
content), the case states the result vLLM's parser gives (its calls) or what the test checks
(`Contains`). The parser is built with the file's two sample tools unless a test gives its own.
"""

from typing import Any

from tests.parser_conformance import Case, Contains

CODER = "tests/tool_parsers/test_qwen3coder_tool_parser.py"
SHARED = "tests/tool_parsers/test_qwen3_xml_coder_shared.py"


def _tool(name: str, properties: dict[str, Any], **schema: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object",
                                                                          "properties": properties, **schema}}}


SAMPLE_TOOLS = [
    _tool("get_current_weather", {"city": {"type": "string", "description": "The city name"},
                                  "state": {"type": "string", "description": "The state code"},
                                  "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}},
          required=["city", "state"]),
    _tool("calculate_area", {"shape": {"type": "string"}, "dimensions": {"type": "object"},
                             "precision": {"type": "integer"}}),
]
TYPES_TOOLS = [_tool("test_types", {"int_param": {"type": "integer"}, "float_param": {"type": "float"},
                                    "bool_param": {"type": "boolean"}, "str_param": {"type": "string"},
                                    "obj_param": {"type": "object"}})]
WRITE_FILE_TOOLS = [_tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"}})]
WEATHER_TOOLS = [_tool("get_weather", {"city": {"type": "string"}})]
UPDATE_RECORD_TOOLS = [_tool("update_record", {"data": {"anyOf": [{"type": "object"}, {"type": "null"}]}})]


def _case(name: str, source: str, output: str, calls: list[tuple[str, Any]] | None,
          tools: list[dict[str, Any]] | None = None, **expected: Any) -> Case:
    """A case whose test checks the calls and, where it gives `content=`, the content."""
    return Case(f"qwen3_coder-{name}", f"{source}::{name}", "qwen3", output, {"tool_calls": calls, **expected},
                tools="qwen3_coder", request_tools=SAMPLE_TOOLS if tools is None else tools)


def _call(function: str, *parameters: tuple[str, str]) -> str:
    """A call as Qwen3-Coder writes it, each value on lines of its own."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


DALLAS = ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})
DALLAS_CALL = _call("get_current_weather", ("city", "Dallas"), ("state", "TX"), ("unit", "fahrenheit"))
RECTANGLE_CALL = _call("calculate_area", ("shape", "rectangle"), ("dimensions", '{"width": 10, \n "height": 20}'),
                       ("precision", "2"))
CIRCLE_CALL = _call("calculate_area", ("shape", "circle"), ("dimensions", '{"radius": 15.5}'), ("precision", "3"))
DALLAS_UNCLOSED_CITY = ("Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n"
                        "<parameter=city>\nDallas\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\n"
                        "fahrenheit\n</parameter>\n</function>\n</tool_call>")

# Values that hold the format's own tags as text (shared file).
XML_TAGS_IN_CONTENT = ('char_deltas = [\n    "<tool_call>\\n",\n    "<parameter=query>\\n",\n'
                       '    "\\n</parameter>\\n",\n    "</function>\\n",\n]\n')
PARAM_LIKE_LINES = ('TOOL_CALL_TEMPLATE = """\n</parameter>\n<parameter=new_string>\n#!/usr/bin/env python3\n'
                    '</parameter>\n"""\n')
REAL_PARAM_NAME_LITERAL = 'doc = """\n<parameter=path>\nliteral/value\n</parameter>\n"""\n'
FULL_NESTED_CALL = ('doc = """\n<tool_call>\n<function=write_file>\n<parameter=path>\nliteral/value.txt\n'
                    '</parameter>\n<parameter=content>\nhello\n</parameter>\n</function>\n</tool_call>\n"""\n')
OUT_OF_SCHEMA_NESTED = ('template = """\n<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n'
                        '</function>\n</tool_call>\n"""\n')


def _write_file(path: str, content: str) -> str:
    return (f"<tool_call>\n<function=write_file>\n<parameter=path>\n{path}\n</parameter>\n"
            f"<parameter=content>\n{content}</parameter>\n</function>\n</tool_call>")


def _inline(function: str, *parameters: tuple[str, str]) -> str:
    """A call with each value on the line of its tags."""
    body = "".join(f"<parameter={key}>{value}</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


TWO_WEATHER_CALLS = (_call("get_weather", ("city", "Paris")) + "\n" + _call("get_weather", ("city", "London")))

CASES = [
    # test_qwen3coder_tool_parser.py
    _case("no_tools", CODER, "This is a test response without any tool calls", None,
          content="This is a test response without any tool calls"),
    _case("single_tool", CODER, DALLAS_CALL, [DALLAS], content=None),
    _case("single_tool_with_content", CODER, "Sure! Let me check the weather for you." + DALLAS_CALL, [DALLAS],
          content="Sure! Let me check the weather for you."),
    _case("single_tool_multiline_param", CODER, RECTANGLE_CALL,
          [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})],
          content=None),
    _case("parallel_tools", CODER,
          DALLAS_CALL + "\n" + _call("get_current_weather", ("city", "Orlando"), ("state", "FL"),
                                     ("unit", "fahrenheit")),
          [DALLAS, ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"})], content=None),
    _case("tool_with_typed_params", CODER, "Let me calculate that area for you." + CIRCLE_CALL,
          [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})],
          content="Let me calculate that area for you."),
    _case("streaming_no_tools", CODER, "This is a test without tools", None,
          content="This is a test without tools"),
    _case("streaming_parallel_tools", CODER,
          DALLAS_CALL + "\n" + _call("get_current_weather", ("city", "Orlando"), ("state", "FL"), ("unit", "celsius")),
          [DALLAS, ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "celsius"})], content=None),
    _case("fallback_no_tags", CODER,
          "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n"
          "</parameter>\n</function>", [("get_current_weather", {"city": "Dallas", "state": "TX"})]),
    _case("type_conversion", CODER,
          _call("test_types", ("int_param", "42"), ("float_param", "3.14"), ("bool_param", "true"),
                ("str_param", "hello world"), ("obj_param", '{"key": "value"}')),
          [("test_types", {"int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
                           "obj_param": {"key": "value"}})], tools=TYPES_TOOLS),
    _case("anyof_type_conversion", CODER,
          _call("test_anyof", ("anyof_int", "5"), ("anyof_str", "hello"), ("anyof_array", '["a", "b", "c"]'),
                ("anyof_obj", '{"key": "value"}'), ("type_as_array", "42"), ("multi_non_null", "some text")),
          [("test_anyof", {"anyof_int": 5, "anyof_str": "hello", "anyof_array": ["a", "b", "c"],
                           "anyof_obj": {"key": "value"}, "type_as_array": 42, "multi_non_null": "some text"})],
          tools=[_tool("test_anyof", {
              "anyof_int": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
              "anyof_str": {"anyOf": [{"type": "string"}, {"type": "null"}]},
              "anyof_array": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
              "anyof_obj": {"anyOf": [{"type": "object"}, {"type": "null"}]},
              "type_as_array": {"type": ["integer", "null"]},
              "multi_non_null": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}})]),
    _case("anyof_type_conversion_streaming", CODER,
          _call("search_web", ("query", "vllm tool parser"), ("count", "10"), ("verbose", "true")),
          [("search_web", {"query": "vllm tool parser", "count": 10, "verbose": True})],
          tools=[_tool("search_web", {"query": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                      "count": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
                                      "verbose": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}})]),
    _case("missing_closing_parameter_tag", CODER, DALLAS_UNCLOSED_CITY, [DALLAS],
          content=Contains("Let me check the weather for you:")),
    _case("streaming_incremental", CODER,
          "I'll check the weather." + _call("get_current_weather", ("city", "Dallas"), ("state", "TX")),
          [("get_current_weather", {"city": "Dallas", "state": "TX"})], content="I'll check the weather."),
    _case("streaming_missing_opening_tag", CODER,
          "I'll check the weather for you.\n\n" + DALLAS_CALL.removeprefix("<tool_call>\n"), [DALLAS],
          content=Contains("I'll check the weather for you.")),
    _case("malformed_xml_no_gt_delimiter", CODER,
          "<tool_call>\n<function=get_current_weather\n<parameter=city>Dallas</parameter>\n</function>\n</tool_call>",
          None),
    _case("none_tool_calls_filtered", CODER,
          "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n"
          + _inline("get_current_weather", ("city", "Dallas"), ("state", "TX")),
          [("get_current_weather", {"city": "Dallas", "state": "TX"})]),
    _case("anyof_parameter_not_double_encoded", CODER,
          _inline("update_record", ("data", '{"key": "value", "count": 42}')),
          [("update_record", {"data": {"key": "value", "count": 42}})], tools=UPDATE_RECORD_TOOLS),
    _case("no_double_serialization_string_args", CODER, _inline("greet", ("message", "hello world")),
          [("greet", {"message": "hello world"})], tools=[_tool("greet", {"message": {"type": "string"}})]),
    # test_qwen3_xml_coder_shared.py
    _case("complex_type_with_single_quote", SHARED, _call("test_types", ("obj_param", "{'key': 'value'}")),
          [("test_types", {"obj_param": {"key": "value"}})], tools=TYPES_TOOLS),
    _case("streaming_speculative_decode_loss", SHARED, _call("test", ("city", "Paris")), [("test", {"city": "Paris"})]),
    _case("string_null_value_preserved", SHARED, _inline("search", ("query", "null")), [("search", {"query": "null"})],
          tools=[_tool("search", {"query": {"type": "string"}})]),
    _case("anyof_string_null_keeps_value_as_string", SHARED, _inline("set_code", ("code", "42")),
          [("set_code", {"code": "42"})],
          tools=[_tool("set_code", {"code": {"anyOf": [{"type": "string"}, {"type": "null"}]}})]),
    _case("anyof_integer_null_parses_as_int", SHARED, _inline("set_count", ("count", "42")),
          [("set_count", {"count": 42})],
          tools=[_tool("set_count", {"count": {"anyOf": [{"type": "integer"}, {"type": "null"}]}})]),
    _case("double_encoded_object_param", SHARED,
          _call("process", ("name", "hello"), ("data", "\"{'key': 'value', 'n': 1}\"")) + "\n",
          [("process", {"name": "hello", "data": {"key": "value", "n": 1}})],
          tools=[_tool("process", {"name": {"type": "string"}, "data": {"type": "object"}})]),
    _case("content_with_xml_structural_tags", SHARED, _write_file("test.py", XML_TAGS_IN_CONTENT) + "\n",
          [("write_file", {"path": "test.py", "content": XML_TAGS_IN_CONTENT.rstrip("\n")})], tools=WRITE_FILE_TOOLS),
    _case("content_with_param_like_lines", SHARED, _write_file("test_template.py", PARAM_LIKE_LINES) + "\n",
          [("write_file", {"path": "test_template.py", "content": PARAM_LIKE_LINES.rstrip("\n")})],
          tools=WRITE_FILE_TOOLS),
    _case("array_with_json_bool", SHARED, _call("pick", ("items", '["a", "b", 1, true]')),
          [("pick", {"items": ["a", "b", 1, True]})], tools=[_tool("pick", {"items": {"type": "array"}})]),
    _case("two_tool_calls_in_one_streaming_chunk", SHARED, TWO_WEATHER_CALLS,
          [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})], tools=WEATHER_TOOLS),
    _case("python_none_value_for_nullable_int", SHARED, _inline("set_count", ("count", "None")),
          [("set_count", {"count": None})],
          tools=[_tool("set_count", {"count": {"anyOf": [{"type": "integer"}, {"type": "null"}]}})]),
    _case("streaming_two_tool_calls_plus_trailing_text_one_delta", SHARED, TWO_WEATHER_CALLS + "\nAll done!",
          [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})], content=Contains("All done!"),
          tools=WEATHER_TOOLS),
    _case("streaming_trailing_text_with_final_close_in_same_delta", SHARED,
          _inline("get_weather", ("city", "Paris")) + "\nI hope this helps!", [("get_weather", {"city": "Paris"})],
          content=Contains("I hope this helps!"), tools=WEATHER_TOOLS),
    _case("content_with_real_param_name_literal", SHARED, _write_file("fixture.py", REAL_PARAM_NAME_LITERAL),
          [("write_file", {"path": "fixture.py", "content": REAL_PARAM_NAME_LITERAL.rstrip("\n")})],
          tools=WRITE_FILE_TOOLS),
    _case("content_with_full_nested_tool_call", SHARED, _write_file("fixture.py", FULL_NESTED_CALL),
          [("write_file", {"path": "fixture.py", "content": FULL_NESTED_CALL.rstrip("\n")})], tools=WRITE_FILE_TOOLS),
    _case("two_tools_second_with_out_of_schema_nested_literal", SHARED,
          _inline("foo", ("bar", "baz")) + "\n\n" + _write_file("fixture.py", OUT_OF_SCHEMA_NESTED),
          [("foo", {"bar": "baz"}),
           ("write_file", {"path": "fixture.py", "content": OUT_OF_SCHEMA_NESTED.rstrip("\n")})],
          tools=WRITE_FILE_TOOLS),
    _case("jinja_template_phantom_tool_call_is_rejected", SHARED,
          "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>\n"
          "</tool_call>\n\n" + _call("write_file", ("path", "out.txt"), ("content", "hello")),
          [("write_file", {"path": "out.txt", "content": "hello"})], tools=WRITE_FILE_TOOLS),
    _case("inline_empty_tool_call_preserves_content_before_real_call", SHARED,
          "I'll show: <tool_call>example</tool_call>. Now real:\n" + _call("log", ("msg", "hi")),
          [("log", {"msg": "hi"})],
          content=Contains("I'll show: <tool_call>example</tool_call>. Now real:"),
          tools=[_tool("log", {"msg": {"type": "string"}})]),
    *(_case(f"anyof_string_null_with_{literal}_literal_returns_none", SHARED,
            _inline("set_value", ("optional", literal)),
            [("set_value", {"optional": None})],
            tools=[_tool("set_value", {"optional": {"anyOf": [{"type": "string"}, {"type": "null"}]}})])
      for literal in ("null", "None")),
]
