"""What every proposer shares: a sequence's recent acceptance, and the rule that keeps a
step's proposals only where they are worth their rows."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.core.sequence import Sequence
from engine.core.step_cost import StepTimes
from engine.reasoning import Phase
from engine.structured_output.backend_types import StructuredOutputGrammar

# A sequence's acceptance is followed over its recent steps: its counts weigh this much
# less at each step it decodes. The engine's, over all sequences, weigh this much less at
# each step: without proposals for a few hundred steps, it drifts back to one half, so
# that proposals that failed everywhere are tried again after a while.
_SEQUENCE_DECAY = 0.8
_ENGINE_DECAY = 0.99
# A sequence's rate starts from the engine's, worth this many proposed tokens of its own.
_PRIOR_WEIGHT = 2.0


@dataclass
class Acceptance:
    """Proposed and accepted tokens, counts that decay (`decay` at each `add`)."""

    decay: float
    proposed: float = 0.0
    accepted: float = 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed = self.proposed * self.decay + proposed
        self.accepted = self.accepted * self.decay + accepted

    def rate(self, prior: float, weight: float) -> float:
        """The chance that a next proposed token is accepted: the counts' rate, starting
        from `prior` worth `weight` proposed tokens."""
        return (self.accepted + prior * weight) / (self.proposed + weight)


@dataclass
class SpecState:
    """A sequence's speculation (`Sequence.spec`): the tokens proposed for its next step
    (`proposal`), and its recent acceptance (`recent`), counts that decay at each of its
    decode steps, so that a sequence whose proposals failed a while ago is tried again."""

    proposal: list[int] = field(default_factory=list)
    recent: Acceptance = field(default_factory=lambda: Acceptance(_SEQUENCE_DECAY))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Counts a decode step of `seq` (its tokens appended): `proposed` tokens verified,
        `accepted` of them accepted."""
        self.recent.add(proposed, accepted)


@dataclass
class Proposer(ABC):
    """Proposes tokens for each decoding sequence (`propose`, a method's own), then keeps
    those worth their rows: a proposed token is a row of the next step, worth the chance
    that it and the ones before it are accepted (the sequence's acceptance, its recent rate
    starting from the engine's, to the power of its place), and a row costs what the
    measured step times say (`StepTimes`). Proposals are kept, most promising first, while
    each adds more expected tokens per second than the step already makes: all of them for
    one sequence on a CPU, where a step's fixed cost dwarfs a row's, few in a large batch,
    where rows are most of the cost, none where they keep failing (a draft model that is
    seldom right). Until the step times tell the two costs apart, every other step keeps
    all proposals and the others none, so that they do."""

    config: SpeculativeConfig
    max_model_len: int
    # Decode steps' times, the last 64 (a step's cost changes as the contexts grow).
    step_times: StepTimes = field(default_factory=lambda: StepTimes(min_steps=8, min_spread=1.5, window=64))
    # Every sequence's proposals, over the last few hundred steps.
    overall: Acceptance = field(default_factory=lambda: Acceptance(_ENGINE_DECAY))
    _exploring: bool = False

    @abstractmethod
    def propose(self, seq: Sequence) -> None:
        """Sets the sequence's proposals for its next step (`SpecState.proposal`)."""

    def limit(self, seq: Sequence) -> int:
        """How many tokens the sequence may be proposed: none where it cannot speculate (beam
        search, pooling, a structured output still inside the model's reasoning), never past
        its last allowed token or the context. The step computes the last token and the
        proposals; the last one verified may add one more token."""
        if seq.beam is not None or seq.pooling is not None or not grammar_settled(seq):
            return 0
        room = min(seq.max_num_tokens, self.max_model_len) - seq.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def acceptance(self, seq: Sequence) -> float:
        """The chance that the sequence's next proposed token is accepted: its recent rate,
        starting from the engine's (which starts from one half)."""
        return seq.spec.recent.rate(self.overall.rate(0.5, _PRIOR_WEIGHT), _PRIOR_WEIGHT)

    def keep_worthwhile(self, seqs: list[Sequence]) -> None:
        """Trims the proposals of the sequences that decode next (`seqs`) to those worth
        their rows, or to none with more of them than `disable_by_batch_size`; a step of
        the engine's acceptance counts."""
        self.overall.add(0, 0)
        proposals = [(self.acceptance(seq) ** (j + 1), seq) for seq in seqs if seq.spec is not None
                     for j in range(len(seq.spec.proposal))]
        if not proposals:
            return
        limit = self.config.disable_by_batch_size
        if limit is not None and len(seqs) > limit:
            for _, seq in proposals:
                seq.spec.proposal.clear()
            return
        cost = self.step_times.fit()
        if cost is None:
            self._exploring = not self._exploring
            if not self._exploring:
                for _, seq in proposals:
                    seq.spec.proposal.clear()
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
            del seq.spec.proposal[count:]

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Counts a decode step of the sequence (its tokens appended): `proposed` tokens
        verified (maybe none), `accepted` of them accepted."""
        if seq.spec is not None:
            seq.spec.record(seq, proposed, accepted)
            self.overall.proposed += proposed
            self.overall.accepted += accepted


def grammar_settled(seq: Sequence) -> bool:
    """Whether the sequence's constraint, if it has one, applies to all its next tokens: its
    grammar runs (not waiting for the end of the model's reasoning)."""
    if seq.sampling_params.structured_outputs is None:
        return True
    reasoning = seq.output.reasoning
    return seq.grammar is not None and (reasoning is None or reasoning.phase is Phase.ANSWER)


def allowed_prefix(grammar: StructuredOutputGrammar, proposals: list[int]) -> int:
    """How many of the proposals, in order, the grammar allows (up to the one that completes
    it); the grammar is left as it was."""
    count = 0
    for token in proposals:
        if grammar.is_terminated or not grammar.accept(token):
            break
        count += 1
    grammar.rollback(count)
    return count
