"""Prompt lookup (vLLM's "ngram" method): a sequence's next tokens proposed from its own
history. Summaries, extractions and rewrites copy spans of their input, and once their
last few tokens match an earlier span, the tokens that followed it are a good guess."""

from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.reasoning import Phase
from engine.structured_output.backend_types import StructuredOutputGrammar
from engine.spec_decode.config import SpeculativeConfig
from engine.step_cost import StepTimes

# A sequence's acceptance is followed over its recent steps: its counts weigh this much
# less at each step it decodes.
_DECAY = 0.8

class NgramIndex:
    """Where each n-gram of a sequence's tokens (n in [low, high]) last occurred, as the
    position just after it; built as the tokens grow, each n-gram indexed once."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(low, high + 1)}
        self.indexed = 0  # n-grams ending before this position are indexed

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the last earlier occurrence of the longest
        suffix of `tokens` (of `low` to `high` tokens) that occurred before; none without one."""
        end = len(tokens) - 1  # n-grams ending before the last token have a continuation
        for stop in range(self.indexed, end):
            for n, table in self.after.items():
                if stop + 1 >= n:
                    table[tuple(tokens[stop + 1 - n : stop + 1])] = stop + 1
        self.indexed = max(self.indexed, end)
        for n in range(min(self.high, len(tokens) - 1), self.low - 1, -1):
            start = self.after[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + limit]
        return []


@dataclass
class SpecState:
    """A sequence's speculation: its n-gram index and its recent acceptance, as counts that
    decay at each of its decode steps, so that a sequence whose proposals failed a while ago
    is tried again."""

    index: NgramIndex
    proposed: float = 0.0
    accepted: float = 0.0

    @property
    def acceptance(self) -> float:
        """The chance that its next proposed token is accepted (its recent rate, starting
        from one half)."""
        return (self.accepted + 1) / (self.proposed + 2)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed = self.proposed * _DECAY + proposed
        self.accepted = self.accepted * _DECAY + accepted


@dataclass
class NgramProposer:
    """Proposes tokens for each decoding sequence, then keeps those worth their rows: a
    proposed token is a row of the next step, worth the chance that it and the ones before
    it are accepted (`SpecState.acceptance` to the power of its place), and a row costs what
    the measured step times say (`StepTimes`). Proposals are kept, most promising first,
    while each adds more expected tokens per second than the step already makes: all of
    them for one sequence on a CPU, where a step's fixed cost dwarfs a row's, few in a
    large batch, where rows are most of the cost. Until the step times tell the two costs
    apart, every other step keeps all proposals and the others none, so that they do."""

    config: SpeculativeConfig
    max_model_len: int
    # Decode steps' times, the last 64 (a step's cost changes as the contexts grow).
    step_times: StepTimes = field(default_factory=lambda: StepTimes(min_steps=8, min_spread=1.5, window=64))
    _exploring: bool = False

    def propose(self, seq: Sequence) -> None:
        """Sets the sequence's proposals for its next step: none for a sequence that cannot
        speculate (beam search, pooling, a structured output still inside the model's
        reasoning), never past its last allowed token or the context, and with a grammar,
        only as many as it allows."""
        seq.spec_token_ids = []
        if seq.beam is not None or seq.pooling is not None or not _grammar_settled(seq):
            return
        state = seq.spec
        if state is None:
            state = seq.spec = SpecState(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        # The step computes the last token and the proposals; the last one verified may
        # add one more token, which must stay within max_num_tokens and the context.
        room = min(seq.max_num_tokens, self.max_model_len) - seq.num_tokens - 1
        limit = min(self.config.num_speculative_tokens, room)
        if limit > 0:
            seq.spec_token_ids = state.index.lookup(seq.token_ids, limit)
        if seq.grammar is not None and seq.spec_token_ids:
            del seq.spec_token_ids[_allowed_prefix(seq.grammar, seq.spec_token_ids):]

    def keep_worthwhile(self, seqs: list[Sequence]) -> None:
        """Trims the proposals of the sequences that decode next (`seqs`) to those worth
        their rows."""
        proposals = [(seq.spec.acceptance ** (j + 1), seq) for seq in seqs if seq.spec_token_ids
                     for j in range(len(seq.spec_token_ids))]
        if not proposals:
            return
        cost = self.step_times.fit()
        if cost is None:
            self._exploring = not self._exploring
            if not self._exploring:
                for _, seq in proposals:
                    seq.spec_token_ids.clear()
            return
        fixed, per_row = cost.overhead_s, cost.per_row_s
        rows = tokens = float(len(seqs))
        kept = dict.fromkeys((seq for _, seq in proposals), 0)
        for gain, seq in sorted(proposals, key=lambda p: -p[0]):
            if gain * (fixed + per_row * rows) <= per_row * tokens:
                break
            rows, tokens = rows + 1, tokens + gain
            kept[seq] += 1
        for seq, count in kept.items():
            del seq.spec_token_ids[count:]

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Counts a decode step of the sequence: `proposed` tokens verified (maybe none),
        `accepted` of them accepted."""
        if seq.spec is not None:
            seq.spec.record(proposed, accepted)


def _grammar_settled(seq: Sequence) -> bool:
    """Whether the sequence's constraint, if it has one, applies to all its next tokens: its
    grammar runs (not waiting for the end of the model's reasoning)."""
    if seq.sampling_params.structured_outputs is None:
        return True
    return seq.grammar is not None and (seq.reasoning is None or seq.reasoning.phase is Phase.ANSWER)


def _allowed_prefix(grammar: StructuredOutputGrammar, proposals: list[int]) -> int:
    """How many of the proposals, in order, the grammar allows (up to the one that completes
    it); the grammar is left as it was."""
    count = 0
    for token in proposals:
        if grammar.is_terminated or not grammar.accept(token):
            break
        count += 1
    grammar.rollback(count)
    return count
