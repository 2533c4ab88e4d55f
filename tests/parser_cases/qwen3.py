"""vLLM's tests/reasoning/test_qwen3_reasoning_parser.py, and the cases of
tests/reasoning/test_qwen3_tool_call_recovery.py that hold for our qwen3 format.

vLLM's qwen3 parser assumes thinking is on unless the request turns it off; ours reads the
prompt's end. Each case therefore carries the generation prompt of the template that
produces such an output: `THINKING` (Qwen3.5's and Qwen3-Thinking-2507's templates open
`<think>` in the prompt, so the output holds only `</think>`), `OPENS_ITSELF` (Qwen3's
hybrid template: the model writes `<think>` itself), or `THINKING_OFF` (`enable_thinking=False`
closes an empty section in the prompt). A streaming test whose output and result are
another's is that case (one case, both names in its source).
"""

from tests.parser_conformance import Case, Contains

SOURCE = "tests/reasoning/test_qwen3_reasoning_parser.py"
RECOVERY = "tests/reasoning/test_qwen3_tool_call_recovery.py"

OPENS_ITSELF = "<|im_start|>user\nWhat is in /etc/hosts?<|im_end|>\n<|im_start|>assistant\n"
THINKING = OPENS_ITSELF + "<think>\n"
THINKING_OFF = OPENS_ITSELF + "<think>\n\n</think>\n\n"

TOOL_CALL_BODY = ("<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n"
                  "</tool_call>")
RECOVERY_BLOCK = "<tool_call>\n<function=Finish>\n<parameter=answer>\n204\n</parameter>\n</function>\n</tool_call>"


def _case(name: str, prompt: str, output: str, reasoning: str | None, content: str | None, source: str = SOURCE,
          **kwargs) -> Case:
    return Case(f"qwen3-{name}", f"{source}::{name}", "qwen3", output, {"reasoning": reasoning, "content": content},
                reasoning="qwen3", prompt=prompt, **kwargs)


def _recovery(name: str, prompt: str, output: str, tools: str | None = None, **expected) -> Case:
    return Case(f"qwen3-{name}", f"{RECOVERY}::test_{name}", "qwen3", output, expected, reasoning="qwen3",
                tools=tools, prompt=prompt)


def _stripped(reasoning: str | None, content: str | None) -> dict:
    """Our values where only the whitespace around the markers differs (see `stripped`)."""
    return {"difference": "stripped", "ours": {"reasoning": reasoning, "content": content}}


CASES = [
    # test_reasoning (each with its _stream twin: the same output and result).
    _case("without_start_token", THINKING, "This is a reasoning section</think>This is the rest",
          "This is a reasoning section", "This is the rest"),
    _case("without_start_token_complete_reasoning", THINKING, "This is a reasoning section</think>",
          "This is a reasoning section", None),
    _case("with_think", OPENS_ITSELF, "<think>This is a reasoning section</think>This is the rest",
          "This is a reasoning section", "This is the rest"),
    _case("without_think", THINKING, "This is the rest", "This is the rest", None),
    _case("complete_reasoning", OPENS_ITSELF, "<think>This is a reasoning section</think>",
          "This is a reasoning section", None),
    _case("multiline_reasoning", OPENS_ITSELF, "<think>This is a reasoning\nsection</think>This is the rest\nThat",
          "This is a reasoning\nsection", "This is the rest\nThat"),
    _case("only_open_tag", OPENS_ITSELF, "<think>This is a reasoning section", "This is a reasoning section", None),
    _case("truncated_no_start_token", THINKING, "This is a reasoning section", "This is a reasoning section", None),
    _case("tool_call_no_think_end", THINKING, "I need to read the file.\n\n" + TOOL_CALL_BODY,
          "I need to read the file.\n\n", TOOL_CALL_BODY, **_stripped("I need to read the file.", TOOL_CALL_BODY)),
    _case("tool_call_with_think_no_end", OPENS_ITSELF, "<think>I need to read the file.\n\n" + TOOL_CALL_BODY,
          "I need to read the file.\n\n", TOOL_CALL_BODY, **_stripped("I need to read the file.", TOOL_CALL_BODY)),
    # test_reasoning_streaming_multi_token_deltas (its deltas joined; start_token_grouped_with_text
    # is with_think's output).
    _case("end_token_grouped_with_content", THINKING, "reasoning section</think>This is the rest",
          "reasoning section", "This is the rest"),
    _case("start_and_end_in_one_delta_no_content", OPENS_ITSELF, "<think>reasoning</think>", "reasoning", None),
    _case("no_start_end_grouped_with_content", THINKING, "reasoning section</think>content",
          "reasoning section", "content"),
    _case("tool_call_implicit_reasoning_end", THINKING, "I need to read the file.\n\n<tool_call>\n<function=bash>",
          "I need to read the file.\n\n", "<tool_call>\n<function=bash>",
          **_stripped("I need to read the file.", "<tool_call>\n<function=bash>")),
    # test_reasoning_thinking_disabled.
    _case("thinking_disabled_plain_content", THINKING_OFF, "This is plain content", None, "This is plain content"),
    _case("thinking_disabled_no_think_tokens", THINKING_OFF, "Some output without think tokens", None,
          "Some output without think tokens"),
    _case("thinking_disabled_with_tool_call", THINKING_OFF, "I need to read the file.\n\n" + TOOL_CALL_BODY, None,
          "I need to read the file.\n\n" + TOOL_CALL_BODY),
    # test_qwen3_tool_call_recovery: the tests that check with `in` state what they check. Ours
    # ends the reasoning at `<tool_call>`, so a model's late `</think>` stays in the content
    # after the call (the ordering test, which wants the text after `</think>` moved before
    # the call, is left out: ours keeps the text where the model wrote it).
    _recovery("embedded_tool_call_is_promoted_from_reasoning_into_content", OPENS_ITSELF,
              "<think>The verification confirms my solution:\n- s = 2.5 km/h\n- t = 24 minutes\n"
              "- Total time at speed 3 km/h = 204 minutes\n\n" + RECOVERY_BLOCK + "\n</think>",
              content=Contains("<tool_call>\n<function=Finish>")),
    _recovery("promoted_tool_call_is_parseable_by_qwen3coder_and_trailing_text_preserved", OPENS_ITSELF,
              "<think>verify result\n" + RECOVERY_BLOCK + "</think>assistant trailing text", tools="qwen3_coder",
              tool_calls=[("Finish", {"answer": "204"})], content=Contains("assistant trailing text")),
    _recovery("truncated_reasoning_still_recovers_embedded_tool_call", THINKING, "verify result\n" + RECOVERY_BLOCK,
              content=Contains("<tool_call>")),
    _case("normal_reasoning_extraction_unchanged", OPENS_ITSELF,
          "<think>Let me think about this carefully.\nThe answer is 42.</think>The answer is 42.",
          "Let me think about this carefully.\nThe answer is 42.", "The answer is 42.", source=RECOVERY),
    _case("post_think_content_preserved_without_tool_call", OPENS_ITSELF,
          "<think>some reasoning</think>plain response text", "some reasoning", "plain response text",
          source=RECOVERY),
]
