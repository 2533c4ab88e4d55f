"""vLLM's tests/reasoning/test_deepseekv3_reasoning_parser.py: DeepSeek-V3.1's reasoning switch.

vLLM's `deepseek_v3` reasoning parser delegates by the request's `thinking` switch: to R1's
parser when on, to none (all answer) when off. V3.1's template ends the generation prompt
with `<think>` when thinking is on and `</think>` when off, and ours (`deepseek_v31`) reads
that prompt's end: with thinking on, R1's cases (tests/parser_cases/deepseek_r1.py) hold on
V3.1's tokenizer; with it off, the identity parser's. The token-count test counts without
the markers (ours counts them); the deepseek_v4 alias test is vLLM's registry.
"""

import dataclasses

from tests.parser_cases import deepseek_r1
from tests.parser_conformance import Case

SOURCE = "tests/reasoning/test_deepseekv3_reasoning_parser.py"
THINKING = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
THINKING_OFF = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"


def _with_thinking(case: Case) -> Case:
    """One of R1's own cases, with thinking on."""
    return dataclasses.replace(case, id=case.id.replace("deepseek_r1-", "deepseek_v31_reasoning-thinking-"),
                               source=f"{SOURCE}::test_parser_selection[True] (R1's parser: {case.source})",
                               family="deepseek_v3", reasoning="deepseek_v31", prompt=THINKING)


def _without_thinking(name: str, output: str) -> Case:
    return Case(f"deepseek_v31_reasoning-{name}", f"{SOURCE}::test_identity_reasoning_parser_basic ({name})",
                "deepseek_v3", output, {"reasoning": None, "content": output}, reasoning="deepseek_v31",
                prompt=THINKING_OFF)


CASES = [
    *(_with_thinking(case) for case in deepseek_r1.CASES if case.source.startswith(deepseek_r1.SOURCE)),
    _without_thinking("extract_reasoning", "This is some output"),
    _without_thinking("extract_reasoning_streaming", "Hello world"),
]
