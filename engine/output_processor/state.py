"""What the output processor keeps of one generating sequence (`Sequence.output`): a record of
its own, so that the sequence holds its request's state and the processor's beside it."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.output_processor.detokenizer import IncrementalDetokenizer
from engine.outputs import Logprob

if TYPE_CHECKING:
    from engine.reasoning import ReasoningTracker
    from engine.tool_parsers.request_tools import RequestTools


@dataclass
class OutputState:
    """A completion's or a beam's output beside its tokens, made with the sequence
    (`OutputProcessor.start`; a prompt to pool has none).

    `stop_token_ids` end it once it has min_tokens (the model's EOS ids unless ignore_eos,
    and the request's stop_token_ids); `detokenizer` holds its text; `logprobs` (an entry
    per generated token) and `cumulative_logprob` are kept where the request asked for
    logprobs, `prompt_logprobs` (an entry per prompt position) where it asked for those;
    `reasoning` follows its reasoning section, with a reasoning parser, on a completion
    whose output is parsed; `tools` are the tools its chat declared, which the tool parser
    reads its calls by, and whether it reads them (the request's tool choice).
    """

    detokenizer: IncrementalDetokenizer
    stop_token_ids: frozenset[int]
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    reasoning: "ReasoningTracker | None" = None
    tools: "RequestTools | None" = None
