"""Speculative verification (vLLM's `v1/sample/rejection_sampler.py`): what each row of a
speculating sequence's step samples with, and which of its proposed tokens the samples accept.

The step computes the sequence's last token and its proposals, and each of those rows
samples the target model's next token as if the proposals before it were already the
sequence's tokens (`ProposalRow`: penalties count them, min_tokens and bad words see them, a
seeded row draws with the uniform number of its own token index). A proposal is accepted
while every one before it was and the token sampled at its row equals it (`num_accepted`);
the sequence takes the accepted tokens and the one sampled after them: the target's own
token where a proposal went wrong, or a token more after them all. So an accepted row
sampled exactly what the sequence would have sampled one step at a time, and speculation
changes how fast a completion comes, never what it is.

Sampling is a low tier: this module reads plain data (token ids, and sequences through
`SampledSequence`). The engine hands the kept tokens to the output processor, which may stop
the completion before the last of them; the scheduler counts the accepted proposals' keys
and values as computed (`Scheduler.update_accepted`), the proposer their rate.
"""

from typing import Any, Protocol


class SampledSequence(Protocol):
    """A sequence as its sampling rows read it (`engine.core.sequence.Sequence`)."""

    token_ids: list[int]
    num_prompt_tokens: int


class ProposalRow:
    """`seq` followed by `proposed` (its first proposals), read like a `Sequence` by the
    sampling-metadata builder; every other attribute is the sequence's own."""

    def __init__(self, seq: SampledSequence, proposed: list[int]) -> None:
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


def sampling_rows(seqs: list[SampledSequence], offsets: list[int] | None,
                  proposals: dict[SampledSequence, list[int]]) -> list[SampledSequence | ProposalRow]:
    """The step's sampling rows as the metadata builder reads them: each sequence itself,
    or for row `offsets[i]` > 0 of a speculating one, the sequence with its first
    `offsets[i]` proposals."""
    if offsets is None:
        return seqs
    return [seq if j == 0 else ProposalRow(seq, proposals[seq][:j]) for seq, j in zip(seqs, offsets)]


def num_accepted(proposed: list[int], sampled: list[int]) -> int:
    """How many of a sequence's proposals its step accepts, given the token its row j
    sampled (`sampled[j]`, after its first j proposals; one more row than proposals): the
    longest run of proposals, from the first, that equal the tokens sampled at their rows.
    The sequence keeps `sampled[: num_accepted + 1]`."""
    for j, token in enumerate(proposed):
        if sampled[j] != token:
            return j
    return len(proposed)
