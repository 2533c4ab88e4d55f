"""vLLM's tests/reasoning/test_deepseekr1_reasoning_parser.py, and the extraction cases of
tests/reasoning/test_base_thinking_reasoning_parser.py (vLLM's `<think>` base parser, R1's
own, run there on made-up marker tokens: here on R1's `<think>` and `</think>`).

R1 reasons from its first token whatever the prompt (its template opens the section, and
its distills may skip `<think>`), so no case needs a prompt. vLLM's `is_reasoning_end` is our
`reasoning_ended`. A streaming test whose output and result are another's is that case (one
case, both names in its source); vLLM's None and "" for an empty reasoning are the same here.
"""

from tests.parser_conformance import Case

SOURCE = "tests/reasoning/test_deepseekr1_reasoning_parser.py"
BASE = "tests/reasoning/test_base_thinking_reasoning_parser.py"


def _case(name: str, output: str, reasoning: str | None, content: str | None, ended: bool | None = None,
          source: str = SOURCE, **kwargs) -> Case:
    expected = {"reasoning": reasoning, "content": content}
    if ended is not None:
        expected["reasoning_ended"] = ended
    return Case(f"deepseek_r1-{name}", f"{source}::{name}", "deepseek_r1", output, expected, reasoning="deepseek_r1",
                **kwargs)


CASES = [
    # test_reasoning (each with its _streaming twin unless the twin expects otherwise).
    _case("simple_reasoning", "This is a reasoning section</think>This is the rest",
          "This is a reasoning section", "This is the rest", True),
    _case("complete_reasoning", "This is a reasoning section</think>", "This is a reasoning section", None, True),
    _case("no_content_token", "This is content", "This is content", None, False),
    _case("no_reasoning_token_streaming", "This is a reasoning section", "This is a reasoning section", None, False),
    _case("multiple_lines", "This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat", True),
    _case("shortest", "</think>This is the rest", "", "This is the rest", True),  # and shortest_with_think
    _case("reasoning_with_think", "<think>This is a reasoning section</think>This is the rest",
          "This is a reasoning section", "This is the rest", True),
    _case("complete_reasoning_with_think", "<think>This is a reasoning section</think>",
          "This is a reasoning section", None, True),
    _case("multiple_lines_with_think", "<think>This\nThat</think>This is the rest\nThat", "This\nThat",
          "This is the rest\nThat", True),
    _case("think_no_end", "<think>This is a reasoning section", "This is a reasoning section", None, False),
    _case("empty", "", "", None, False),
    _case("new_line", "\n<think>This is a reasoning section</think>\nThis is the rest",
          "This is a reasoning section", "\nThis is the rest", True, difference="stripped",
          ours={"content": "This is the rest"}),
    # vLLM's streaming parser cannot tell the line before `<think>` from reasoning (its comment
    # says so); ours follows the tokens and gives new_line's result.
    _case("new_line_streaming", "\n<think>This is a reasoning section</think>\nThis is the rest",
          "\nThis is a reasoning section", "\nThis is the rest", True, difference="stripped",
          ours={"reasoning": "This is a reasoning section", "content": "This is the rest"}),
    # The base parser's extraction tests.
    _case("extract_reasoning_with_both_tokens", "<think>This is reasoning</think>This is content",
          "This is reasoning", "This is content", source=BASE),
    _case("extract_reasoning_only_end_token", "This is reasoning</think>This is content",
          "This is reasoning", "This is content", source=BASE),
    _case("extract_reasoning_no_end_token", "This is just content", "This is just content", None, source=BASE),
    _case("extract_reasoning_only_tokens", "<think></think>", "", None, source=BASE),
    # test_simple_reasoning_extraction[streaming and not], test_streaming_with_incremental_deltas.
    _case("simple_reasoning_extraction", "<think>Some reasoning content</think>Final answer",
          "Some reasoning content", "Final answer", source=BASE),
    # test_streaming_with_start_token, test_streaming_start_token_grouped_with_text.
    _case("streaming_with_start_token", "<think>Some reasoning</think>Answer", "Some reasoning", "Answer",
          source=BASE),
    _case("streaming_no_end_token", "<think>Some reasoning without end", "Some reasoning without end", None,
          source=BASE),
    _case("streaming_only_end_token", "<think>Reasoning content</think>Final", "Reasoning content", "Final",
          source=BASE),
    _case("streaming_start_token_grouped_without_end", "<think>Some reasoning", "Some reasoning", None, source=BASE),
    _case("different_token_implementations", "Reasoning1</think>Content1", "Reasoning1", "Content1", source=BASE),
    _case("multiple_end_tokens", "First</think>Middle</think>Last", "First", "Middle</think>Last", source=BASE),
    _case("nested_tokens", "<think>Outer<think>Inner</think>Content", "Outer<think>Inner", "Content", source=BASE),
    _case("malformed_tokens", "<thinking>Not a real token</thinking>Content",
          "<thinking>Not a real token</thinking>Content", None, source=BASE),
]
