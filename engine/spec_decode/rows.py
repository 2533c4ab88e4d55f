"""What a verification row of a speculating sequence samples with: the sequence as if its
proposals before that row were already its tokens (penalties count them, min_tokens and bad
words see them, a seeded row draws with the uniform number of its own token index), so that
an accepted row samples exactly what the sequence would have sampled one step at a time."""

from typing import Any

from engine.core.sequence import Sequence


class ProposalRow:
    """`seq` followed by `proposed` (its first proposals), read like a `Sequence` by the
    sampling-metadata builder; every other attribute is the sequence's own."""

    def __init__(self, seq: Sequence, proposed: list[int]) -> None:
        self.seq = seq
        self.proposed = proposed
        self.token_ids = seq.token_ids + proposed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.seq, name)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.seq.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.seq.num_prompt_tokens :]


def sampling_rows(seqs: list[Sequence], offsets: list[int] | None,
                  proposals: dict[Sequence, list[int]]) -> list["Sequence | ProposalRow"]:
    """The step's sampling rows as the metadata builder reads them: each sequence itself,
    or for row `offsets[i]` > 0 of a speculating one, the sequence with its first
    `offsets[i]` proposals."""
    if offsets is None:
        return seqs
    return [seq if j == 0 else ProposalRow(seq, proposals[seq][:j]) for seq, j in zip(seqs, offsets)]
