"""The end of a completion's parsing: its reasoning section apart from its answer, then the
tool calls in the answer. The output processor runs it on every finished (and streamed) completion;
tests/parser_conformance.py runs vLLM's parser cases through the same function, so what
the cases check is what a user's table gets."""

from dataclasses import dataclass

from engine.outputs import ToolCall
from engine.reasoning import ReasoningParser, ReasoningTracker
from engine.tool_parsers import ToolParser
from engine.tool_parsers.request_tools import RequestTools


# The revision of what `parse_completion` makes of a completion's tokens (the reasoning
# apart, the tool calls): raised whenever a parser gives other results for the same tokens,
# so that a table keeps no rows parsed the old way (`LLM.output_settings` holds it where a
# parser runs). 2: vLLM's parser cases (issue 63).
PARSING_REVISION = 2


@dataclass(frozen=True)
class ParsedCompletion:
    """A completion's answer `text`, its `reasoning` (None: it had no section), the
    reasoning's tokens (markers included) and whether it ended (None: no section), its
    tool calls (None: none) and why they did not parse (None: they did, or none)."""

    text: str
    reasoning: str | None = None
    num_reasoning_tokens: int = 0
    reasoning_ended: bool | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_error: str | None = None


def parse_completion(text: str, token_ids: list[int], reasoning_parser: ReasoningParser | None,
                     tracker: ReasoningTracker | None, tool_parser: ToolParser | None,
                     skip_special_tokens: bool = True, tools: RequestTools | None = None) -> ParsedCompletion:
    """`text` (the completion as decoded for the user, stop strings cut) and its `token_ids`
    split by the reasoning parser (`tracker`: the one that followed the completion's tokens;
    None: no reasoning parsing), then the answer's tool calls read by the tool parser (by the
    request's `tools` where the format needs them), which runs unless the completion stopped
    inside its reasoning or the request's tool choice leaves its calls unread (`RequestTools`)."""
    parsed = ParsedCompletion(text)
    answer_ids = token_ids
    if reasoning_parser is not None and tracker is not None:
        split = reasoning_parser.split(tracker, text, token_ids, skip_special_tokens)
        parsed = ParsedCompletion(split.text, split.reasoning, split.num_reasoning_tokens, split.ended)
        answer_ids = token_ids[split.num_reasoning_tokens if split.answer_start is None else split.answer_start:]
    if tool_parser is None or parsed.reasoning_ended is False or (tools is not None and not tools.read_calls):
        return parsed
    calls = tool_parser.parse(parsed.text, answer_ids, tools.tools if tools is not None else None)
    return ParsedCompletion(calls.content, parsed.reasoning, parsed.num_reasoning_tokens, parsed.reasoning_ended,
                            calls.tool_calls, calls.error)
