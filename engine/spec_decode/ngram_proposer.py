"""Prompt lookup (vLLM's "ngram" method): a sequence's next tokens proposed from its own
history. Summaries, extractions and rewrites copy spans of their input, and once their
last few tokens match an earlier span, the tokens that followed it are a good guess."""

from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.spec_decode.proposer import Proposer, SpecState, allowed_prefix


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
class NgramState(SpecState):
    """A sequence's acceptance and its n-gram index."""

    index: NgramIndex = field(default_factory=lambda: NgramIndex(5, 5))


class NgramProposer(Proposer):
    """Proposes the tokens that followed the last earlier match of a sequence's last
    tokens; with a grammar, only as many as it allows."""

    def propose(self, seq: Sequence) -> None:
        state = seq.spec
        if state is not None:
            state.proposal = []
        limit = self.limit(seq)
        if not limit:
            return
        if state is None:
            state = seq.spec = NgramState(index=NgramIndex(self.config.prompt_lookup_min,
                                                           self.config.prompt_lookup_max))
        proposal = state.index.lookup(seq.token_ids, limit)
        if seq.grammar is not None and proposal:
            del proposal[allowed_prefix(seq.grammar, proposal):]
        state.proposal = proposal
