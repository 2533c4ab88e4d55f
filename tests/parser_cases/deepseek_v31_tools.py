"""vLLM's tests/tool_parsers/test_deepseekv31_tool_parser.py (DeepSeek-V3.1's tokenizer, its
call markers plain added tokens). vLLM passes the arguments on as the model spaced them
(`{"x":1}`); ours are written as every format's (`arguments_normalised`)."""

from tests.parser_conformance import Case

SOURCE = "tests/tool_parsers/test_deepseekv31_tool_parser.py"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
FOO = '<｜tool▁call▁begin｜>foo<｜tool▁sep｜>{"x":1}<｜tool▁call▁end｜>'
BAR = '<｜tool▁call▁begin｜>bar<｜tool▁sep｜>{"y":2}<｜tool▁call▁end｜>'


def _case(name: str, output: str, expected: dict, **kwargs) -> Case:
    return Case(f"deepseek_v31-{name}", f"{SOURCE}::{name}", "deepseek_v3", output, expected, tools="deepseek_v31",
                **kwargs)


CASES = [
    _case("extract_tool_calls_with_tool", "normal text" + CALLS_BEGIN + FOO + CALLS_END,
          {"tool_calls": [("foo", {"x": 1})], "arguments_text": ['{"x":1}'], "content": "normal text"},
          difference="arguments_normalised", ours={"arguments_text": ['{"x": 1}']}),
    _case("extract_tool_calls_with_multiple_tools",
          "some prefix text" + CALLS_BEGIN + FOO + BAR + CALLS_END + " some suffix text",
          # vLLM's test compares the arguments' text too: the case above shows that difference.
          {"tool_calls": [("foo", {"x": 1}), ("bar", {"y": 2})], "content": "some prefix text"},
          difference="content_around_calls", ours={"content": "some prefix text\nsome suffix text"}),
    _case("extract_tool_calls_unparsable_block[cut_off]", "Let me look that up." + CALLS_BEGIN + "get_weather",
          {"tool_calls": None, "content": "Let me look that up." + CALLS_BEGIN + "get_weather"}),
    _case("extract_tool_calls_unparsable_block[no_call_markers]",
          CALLS_BEGIN + 'foo<｜tool▁sep｜>{"x":1}' + CALLS_END,
          {"tool_calls": None, "content": CALLS_BEGIN + 'foo<｜tool▁sep｜>{"x":1}' + CALLS_END}),
]
