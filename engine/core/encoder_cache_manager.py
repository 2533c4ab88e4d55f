"""Which images' encoder outputs the model runner holds (vLLM's `EncoderCacheManager`): the
scheduler's bookkeeping of the encoder cache, in rows of encoder output.

An image's output is computed once, when a step first schedules any of its tokens, and kept
while a sequence still has tokens of it to compute: a prompt chunked inside its image tokens
reads the rest in later steps, and two prompts with the same image (same content hash) share
one output. Once no sequence needs it an output stays cached, least recently released first
out, until its rows are wanted for another: a preempted sequence that recomputes, or a later
prompt with the same image, then does not run the encoder again.

An encoder-decoder model's clip (Whisper's, `Sequence.cross_features`) is needed by the step that
starts its decoder prompt, which writes the clip's rows into the sequence's cross-attention
blocks; it is released once that step is computed, and stays cached like an image.
"""

from collections import OrderedDict
from collections.abc import Iterator

from engine.core.sequence import Sequence
from engine.multimodal.inputs import MultiModalFeature


class EncoderCacheManager:
    """Encoder outputs held, by image identifier, within `capacity` rows."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: dict[str, int] = {}  # identifier -> rows held
        self.users: dict[str, set[int]] = {}  # identifier -> ids of the sequences that still need it
        self.unused: OrderedDict[str, None] = OrderedDict()  # held, needed by none: evictable, oldest first
        self.freed: list[str] = []  # evicted since the last step was scheduled: the runner drops them
        # Allocated in the step being scheduled: computed by it, so never evicted before it runs
        # (a sequence preempted in the same step leaves its new outputs unused).
        self.scheduled: set[str] = set()

    @property
    def num_free_rows(self) -> int:
        return self.capacity - sum(self.rows.values())

    def has(self, feature: MultiModalFeature) -> bool:
        """Whether the image's output is held (or scheduled to be computed this step)."""
        return feature.identifier in self.rows

    def can_hold(self, rows: int, keep: set[str]) -> bool:
        """Whether outputs of `rows` rows in all fit once the unused outputs other than
        `keep` (those the asking sequence is about to use) are evicted."""
        return rows <= self.num_free_rows + sum(self.rows[i] for i in self._evictable() if i not in keep)

    def allocate(self, seq: Sequence, feature: MultiModalFeature) -> None:
        """Makes room for the image's output (it is computed this step) and marks `seq` as
        needing it. Assumes `can_hold` for its rows."""
        evictable = self._evictable()
        while self.num_free_rows < feature.num_embeds:
            evicted = next(evictable)
            del self.unused[evicted], self.rows[evicted], self.users[evicted]
            self.freed.append(evicted)
        self.rows[feature.identifier] = feature.num_embeds
        self.scheduled.add(feature.identifier)
        self.users[feature.identifier] = set()
        self.use(seq, feature)

    def use(self, seq: Sequence, feature: MultiModalFeature) -> None:
        """Marks `seq` as needing a held output."""
        self.users[feature.identifier].add(seq.seq_id)
        self.unused.pop(feature.identifier, None)

    def release_computed(self, seq: Sequence) -> None:
        """Releases the images whose tokens `seq` has all computed, and its cross-attention
        items once its decoder has started (their rows are in its cross blocks then)."""
        for feature in seq.mm_features:
            if feature.end <= seq.num_computed_tokens:
                self._release(seq, feature)
        if seq.num_computed_tokens:
            for feature in seq.cross_features:
                self._release(seq, feature)

    def release(self, seq: Sequence) -> None:
        """Releases every item of a sequence that finished, was aborted or was preempted."""
        for feature in seq.encoder_features:
            self._release(seq, feature)

    def take_freed(self) -> list[str]:
        """The outputs evicted while the step was scheduled; the step is then complete."""
        freed, self.freed = self.freed, []
        self.scheduled.clear()
        return freed

    def _evictable(self) -> Iterator[str]:
        """The unused outputs that may go, oldest first."""
        return (i for i in list(self.unused) if i not in self.scheduled)

    def _release(self, seq: Sequence, feature: MultiModalFeature) -> None:
        users = self.users.get(feature.identifier)
        if users is None or seq.seq_id not in users:
            return
        users.discard(seq.seq_id)
        if not users:
            self.unused[feature.identifier] = None
