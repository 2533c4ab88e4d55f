"""vLLM's tests/tool_parsers/test_kimi_k2_tool_parser.py.

Its markers are special tokens of Kimi's tokenizer (the user's text lacks them; the parser
finds them through the token ids). A streaming test's output is its deltas joined; where its
stream-interval tests run one output at several chunk sizes, that output is one case here
(ours goes token by token). Where the test checks less than the whole result (`in` on the
content, the calls' names), the case states what it checks (`Contains`) and the calls vLLM's
parser gives.
"""

from typing import Any

from tests.parser_conformance import Case, Contains

SOURCE = "tests/tool_parsers/test_kimi_k2_tool_parser.py"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_BEGIN, TOOL_END, ARG_BEGIN = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


WEATHER_TOOL = _tool("get_weather", {"city": {"type": "string"}, "unit": {"type": "string"}})
READ_FILE_TOOL = _tool("read_file", {"path": {"type": "string"}})
BOOK_FLIGHT_TOOL = _tool("book_flight", {"city": {"type": "string"}})


def _call(call_id: str, arguments: str) -> str:
    """One call as the extraction tests write it."""
    return f"{TOOL_BEGIN}{call_id} {ARG_BEGIN}{arguments}{TOOL_END}"


def _section(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


def _streamed(content: str, *calls: tuple[str, str]) -> str:
    """The output of the streaming tests' deltas: the arguments followed by a space."""
    return content + SECTION_BEGIN + "".join(f"{TOOL_BEGIN}{call_id} {ARG_BEGIN}{arguments} {TOOL_END}"
                                             for call_id, arguments in calls) + SECTION_END


def _case(name: str, output: str, tools: list[dict[str, Any]] | None = None, difference: str | None = None,
          ours: dict[str, Any] | None = None, **expected: Any) -> Case:
    """A case whose test checks the fields given (`tool_calls`, `content`, `ids`)."""
    return Case(f"kimi_k2-{name}", f"{SOURCE}::{name}", "kimi_k2", output, expected, tools="kimi_k2",
                difference=difference, ours=ours or {}, request_tools=tools)


def _stripped(name: str, output: str, content: str, calls: list[tuple[str, Any]], **kwargs: Any) -> Case:
    """A case whose test expects the content before the section as written (its last space kept)."""
    return _case(name, output, content=content, tool_calls=calls, difference="content_stripped",
                 ours={"content": content.strip()}, **kwargs)


WEATHER_BEIJING = ("get_weather", {"city": "Beijing"})

CASES = [
    # TestExtractToolCalls
    _case("no_tools", "This is a test", content="This is a test", tool_calls=None),
    _stripped("single_tool_call", "I'll check. " + _section(_call("functions.get_weather:0", '{"city": "Beijing"}')),
              "I'll check. ", [WEATHER_BEIJING]),
    _stripped("parallel_tool_calls", "Compare weather. " + _section(
        _call("functions.get_weather:0", '{"city": "Beijing"}'),
        _call("functions.get_weather:1", '{"city": "Shanghai"}')),
              "Compare weather. ", [WEATHER_BEIJING, ("get_weather", {"city": "Shanghai"})]),
    _stripped("three_tool_calls", "Multiple tasks. " + _section(
        _call("functions.get_weather:0", '{"city": "New York"}'),
        _call("functions.get_news:1", '{"topic": "technology"}'),
        _call("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}')),
              "Multiple tasks. ", [("get_weather", {"city": "New York"}), ("get_news", {"topic": "technology"}),
                                   ("send_email", {"to": "user@example.com", "subject": "Daily Update"})]),
    _stripped("angle_brackets_in_json", "Process HTML. " + _section(
        _call("functions.process_html:0", '{"html": "<div>content</div>"}')),
              "Process HTML. ", [("process_html", {"html": "<div>content</div>"})]),
    _stripped("multiline_json", "Formatted. " + _section(
        _call("functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}')),
              "Formatted. ", [("process_data", {"name": "test", "value": 123})]),
    _stripped("no_functions_prefix", "No prefix. " + _section(_call("get_weather:0", '{"city": "Tokyo"}')),
              "No prefix. ", [("get_weather", {"city": "Tokyo"})]),
    _stripped("empty_arguments", "Empty args. " + _section(_call("functions.test:0", "{}")), "Empty args. ",
              [("test", {})]),
    # Arguments that are not JSON are passed on as written (ours names the call in tool_call_error).
    _case("invalid_json_still_extracted", "Help. " + _section(
        _call("functions.bad:0", '{"city": "Beijing"'), _call("functions.good:1", '{"city": "Shanghai"}')),
          tool_calls=[("bad", '{"city": "Beijing"'), ("good", {"city": "Shanghai"})]),
    _case("invalid_funcall_id_skipped", "Help. " + _section(
        _call("functions.invalid.0", '{"city": "Beijing"}'), _call("functions.valid:1", '{"city": "Shanghai"}')),
          tool_calls=[("valid", {"city": "Shanghai"})]),
    _case("native_id_extracted", "Checking weather. " + _section(_call("functions.get_weather:0", '{"city": "Tokyo"}')),
          tool_calls=[("get_weather", {"city": "Tokyo"})], ids=["functions.get_weather:0"]),
    _case("multi_turn_native_id_continuity_turn1", "Let me check. " + _section(
        _call("functions.get_weather:0", '{"city": "Beijing"}')), ids=["functions.get_weather:0"]),
    _case("multi_turn_native_id_continuity_turn2", "Now let me get news. " + _section(
        _call("functions.get_news:0", '{"topic": "weather in Beijing"}')), ids=["functions.get_news:0"]),
    _stripped("bare_counter", "Let me check. " + _section(_call("0", '{"city": "Tokyo", "unit": "celsius"}')),
              "Let me check. ", [("get_weather", {"city": "Tokyo", "unit": "celsius"})], tools=[WEATHER_TOOL],
              ids=["0"]),
    _case("bare_counter_multiple_tools_infers_by_args",
          "Let me check. " + _section(_call("0", '{"city": "Tokyo", "unit": "celsius"}')),
          tools=[READ_FILE_TOOL, WEATHER_TOOL], tool_calls=[("get_weather", {"city": "Tokyo", "unit": "celsius"})],
          ids=["0"]),
    _case("bare_counter_multiple_tools_skips_unsafe_inference_ambiguous",
          "Let me check. " + _section(_call("0", '{"city": "Tokyo"}')), tools=[WEATHER_TOOL, BOOK_FLIGHT_TOOL],
          tool_calls=None),
    _case("bare_counter_multiple_tools_skips_unsafe_inference_malformed_json",
          "Let me check. " + _section(_call("0", '{"city": "Tokyo"')), tools=[WEATHER_TOOL, BOOK_FLIGHT_TOOL],
          tool_calls=None),
    # TestStreamingHappyPath
    _case("streaming_single_tool_call", _streamed("I'll help. ", ("functions.get_weather:0", '{"city": "Beijing"}')),
          tool_calls=[WEATHER_BEIJING], ids=["functions.get_weather:0"]),
    _case("streaming_multiple_tool_calls", _streamed("Compare weather. ",
                                                     ("functions.get_weather:0", '{"city": "Tokyo"}'),
                                                     ("functions.get_weather:1", '{"city": "NYC"}')),
          tool_calls=[("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "NYC"})],
          ids=["functions.get_weather:0", "functions.get_weather:1"]),
    _case("streaming_bare_counter", _streamed("I'll help. ", ("0", '{"city": "Beijing"}')), tools=[WEATHER_TOOL],
          tool_calls=[WEATHER_BEIJING], ids=["0"]),
    _case("streaming_bare_counter_multiple_tools_infers_by_args",
          _streamed("I'll help. ", ("0", '{"city": "Beijing", "unit": "celsius"}')),
          tools=[READ_FILE_TOOL, WEATHER_TOOL],
          tool_calls=[("get_weather", {"city": "Beijing", "unit": "celsius"})], ids=["0"]),
    _case("streaming_content_before_tools",
          _streamed("I'll check the weather. ", ("functions.get_weather:0", '{"city": "Tokyo"}')),
          content=Contains("check the weather")),
    _case("streaming_no_tool_calls", "This is just regular text without tools.",
          content="This is just regular text without tools.", tool_calls=None),
    _case("streaming_incremental_arguments", _streamed("Help. ", ("functions.get_weather:0", '{"city": "Beijing"}')),
          tool_calls=[WEATHER_BEIJING]),
    _case("streaming_matches_nonstreaming_single_tool",
          "Single. " + _section(_call("functions.get_weather:0", '{"city": "Beijing"}')), tool_calls=[WEATHER_BEIJING]),
    _case("streaming_matches_nonstreaming_parallel_tools", "Multi. " + _section(
        _call("functions.get_weather:0", '{"city": "Tokyo"}'), _call("functions.get_news:1", '{"topic": "tech"}')),
          tool_calls=[("get_weather", {"city": "Tokyo"}), ("get_news", {"topic": "tech"})]),
    _case("streaming_matches_nonstreaming_no_functions_prefix",
          "No prefix id. " + _section(_call("get_weather:0", '{"city": "NYC"}')),
          tool_calls=[("get_weather", {"city": "NYC"})]),
    # TestStreamingEdgeCases
    _stripped("streaming_marker_suppression",
              _streamed("I'll check. ", ("functions.get_weather:0", '{"city": "Tokyo"}')), "I'll check. ",
              [("get_weather", {"city": "Tokyo"})]),
    _stripped("streaming_noise_between_markers_suppressed",
              f'Reasoning. {SECTION_BEGIN} spurious noise {TOOL_BEGIN}functions.test:0 {ARG_BEGIN}{{"k": "v"}} '
              f"{TOOL_END}{SECTION_END}", "Reasoning. ", [("test", {"k": "v"})]),
    _case("streaming_empty_tool_section", "Reasoning. " + SECTION_BEGIN + SECTION_END, tool_calls=None),
    _case("streaming_three_different_tools", _streamed(
        "Multiple tasks. ", ("functions.get_weather:0", '{"city": "NYC"}'),
        ("functions.get_news:1", '{"topic": "tech"}'),
        ("functions.send_email:2", '{"to": "a@b.com"}')),
          tool_calls=[("get_weather", {"city": "NYC"}), ("get_news", {"topic": "tech"}),
                      ("send_email", {"to": "a@b.com"})],
          ids=["functions.get_weather:0", "functions.get_news:1", "functions.send_email:2"]),
    _case("streaming_truncated_tool_call_no_end_marker",
          "I'll check. " + SECTION_BEGIN + TOOL_BEGIN + "functions.get_weather:0 " + ARG_BEGIN + '{"city": "Bei',
          tool_calls=[("get_weather", '{"city": "Bei')], ids=["functions.get_weather:0"]),
    _case("streaming_content_after_tool_section",
          _streamed("Before. ", ("functions.get_weather:0", '{"city": "Tokyo"}')) + " After tools.",
          content="Before. ", tool_calls=[("get_weather", {"city": "Tokyo"})], difference="content_around_calls",
          ours={"content": "Before.\nAfter tools."}),
    # TestStreamingIntervals (each output at stream intervals 1, 2, 3, 5 and 8, and in one chunk)
    _case("single_tool_call_at_interval", "Help. " + _section(_call("functions.get_weather:0", '{"city": "Beijing"}')),
          tool_calls=[WEATHER_BEIJING]),
    _case("content_then_tool_call_at_interval",
          "Sure, let me check. " + _section(_call("functions.get_weather:0", '{"city": "Tokyo"}')),
          content=Contains("let me check"), tool_calls=[("get_weather", {"city": "Tokyo"})]),
    _case("multiple_tool_calls_at_interval", "Compare. " + _section(
        _call("functions.search:0", '{"q": "cats"}'), _call("functions.search:1", '{"q": "dogs"}')),
          tool_calls=[("search", {"q": "cats"}), ("search", {"q": "dogs"})]),
    _case("plain_text_at_interval", "This is plain text with no tool calling involved.",
          content="This is plain text with no tool calling involved.", tool_calls=None),
    _case("content_and_tool_call_in_single_chunk",
          "Hi! " + _section(_call("functions.get_weather:0", '{"city": "Beijing"}')), content=Contains("Hi!"),
          tool_calls=[WEATHER_BEIJING]),
]
