"""vLLM's tests/tool_parsers/test_llama3_json_tool_parser.py (Llama 3.2's tokenizer, its
`<|python_tag|>` a special token). vLLM's parser returns no content once it finds a call;
ours keeps the text around the calls (`content_around_calls`)."""

from tests.parser_conformance import Case

SOURCE = "tests/tool_parsers/test_llama3_json_tool_parser.py"
SEARCH_CALLS = [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]


def _case(name: str, output: str, expected: dict, **kwargs) -> Case:
    return Case(f"llama3_json-{name}", f"{SOURCE}::{name}", "llama3", output, expected, tools="llama3_json",
                **kwargs)


def _plain(name: str, output: str) -> Case:
    """An output vLLM reads as no call: all of it is content."""
    return _case(name, output, {"tool_calls": None, "content": output})


def _separator(separator: str, label: str) -> Case:
    output = ('{"name": "searchTool", "parameters": {"query": "test1"}}' + separator
              + '{"name": "getOpenIncidentsTool", "parameters": {}}')
    return _case(f"extract_tool_calls_streaming_parallel_separators[{label}]", output,
                 {"tool_calls": [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})]})


CASES = [
    _case("extract_tool_calls_simple",
          'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
          {"tool_calls": [("getOpenIncidentsTool", {})], "arguments_text": ["{}"], "content": None},
          difference="content_around_calls", ours={"content": "Here is the result:\nWould you like to know more?"}),
    _case("extract_tool_calls_with_arguments",
          '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
          {"tool_calls": [("searchTool", {"query": "test query", "limit": 10})]}),
    _plain("extract_tool_calls_no_json", "This is just some text without any tool calls"),
    _plain("extract_tool_calls_invalid_json", '{"name": "invalidTool", "parameters": {invalid json}'),
    _case("extract_tool_calls_with_arguments_key", '{"name": "searchTool", "arguments": {"query": "test"}}',
          {"tool_calls": [("searchTool", {"query": "test"})]}),
    _case("extract_tool_calls_multiple_json",
          '{"name": "searchTool", "parameters": {"query": "test1"}}; '
          '{"name": "getOpenIncidentsTool", "parameters": {}}; '
          '{"name": "searchTool", "parameters": {"query": "test2"}}',
          {"tool_calls": SEARCH_CALLS}),
    _case("extract_tool_calls_multiple_json_with_whitespace",
          '{"name": "searchTool", "parameters": {"query": "test1"}} ; '
          '{"name": "getOpenIncidentsTool", "parameters": {}} ; '
          '{"name": "searchTool", "parameters": {"query": "test2"}}',
          {"tool_calls": SEARCH_CALLS}),
    _case("extract_tool_calls_multiple_json_with_surrounding_text",
          'Here are the results: {"name": "searchTool", "parameters": {"query": "test1"}}; '
          '{"name": "getOpenIncidentsTool", "parameters": {}}; '
          '{"name": "searchTool", "parameters": {"query": "test2"}} Would you like to know more?',
          {"tool_calls": SEARCH_CALLS}),
    _case("extract_tool_calls_deeply_nested_json",
          '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}',
          {"tool_calls": [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})]}),
    _case("extract_tool_calls_multiple_with_deep_nesting",
          '{"name": "simpleTool", "parameters": {"value": "test"}}; '
          '{"name": "complexTool", "parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}}',
          {"tool_calls": [("simpleTool", {"value": "test"}),
                          ("complexTool", {"config": {"database": {"connection": {"pool": {"size": 10}}}}})]}),
    _case("extract_tool_calls_with_quotes_and_brackets_in_string",
          '{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
          '"nested": {"inner": "more {brackets}"}}}',
          {"tool_calls": [("searchTool", {"query": "test {value} [complex]",
                                          "nested": {"inner": "more {brackets}"}})]}),
    _case("extract_tool_calls_with_escaped_quotes_in_nested_json",
          '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
          {"tool_calls": [("parserTool", {"text": 'He said "Hello {world}"'})]}),
    _plain("extract_tool_calls_missing_name_key", '{"parameters": {}}'),
    _plain("extract_tool_calls_missing_parameters_and_arguments_key", '{"name": "toolWithoutParams"}'),
    _case("extract_tool_calls_brace_in_trailing_text",
          '{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.',
          {"tool_calls": [("searchTool", {"query": "test"})]}),
    _case("extract_tool_calls_json_fragment_in_trailing_text",
          '{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were {"query": "test"}',
          {"tool_calls": [("searchTool", {"query": "test"})]}),
    _separator("; ", "semicolon_space"),
    _separator(";", "semicolon"),
    _separator(";\n", "semicolon_newline"),
    _separator("\n", "newline"),
]
