"""Prompt lookup (vLLM's "ngram" method): a sequence's next tokens proposed from its own
history. Summaries, extractions and rewrites copy spans of their input, and once their
last few tokens match an earlier span, the tokens that followed it are a good guess."""

from dataclasses import dataclass

from engine.core.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig

# Acceptance is followed over the recent proposals: each verification's counts weigh this
# much less at the next one.
_DECAY = 0.8
# Proposed tokens (decayed) before the acceptance rate is trusted to pause a sequence, and
# the output tokens it then generates without proposing.
_EVIDENCE = 8.0
_PAUSE_TOKENS = 16


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
    """A sequence's speculation: its n-gram index, its recent acceptance (decayed counts)
    and the output length before which it does not propose (after a run of rejections)."""

    index: NgramIndex
    proposed: float = 0.0
    accepted: float = 0.0
    paused_until: int = 0

    def record(self, proposed: int, accepted: int, num_output_tokens: int, min_rate: float) -> None:
        """Counts one verification; pauses the sequence when its proposals keep failing."""
        self.proposed = self.proposed * _DECAY + proposed
        self.accepted = self.accepted * _DECAY + accepted
        if self.proposed >= _EVIDENCE and self.accepted < min_rate * self.proposed:
            self.paused_until = num_output_tokens + _PAUSE_TOKENS
            self.proposed = self.accepted = 0.0


@dataclass
class NgramProposer:
    """Proposes up to `num_speculative_tokens` tokens per sequence and step."""

    config: SpeculativeConfig
    max_model_len: int

    def propose(self, seq: Sequence) -> list[int]:
        """The sequence's proposals for its next step: none for a sequence that cannot
        speculate (beam search, pooling, a structured output, paused), and never past its
        last allowed token or the context."""
        if seq.beam is not None or seq.pooling is not None or seq.sampling_params.structured_outputs is not None:
            return []
        state = seq.spec
        if state is None:
            state = seq.spec = SpecState(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        if seq.num_output_tokens < state.paused_until:
            return []
        # The step computes the last token and the proposals; the last one verified may
        # add one more token, which must stay within max_num_tokens and the context.
        room = min(seq.max_num_tokens, self.max_model_len) - seq.num_tokens - 1
        limit = min(self.config.num_speculative_tokens, room)
        return state.index.lookup(seq.token_ids, limit) if limit > 0 else []

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Counts a verification of the sequence's proposals."""
        seq.spec.record(proposed, accepted, seq.num_output_tokens, self.config.min_acceptance_rate)
