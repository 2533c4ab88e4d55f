"""The output processor (vLLM's `v1/engine/output_processor.py`): what happens to each token a
step sampled once the engine loop hands it over, and the output of a request that finished.

A token is appended with its logprobs where the request asked; it advances the completion's
reasoning section (which holds its grammar back while the model reasons) and its grammar,
grows its text where a stop string or the reasoning markers need the text as it grows, and
may end it (`StopChecker`). A finished request's output is built from its sequences: their
texts decoded together (`finish_texts`), then each completion's reasoning and tool calls read
apart from its answer (`parse_completion`).
"""

import logging
import time

from transformers import PreTrainedTokenizerBase

from engine.beam_search import BeamSearchOutput
from engine.core.beam_group import Continuation
from engine.core.sequence import Sequence
from engine.output_processor.detokenizer import IncrementalDetokenizer, finish_texts
from engine.output_processor.parsing import parse_completion
from engine.output_processor.state import OutputState
from engine.output_processor.stop_checker import StopChecker
from engine.outputs import (
    ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
    Logprob, PoolingRequestOutput, RequestOutput,
)
from engine.reasoning import Phase, ReasoningParser, detect_reasoning_parser, reasoning_parser
from engine.sample.sampler import SampledToken
from engine.tool_parsers import ToolParser, detect_tool_parser, tool_parser
from engine.tool_parsers.request_tools import RequestTools

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Turns sampled tokens into completions and finished sequences into outputs.

    `eos_token_ids` are the model's; `pooling_task` is the pooling model's task ("embed" or
    "classify"; None for a generating model); `reasoning_parser` and `tool_parser` read a
    completion's reasoning section and tool calls (None: the engine reads neither).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                 pooling_task: str | None = None, reasoning_parser: ReasoningParser | None = None,
                 tool_parser: ToolParser | None = None) -> None:
        self.tokenizer = tokenizer
        self.pooling_task = pooling_task
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_checker = StopChecker(self.eos_token_ids)
        # Texts of single tokens, shared by the detokenizers of each (skip_special_tokens,
        # spaces_between_special_tokens) setting.
        self._token_texts: dict[tuple[bool, bool], dict[int, str]] = {}

    def start(self, seq: Sequence, parses: bool, tools: RequestTools | None = None) -> None:
        """Gives a new sequence that generates tokens (a completion or a beam, whose tokens are
        its prompt's yet) its output state. `parses`: a completion whose output is read
        apart, whose reasoning section is followed with a reasoning parser (the grammar
        waits for its end); `tools`: the tools its chat declared."""
        params = seq.sampling_params
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        settings = (params.skip_special_tokens, params.spaces_between_special_tokens)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, *settings,
                                             self._token_texts.setdefault(settings, {}))
        stops = frozenset(params.stop_token_ids).union(frozenset() if params.ignore_eos else self.eos_token_ids)
        logprobs = params.logprobs is not None
        seq.output = OutputState(
            detokenizer, stops, logprobs=[] if logprobs else None, cumulative_logprob=0.0 if logprobs else None,
            prompt_logprobs=[None] * len(prompt) if params.prompt_logprobs is not None else None, tools=tools)
        if self.reasoning_parser is not None and parses:
            seq.output.reasoning = self.reasoning_parser.tracker(prompt)
            seq.grammar = seq.output.reasoning.first_grammar(seq.grammar)

    def take_tokens(self, seq: Sequence, tokens: list[tuple[int, SampledToken | None]]) -> int:
        """Appends `tokens` (each with its logprobs where any row of the step asked) in order
        until one ends the completion; returns how many it appended."""
        for taken, (token, sampled) in enumerate(tokens, start=1):
            self.append_token(seq, token, sampled)
            if seq.finish_reason is not None:
                return taken
        return len(tokens)

    def append_token(self, seq: Sequence, token: int, sampled: SampledToken | None) -> None:
        """Adds a sampled token (with its logprobs when the request asked) and decides
        whether the completion is done, and why. Only a request with stop strings (or whose
        reasoning markers are found by text) reads its text as it grows; the others' is
        decoded when they finish (`finish_texts`). A token of the reasoning section is not
        the grammar's."""
        seq.token_ids.append(token)
        seq.num_pending_tokens = 0
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        params, state = seq.sampling_params, seq.output
        if state.logprobs is not None:
            state.logprobs.append(self._logprob_dict(sampled, params.detokenize))
            state.cumulative_logprob += sampled.logprob
        reasoning = state.reasoning
        delta = state.detokenizer.add_token(token) if params.stop or (reasoning and reasoning.needs_text) else ""
        reasons = False
        if reasoning is not None and reasoning.phase is not Phase.ANSWER:
            reasons = reasoning.advance(token, seq.num_output_tokens, state.detokenizer.text)
            seq.grammar = reasoning.next_grammar(seq.grammar)
        if seq.grammar is not None and not reasons and self.stop_checker.grammar_ends(seq, token):
            return
        self.stop_checker.check(seq, token, delta)

    @staticmethod
    def extend_beam(beam: Sequence, continuation: Continuation) -> None:
        """Appends the token its beam group chose for a beam, with the candidates its parent
        reported and the continuation's summed log-probability."""
        beam.token_ids.append(continuation.token_id)
        beam.output.logprobs.append(continuation.candidates)
        beam.output.cumulative_logprob = continuation.cum_logprob
        if beam.metrics.first_token_time is None:
            beam.metrics.first_token_time = time.monotonic()

    def add_prompt_logprobs(self, found: dict[Sequence, list[tuple[int, SampledToken]]]) -> None:
        """Records the prompt logprobs a step computed: by sequence, (prompt position, entry)."""
        for seq, positions in found.items():
            for position, token in positions:
                seq.output.prompt_logprobs[position] = self._logprob_dict(token, seq.sampling_params.detokenize)

    def _logprob_dict(self, token: SampledToken, detokenize: bool) -> dict[int, Logprob]:
        """vLLM's logprobs entry: the top tokens plus the chosen one, each with its text
        (None without `detokenize`)."""
        def text(token_id: int) -> str | None:
            return self.tokenizer.decode([token_id]) if detokenize else None

        entry = {}
        for rank, (token_id, value) in enumerate(zip(token.top_ids, token.top_logprobs), start=1):
            entry[token_id] = Logprob(value, rank, text(token_id))
        if token.token_id not in entry:
            entry[token.token_id] = Logprob(token.logprob, token.rank, text(token.token_id))
        return entry

    @staticmethod
    def finish_texts(seqs: list[Sequence]) -> None:
        """Decodes the final texts of finished completions that asked for text, together
        (`finish_texts`); beams and pooled prompts have none."""
        finish_texts([(s.output.detokenizer, s.output_token_ids) for s in seqs
                      if s.beam is None and s.output is not None and s.sampling_params.detokenize])

    def output(self, seq: Sequence) -> RequestOutput | BeamSearchOutput | PoolingRequestOutput:
        """A finished request's output, given its first sequence: its beams for a beam
        search, its embedding or class probabilities for a pooling request, else
        `request_output`."""
        if seq.beam is not None:
            return seq.beam.output(self.tokenizer)
        if seq.pooling is not None:
            prompt_ids = seq.token_ids[: seq.num_prompt_tokens]
            if self.pooling_task == "classify":
                return ClassificationRequestOutput(seq.request_id, ClassificationOutput(seq.pooling.vector), prompt_ids)
            return EmbeddingRequestOutput(seq.request_id, EmbeddingOutput(seq.pooling.vector), prompt_ids)
        return self.request_output(seq)

    def request_output(self, seq: Sequence) -> RequestOutput:
        """The request's output: one CompletionOutput per completion, by index."""
        if seq.sampling_params.detokenize:
            self.finish_texts(seq.group)
        completions = [self._completion_output(s) for s in sorted(seq.group, key=lambda s: s.index)]
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            prompt_logprobs=seq.output.prompt_logprobs,
            outputs=completions,
            finished=seq.request_finished,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=seq.metrics,
            lora_request=seq.lora_request,
        )

    def _completion_output(self, seq: Sequence) -> CompletionOutput:
        """One completion, its reasoning and tool calls apart from its text where the
        engine parses them."""
        state = seq.output
        output = CompletionOutput(index=seq.index, text=state.detokenizer.text, token_ids=seq.output_token_ids,
                                  cumulative_logprob=state.cumulative_logprob, logprobs=state.logprobs,
                                  finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                  lora_request=seq.lora_request)
        if not seq.sampling_params.detokenize:
            return output
        parsed = parse_completion(output.text, output.token_ids, self.reasoning_parser, state.reasoning,
                                  self.tool_parser, seq.sampling_params.skip_special_tokens, state.tools)
        output.text, output.reasoning = parsed.text, parsed.reasoning
        output.num_reasoning_tokens, output.reasoning_ended = parsed.num_reasoning_tokens, parsed.reasoning_ended
        output.tool_calls, output.tool_call_error = parsed.tool_calls, parsed.tool_call_error
        return output


def resolve_reasoning_parser(name: str | None, tokenizer: PreTrainedTokenizerBase) -> ReasoningParser | None:
    """The `reasoning_parser` setting's parser; with 'auto', the one the tokenizer implies
    (logged), or none."""
    if name == "auto":
        found = detect_reasoning_parser(tokenizer)
        if found is None:
            return None
        name, why = found
        logger.info("reasoning_parser=%r: %s (reasoning_parser=None turns it off)", name, why)
    return reasoning_parser(name, tokenizer) if name is not None else None


def resolve_tool_parser(name: str | None, tokenizer: PreTrainedTokenizerBase) -> ToolParser | None:
    """The `tool_call_parser` setting's parser; with 'auto', the one the tokenizer's call
    markers imply (logged), or none."""
    if name == "auto":
        name = detect_tool_parser(tokenizer)
        if name is None:
            return None
        logger.info("tool_call_parser=%r: implied by the tokenizer's tool-call tokens (tool_call_parser=None turns "
                    "it off)", name)
    return tool_parser(name, tokenizer) if name is not None else None
