"""The scheduler side of a draft model (vLLM's "draft_model" method): how many tokens each
sequence is proposed, and what the draft's cache holds of it. The draft itself runs in the
model runner (`engine.worker.draft_model_runner`), at the start of the step that verifies
its tokens, once the step's cache slots are given: the scheduler sees placeholders."""

from dataclasses import dataclass

from engine.core.sequence import Sequence
from engine.spec_decode.proposer import Proposer, SpecState

# A proposal the draft model has yet to make: the model runner replaces it before the
# step's inputs are laid out (an id no vocabulary has, should one ever reach a model).
UNDRAFTED = -1


@dataclass
class DraftState(SpecState):
    """A sequence's acceptance, and how many of its leading tokens have keys and values in
    the draft model's cache (which shares the sequence's block table)."""

    num_computed: int = 0

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Counts the step, and keeps only the draft's cache entries of tokens the sequence
        kept: the draft computed its proposals but the last, and the step's rejected ones
        and the token sampled after them are not the sequence's."""
        super().record(seq, proposed, accepted)
        self.num_computed = min(self.num_computed, seq.num_tokens - 1)


class DraftModelProposer(Proposer):
    """Sets each sequence's proposals to `limit` placeholders (`UNDRAFTED`), which the
    keep-worthwhile rule and the scheduler trim. A sequence with a structured output is not
    proposed any: its grammar could only judge the draft's tokens once they exist, after
    the step's rows are laid out."""

    def propose(self, seq: Sequence) -> None:
        limit = self.limit(seq) if seq.sampling_params.structured_outputs is None else 0
        if limit and seq.spec is None:
            seq.spec = DraftState()
        if seq.spec is not None:
            seq.spec.proposal = [UNDRAFTED] * limit
