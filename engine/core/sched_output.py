"""The contract between the scheduler and the worker side: what one step computes (vLLM's
`SchedulerOutput`). The worker reads this, never the scheduler itself."""

from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.multimodal.inputs import MultiModalFeature


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of its tokens to compute now.

    `forks` are (child, parent) pairs: new completions of a prompt that the parent
    finishes computing in this step; each samples its first token from the parent's
    logits. `block_copies` are (source, destination) blocks to copy before the step.
    `spec_token_ids` holds the proposed tokens that a speculating sequence's new tokens end
    with (speculative decoding): they are verified in the step, not yet its tokens.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    spec_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # prefix-cache hits of the requests admitted for the first time
    # Sequences that left the running set since the previous step (finished, preempted or
    # aborted): the model runner frees their rows of the persistent batch.
    released: list[Sequence] = field(default_factory=list)
    # The first block-table entry of each sequence that a block copied on write replaced
    # since the previous step: its row of the persistent batch is written again from there.
    rewritten_tables: dict[Sequence, int] = field(default_factory=dict)
    # Images whose encoder output the step computes first (each once), and the identifiers of
    # outputs the encoder cache evicted (`engine.core.encoder_cache_manager`).
    encoder_inputs: list[MultiModalFeature] = field(default_factory=list)
    freed_encoder_outputs: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)
