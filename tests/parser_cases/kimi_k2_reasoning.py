"""vLLM's tests/reasoning/test_kimi_k2_reasoning_parser.py: Kimi K2's thinking models.

The model may think without writing `<think>` (so no case needs a prompt: a completion is
reasoning from its first token unless the template's `thinking` switch closed the section in
the prompt), and a tool-call section, `<|tool_calls_section_begin|>`, ends the reasoning
without `</think>`: the answer starts at it. That marker is a special token; vLLM's test
reads a text that keeps it, as vLLM decodes a Kimi request with tools (its kimi_k2 tool
parser turns `skip_special_tokens` off), so those cases do too. The streaming tests are
their outputs' final result; the tests of which parser vLLM delegates to (thinking on or
off) and of its stop-string buffering check internals (our prompt switch is in
tests/engine/test_reasoning.py).
"""

from tests.parser_conformance import Case

SOURCE = "tests/reasoning/test_kimi_k2_reasoning_parser.py"


def _case(name: str, output: str, skip_special_tokens: bool = True, **expected: str | None) -> Case:
    return Case(f"kimi_k2_reasoning-{name}", f"{SOURCE}::test_{name}", "kimi_k2", output, expected,
                reasoning="kimi_k2", skip_special_tokens=skip_special_tokens)


CASES = [
    _case("extract_reasoning_with_think_tags", "<think>step by step reasoning</think>final answer",
          reasoning="step by step reasoning", content="final answer"),
    _case("extract_reasoning_empty_thinking", "<think></think>final answer", reasoning="", content="final answer"),
    _case("extract_reasoning_implicit_start", "implicit reasoning with no tags",
          reasoning="implicit reasoning with no tags", content=None),
    _case("extract_reasoning_tool_section_ends_reasoning", "some reasoning<|tool_calls_section_begin|>tool call data",
          False, reasoning="some reasoning", content="<|tool_calls_section_begin|>tool call data"),
    _case("streaming_reasoning_then_content", "<think>step one</think>answer", reasoning="step one",
          content="answer"),
    _case("streaming_tool_section_ends_reasoning", "<think>thinking<|tool_calls_section_begin|>", False,
          reasoning="thinking", content="<|tool_calls_section_begin|>"),
]
