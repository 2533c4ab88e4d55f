"""vLLM's tests/tool_parsers/test_openai_tool_parser.py: gpt-oss's harmony messages (its
tokens special), read after the `openai_gptoss` reasoning parser ends the analysis, as the
engine runs them. vLLM's tests render a harmony conversation; each case here is the part the
model writes, its messages as gpt-oss writes them (a call's recipient in the channel header,
`<|constrain|>` before its content type). vLLM's common tool-parser tests take "" and "{}"
as the same empty arguments; so do these."""

from tests.parser_conformance import Case

SOURCE = "tests/tool_parsers/test_openai_tool_parser.py"
ANALYSIS = ('<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use '
            'get_current_weather tool.<|end|><|start|>assistant')
ANALYSIS_TWO_TOOLS = ('<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" based on their '
                      'location. We need to use get_current_weather tool and get_user_location tool.<|end|>'
                      '<|start|>assistant')
TOKYO = '{"location": "Tokyo"}'


def _call(function: str, arguments: str, content_type: str = "json") -> str:
    """A message to `functions.<function>` on the commentary channel."""
    constraint = f" <|constrain|>{content_type}" if content_type else ""
    return f"<|channel|>commentary to=functions.{function}{constraint}<|message|>{arguments}<|call|>"


def _case(name: str, output: str, expected: dict, **kwargs) -> Case:
    return Case(f"openai-{name}", f"{SOURCE}::{name}", "harmony", output, expected, reasoning="openai_gptoss",
                tools="openai", **kwargs)


MULTIPLE = ANALYSIS_TWO_TOOLS + "<|start|>assistant".join([
    _call("get_current_weather", TOKYO), _call("get_user_location", TOKYO), _call("no_content_type", TOKYO, ""),
    _call("not_json_no_content_type", "foo", ""), _call("empty_args", "{}"), _call("no_args", "")])

CASES = [
    _case("extract_tool_calls_no_tools", "<|channel|>final<|message|>This is a test<|return|>",
          {"tool_calls": None, "content": "This is a test"}),
    _case("extract_tool_calls_single_tool[compact]", ANALYSIS + _call("get_current_weather", TOKYO),
          {"tool_calls": [("get_current_weather", {"location": "Tokyo"})], "content": None}),
    _case("extract_tool_calls_single_tool[newlines]",
          ANALYSIS + _call("get_current_weather", '{\n"location": "Tokyo"\n}'),
          {"tool_calls": [("get_current_weather", {"location": "Tokyo"})], "content": None}),
    # "foo" is passed on as the call's arguments, as written (and named in tool_call_error: not an object).
    _case("extract_tool_calls_multiple_tools", MULTIPLE,
          {"tool_calls": [("get_current_weather", {"location": "Tokyo"}), ("get_user_location", {"location": "Tokyo"}),
                          ("no_content_type", {"location": "Tokyo"}), ("not_json_no_content_type", "foo"),
                          ("empty_args", {}), ("no_args", {})], "content": None}),
    _case("extract_tool_calls_with_content",
          ANALYSIS_TWO_TOOLS + _call("get_current_weather", TOKYO)
          + "<|start|>assistant<|channel|>final<|message|>This tool call will get the weather.<|return|>",
          {"tool_calls": [("get_current_weather", {"location": "Tokyo"})],
           "content": "This tool call will get the weather."}),
]
