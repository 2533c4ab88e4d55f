"""vLLM's tests/reasoning/test_qwen3_reasoning_parser.py."""

from tests.parser_conformance import Case

SOURCE = "tests/reasoning/test_qwen3_reasoning_parser.py"


def _case(name: str, output: str, reasoning: str | None, content: str | None, **kwargs) -> Case:
    return Case(f"qwen3-{name}", f"{SOURCE}::{name}", "qwen3", output, {"reasoning": reasoning, "content": content},
                reasoning="qwen3", **kwargs)


CASES = [
    _case("without_think", "<think>This is a reasoning section</think>This is the rest",
          "This is a reasoning section", "This is the rest"),
    _case("with_think_newline", "<think>This is a reasoning section\n</think>\nThis is the rest",
          "This is a reasoning section\n", "\nThis is the rest", difference="stripped",
          ours={"reasoning": "This is a reasoning section", "content": "This is the rest"}),
]
