"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each."""

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.block_manager import BlockManager
from engine.core.encoder_cache_manager import EncoderCacheManager
from engine.core.sched_output import ScheduledBatch
from engine.core.sequence import Sequence, SequenceStatus
from engine.multimodal.inputs import MultiModalFeature

if TYPE_CHECKING:  # the scheduler reads a resolved config; importing the scheduler loads no settings modules
    from engine.config import EngineConfig


class Scheduler:
    """Fills each step's token budget: running sequences first, then waiting ones.

    There is no separate prefill phase. A sequence advances its computed-token count
    toward its length; a prompt that does not fit the budget is computed in chunks over
    several steps. When a block cannot be had, the least important running sequence is
    preempted by recompute (its blocks freed, its progress reset) and waits at the head
    of the queue. A token still being sampled on the device (asynchronous scheduling)
    counts as present: its sequence's next step computes it, unless it is the last one
    the sequence may generate. "fcfs" ranks sequences by arrival, "priority" by (priority, arrival):
    lower values first. A waiting request whose LoRA adapter would exceed `max_loras`
    distinct adapters in the step is passed over, and requests behind it may run.

    A sequence with proposed tokens (speculative decoding) computes its last token and as
    many of them as the budget takes, in one step that verifies them; until the step's
    tokens are read back, only its last token counts as computed.

    A prompt's images are encoded in the first step that schedules any of their tokens
    (`encoder_cache`): a step encodes images of at most `encoder_budget` output rows
    (one image at least), and a chunk stops before an image whose output can be neither
    had nor computed in the step. An encoder-decoder sequence's clip (Whisper's) is encoded
    for the chunk that starts its decoder prompt (after admission, or after a preemption: such
    a sequence has no prefix-cache hits), which writes its cross-attention keys and values.
    """

    def __init__(self, config: "EngineConfig", block_manager: BlockManager,
                 encoder_cache: EncoderCacheManager | None = None, encoder_budget: int | None = None) -> None:
        """`config` is resolved (`EngineConfig.resolve`): the scheduler reads max_num_seqs,
        max_num_batched_tokens, enable_chunked_prefill, scheduling_policy and max_loras.
        `encoder_budget`: the encoder output rows a step may compute (default
        max_num_batched_tokens: a prompt item's rows take prompt positions; an encoder-decoder
        model's clips take none, and run several to a step under a larger one)."""
        self.config = config
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache
        self.encoder_budget = encoder_budget or config.max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.released: list[Sequence] = []
        self.num_preemptions = 0

    def _rank(self, seq: Sequence) -> tuple[int, int]:
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.seq_id)
        return (0, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self._rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The next step: running sequences first, then waiting ones while nothing was preempted.

        Raises:
            RuntimeError: nothing could be placed although requests wait (the KV cache is
                too small for the next one).
        """
        plan = _StepPlan(self.config.max_num_batched_tokens, self.encoder_budget)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        if (not plan.scheduled and not plan.preempted and self.has_unfinished()
                and not any(s.num_pending_tokens for s in (*self.running, *self.waiting))):
            raise RuntimeError(
                "the scheduler could not place any request: the KV cache is too small for "
                f"the next request ({self.waiting[0] if self.waiting else self.running[0]})"
            )
        copies, self.block_manager.pending_copies = self.block_manager.pending_copies, []
        rewritten, self.block_manager.rewritten_tables = self.block_manager.rewritten_tables, {}
        released, self.released = self.released, []
        freed = self.encoder_cache.take_freed() if self.encoder_cache is not None else []
        return ScheduledBatch(list(plan.scheduled), list(plan.scheduled.values()), block_copies=copies,
                              cached_prompt_tokens=plan.cached_prompt_tokens, released=released,
                              rewritten_tables=rewritten,
                              encoder_inputs=plan.encoder_inputs, freed_encoder_outputs=freed,
                              spec_token_ids=plan.spec_token_ids)

    def _schedule_running(self, plan: "_StepPlan") -> None:
        """Gives each running sequence its next tokens, in rank order, preempting the
        least important ones when blocks run out. (The loop runs over hundreds of
        sequences every step: what it reads repeatedly is held in locals.)"""
        running, allocate = self.running, self.block_manager.allocate
        i = 0
        while i < len(running) and plan.budget > 0:
            seq = running[i]
            # A beam's next token is its group's choice, made once every beam's candidates
            # are read back: its pending token is not its next input.
            pending = seq.num_pending_tokens
            num_tokens = len(seq.token_ids) + (pending if seq.beam is None else 0)
            start = seq.num_computed_tokens
            drafts = seq.spec.proposal if seq.spec is not None else []
            if drafts:
                seq.spec.proposal = []
                if start == num_tokens - 1:  # its last token computes with them (not a recompute)
                    num_tokens += len(drafts)
                else:
                    drafts = []
            # Nothing to compute: a beam awaiting its group's choice, a pooled prompt awaiting
            # its vector, or a pending token that is its last (it finishes when read back).
            if num_tokens == start or (pending and num_tokens >= seq.max_num_tokens):
                i += 1
                continue
            num_new, images = min(num_tokens - start, plan.budget), []
            if seq.encoder_features:
                num_new, images = self._encoder_work(seq, start, num_new, plan)
                if num_new == 0:
                    i += 1  # its next tokens are an image the step cannot encode
                    continue
            if allocate(seq, num_new):
                if seq.encoder_features:
                    self._take_encoder_outputs(seq, start, num_new, images, plan)
                plan.add(seq, num_new, drafts)
                i += 1
            else:
                i = self._preempt_for(seq, num_new, images, i, plan, drafts)

    def _preempt_for(self, seq: Sequence, num_new: int, images: list[MultiModalFeature], i: int,
                     plan: "_StepPlan", drafts: list[int]) -> int:
        """Preempts the least important running sequences until `seq` (running[i]) gets its
        blocks, or is preempted itself; returns the index of the next sequence to schedule."""
        while not self.block_manager.allocate(seq, num_new):
            victim = max(self.running, key=self._rank)
            self._preempt(victim)
            plan.preempted = True
            if victim in plan.scheduled:
                plan.budget += plan.scheduled.pop(victim)
                plan.spec_token_ids.pop(victim, None)
                i -= 1
            if victim is seq:
                return i
        if seq.encoder_features:
            self._take_encoder_outputs(seq, seq.num_computed_tokens, num_new, images, plan)
        plan.add(seq, num_new, drafts)
        return i + 1

    def _schedule_waiting(self, plan: "_StepPlan") -> None:
        """Admits waiting sequences in rank order while the budget, max_num_seqs, max_loras
        and the free blocks allow, reusing cached prefix blocks."""
        if not self.waiting:
            return
        adapters = {s.lora_int_id for s in self.running} - {None}
        counted: set = set()  # beam groups whose rows are counted
        num_seqs = sum(_rows_reserved(s, counted) for s in self.running)
        index = 0
        while index < len(self.waiting) and plan.budget > 0:
            seq = self.waiting[index]
            if seq.num_pending_tokens:
                break  # preempted while its token was being sampled: it recomputes once the token is back
            rows = _rows_reserved(seq, set(counted))
            if num_seqs and num_seqs + rows > self.config.max_num_seqs:
                break
            if seq.lora_int_id is not None and seq.lora_int_id not in adapters and len(adapters) >= self.config.max_loras:
                index += 1
                continue
            cached = [] if seq.computes_whole_prompt else self.block_manager.find_cached_blocks(seq)
            start = len(cached) * self.block_manager.block_size
            num_new = seq.num_tokens - start
            if num_new > plan.budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = plan.budget
            wanted = num_new
            num_new, images = self._encoder_work(seq, start, num_new, plan)
            if num_new == 0 or (num_new < wanted and not self.config.enable_chunked_prefill):
                break
            if not self.block_manager.allocate(seq, num_new, cached):
                break
            self._take_encoder_outputs(seq, start, num_new, images, plan)
            self.waiting.pop(index)
            if seq.lora_int_id is not None:
                adapters.add(seq.lora_int_id)
            self._admit(seq, len(cached) * self.block_manager.block_size, plan)
            num_seqs += _rows_reserved(seq, counted)
            plan.add(seq, num_new)

    def _encoder_work(self, seq: Sequence, start: int, num_new: int,
                      plan: "_StepPlan") -> tuple[int, list[MultiModalFeature]]:
        """How many of `num_new` tokens from `start` the step can compute given their
        images, and the images it must encode for them: the chunk stops before the first
        image that is not held and does not fit the step's encoder budget (the first image
        of a step always does) or the cache (without evicting the held images it reads)."""
        images = _items_in(seq, start, num_new)
        if not images:
            return num_new, []
        cache = self.encoder_cache
        held = {f.identifier for f in images if cache.has(f)}
        todo: list[MultiModalFeature] = []
        budget = plan.encoder_budget
        for feature in images:
            if feature.identifier in held or any(f.identifier == feature.identifier for f in todo):
                continue
            first = not plan.encoder_inputs and not todo
            rows = feature.num_embeds
            if (rows > budget and not first) or not cache.can_hold(sum(f.num_embeds for f in todo) + rows, held):
                return max(0, feature.offset - start), todo
            todo.append(feature)
            budget -= rows
        return num_new, todo

    def _take_encoder_outputs(self, seq: Sequence, start: int, num_new: int, todo: list[MultiModalFeature],
                              plan: "_StepPlan") -> None:
        """Records that the scheduled chunk reads its images' outputs (the held ones first,
        so that making room for the others cannot evict them), computing `todo` in the step."""
        cache = self.encoder_cache
        for feature in _items_in(seq, start, num_new):
            if cache.has(feature):
                cache.use(seq, feature)
        for feature in todo:
            if cache.has(feature):  # the same image twice in the prompt
                cache.use(seq, feature)
                continue
            cache.allocate(seq, feature)
            plan.encoder_inputs.append(feature)
            plan.encoder_budget -= feature.num_embeds

    def _admit(self, seq: Sequence, num_cached: int, plan: "_StepPlan") -> None:
        """Moves a waiting sequence whose blocks were allocated into the running set; its
        first admission records its prefix-cache hits."""
        seq.num_computed_tokens = num_cached
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.monotonic()
            seq.num_cached_tokens = num_cached
            plan.cached_prompt_tokens += num_cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.released.append(seq)
        self.block_manager.free(seq)
        self._release_images(seq)
        seq.num_computed_tokens = 0
        # Its proposals and its proposer's state (a draft model's cache entries) go with its blocks.
        seq.spec = None
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _release_images(self, seq: Sequence) -> None:
        """A sequence that left the running set needs none of its items' outputs any more."""
        if seq.encoder_features:
            self.encoder_cache.release(seq)

    def update_computed(self, batch: ScheduledBatch) -> None:
        """Records that the step computed its tokens' keys and values; a speculating
        sequence's proposals count once they are accepted (`update_accepted`)."""
        spec = batch.spec_token_ids
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            self._computed(seq, num_new - len(spec[seq]) if spec and seq in spec else num_new)
            if seq.encoder_features:
                self.encoder_cache.release_computed(seq)

    def update_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Counts as computed the keys and values of the proposals a sequence's step accepted
        (`engine.sample.rejection_sampler`; they are its tokens now), registering the blocks
        they fill; the rejected ones' slots are written again later."""
        if num_accepted:
            self._computed(seq, num_accepted)

    def _computed(self, seq: Sequence, num_new: int) -> None:
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens // self.block_manager.block_size > seq.blocks.num_registered:  # a block filled up
            self.block_manager.register_full_blocks(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adds a forked sequence that already holds its (shared) blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Retires a sequence and releases its blocks. It is running, or waiting after a
        preemption that came while its last token was being sampled."""
        self._remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the running set (freeing its blocks and its batch row)
        or out of the waiting queue."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.released.append(seq)
            self.block_manager.free(seq)
            self._release_images(seq)
        else:
            self.waiting.remove(seq)

    def abort_seq_group(self, request_id: str) -> list[Sequence]:
        """Drops every sequence of one request, waiting or running, freeing the blocks of
        the running ones; returns them, finished with finish_reason "abort"."""
        aborted = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for seq in aborted:
            self._remove(seq)
            _mark_aborted(seq)
        return aborted

    def abort_all(self) -> None:
        """Forgets every request, freeing the blocks of the running ones; all of their
        sequences end finished (finish_reason "abort"), the waiting ones included."""
        for seq in self.running:
            self.block_manager.free(seq)
            self._release_images(seq)
        self.released += self.running
        for seq in (*self.waiting, *self.running):
            _mark_aborted(seq)
        self.running.clear()
        self.waiting.clear()


def _rows_reserved(seq: Sequence, counted: set) -> int:
    """Rows of the batch that `seq` holds or will hold: itself and the completions it has
    yet to fork; for a beam, the whole group's beam_width once (`counted` holds the groups
    already counted, and gains this one)."""
    if seq.beam is None:
        return 1 + seq.num_pending_children
    if seq.beam in counted:
        return 0
    counted.add(seq.beam)
    return seq.beam.params.beam_width


def _items_in(seq: Sequence, start: int, num_new: int) -> list[MultiModalFeature]:
    """The items whose encoder outputs the chunk [start, start + num_new) of `seq` reads: the
    images with tokens among those positions, and a chunk that starts the decoder prompt of an
    encoder-decoder sequence its cross-attention items."""
    images = [f for f in seq.mm_features if f.offset < start + num_new and f.end > start]
    return images + seq.cross_features if start == 0 else images


def _mark_aborted(seq: Sequence) -> None:
    """Finishes a sequence that was dropped; a parent not yet forked forks no more."""
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason = "abort"
    seq.num_pending_children = 0


@dataclass
class _StepPlan:
    """The step being filled: tokens per scheduled sequence, the token budget left, the
    encoder budget left (output rows) and the images to encode, whether a sequence was
    preempted, and the prefix-cache hits of first admissions."""

    budget: int
    encoder_budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)
    spec_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    encoder_inputs: list[MultiModalFeature] = field(default_factory=list)
    preempted: bool = False
    cached_prompt_tokens: int = 0

    def add(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> None:
        """Schedules `num_new` tokens of `seq`; with `drafts` (its proposals), they end
        with as many of them as fit."""
        self.scheduled[seq] = num_new
        self.budget -= num_new
        if drafts and num_new > 1:
            self.spec_token_ids[seq] = drafts[: num_new - 1]
