"""vLLM's tests/reasoning/test_gptoss_reasoning_parser.py: where gpt-oss's analysis ends.

vLLM's test checks `is_reasoning_end` only (our `reasoning_ended`): the analysis ends at a
final-channel header, `<|channel|>final`, once its `<|message|>` comes, whatever the header
holds between (a constraint, `<|constrain|>json`, or a content type). Its outputs start
with the end of the user's message (`<|end|><|start|>assistant`): the tail of the prompt,
fed here as output tokens as vLLM's test does. The multi-turn case is a whole conversation
that ends with the generation prompt (`<|start|>assistant`), which vLLM's parser reads from
its last message only: it is our prompt, and the completion starts in the analysis. The
structural-tag tests build vLLM's grammar for tool servers: no counterpart here.
"""

from tests.parser_conformance import Case

SOURCE = "tests/reasoning/test_gptoss_reasoning_parser.py::test_gptoss_is_reasoning_end"

USER = "<|start|>user<|message|>"
ANALYSIS = "<|end|><|start|>assistant<|channel|>analysis<|message|>"
END = "<|end|>"
FINAL_PREFIX = END + "<|start|>assistant<|channel|>final"
FINAL = FINAL_PREFIX + "<|message|>"


def _case(name: str, output: str, ended: bool, prompt: str = "") -> Case:
    return Case(f"gptoss-{name}", f"{SOURCE}[{name}]", "harmony", output, {"reasoning_ended": ended},
                reasoning="openai_gptoss", prompt=prompt)


CASES = [
    _case("basic_content", ANALYSIS + "This is reasoning" + FINAL + "This is the rest", True),
    _case("basic_reasoning_only", ANALYSIS + "This is reasoning" + END, False),
    _case("complex_content_incomplete_prefix_only", ANALYSIS + "This is reasoning" + FINAL_PREFIX, False),
    _case("complex_content_suffix_only", ANALYSIS + "This is reasoning" + "<|message|>", False),
    _case("complex_content_1_no_suffix", ANALYSIS + "This is reasoning" + FINAL_PREFIX + "<|constrain|> JSON ", False),
    _case("complex_content_1", ANALYSIS + "This is reasoning" + FINAL_PREFIX + "<|constrain|> JSON <|message|>", True),
    _case("complex_content_1_with_content",
          ANALYSIS + "This is reasoning" + FINAL_PREFIX + "<|constrain|> JSON <|message|>This is the rest", True),
    _case("complex_content_2",
          ANALYSIS + "This is reasoning" + FINAL_PREFIX + "<|constrain|>ReplyAction <|message|>This is the rest", True),
    _case("multi_turn_content", "", False,
          prompt=USER + "1st turn user message" + ANALYSIS + "1st turn reasoning" + FINAL + "1st turn response" + END
          + USER + "2nd turn user message" + END + "<|start|>assistant"),
]
