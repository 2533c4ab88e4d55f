"""vLLM's tests/reasoning/test_mistral_reasoning_parser.py (Magistral's `[THINK]` ... `[/THINK]`,
special tokens that a text decoded for the user leaves out).

A valid section starts with `[THINK]`: an output without it is all answer (a stray `[/THINK]`
dropped with the special tokens), and text the model writes before `[THINK]` stays in the
answer. vLLM's `is_reasoning_end` is our `reasoning_ended` where the output has a section
(where it has none, ours is None: no section, the answer from the first token). A streaming
test whose output and result are another's is that case (one case, both names in its source).
The tests of `is_reasoning_end` on prompt token lists (an example `[THINK]` block in the
system prompt or a tool result, an earlier turn's reasoning) have no output to split: ours
reads only the prompt's end, which none of them opens or closes.
"""

from tests.parser_conformance import Case

SOURCE = "tests/reasoning/test_mistral_reasoning_parser.py"


def _case(name: str, output: str, reasoning: str | None, content: str | None, ended: bool | None = None) -> Case:
    expected = {"reasoning": reasoning, "content": content}
    if ended is not None:
        expected["reasoning_ended"] = ended
    return Case(f"mistral_reasoning-{name}", f"{SOURCE}::{name}", "mistral", output, expected, reasoning="mistral")


CASES = [
    _case("invalid_simple_reasoning", "This is a reasoning section[/THINK]This is the rest", None,
          "This is a reasoning sectionThis is the rest"),
    _case("invalid_complete_reasoning", "This is a reasoning section[/THINK]", None, "This is a reasoning section"),
    _case("no_content", "[THINK]This is reasoning", "This is reasoning", None, False),
    _case("no_reasoning", "This is content", None, "This is content"),
    _case("no_reasoning_token_streaming", "This is a reasoning section", None, "This is a reasoning section"),
    _case("invalid_multiple_lines", "This\nThat[/THINK]This is the rest\nThat", None,
          "This\nThatThis is the rest\nThat"),
    # invalid_shortest, and invalid_shortest_with_think: the same output and result.
    _case("invalid_shortest", "[/THINK]This is the rest", None, "This is the rest"),
    _case("reasoning_with_think", "[THINK]This is a reasoning section[/THINK]This is the rest",
          "This is a reasoning section", "This is the rest", True),
    _case("complete_reasoning_with_think", "[THINK]This is a reasoning section[/THINK]",
          "This is a reasoning section", None, True),
    _case("multiple_lines_with_think", "[THINK]This\nThat[/THINK]This is the rest\nThat", "This\nThat",
          "This is the rest\nThat", True),
    _case("think_no_end", "[THINK]This is a reasoning section", "This is a reasoning section", None, False),
    _case("empty", "", None, None),
    _case("new_line", "Before\n[THINK]This is a reasoning section[/THINK]\nThis is the rest",
          "This is a reasoning section", "Before\n\nThis is the rest", True),
    _case("streaming_reconstruction_extracts_reasoning", "[THINK]Let me think about this[/THINK]The answer is 42",
          "Let me think about this", "The answer is 42", True),
    _case("streaming_reconstruction_no_reasoning", "Just the answer, no thinking", None,
          "Just the answer, no thinking"),
]
