"""The persistent batch: the running sequences' rows kept between steps, and each step's
model inputs built from them.

A running sequence holds a row (`BatchRow`) of two device tensors: its block table,
written only where it grew or a block was copied on write, and the token it sampled last,
written by the sampler on the device. A step's inputs are then a handful of
list comprehensions over its sequences and a few tensor operations, instead of Python
work per token; and a token still being sampled on the device (asynchronous scheduling)
becomes the next step's input there, without a round trip through the host.
"""

import array
import bisect
import itertools
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.attention.layer import AttentionMetadata, cross_attention_metadata
from engine.core.sched_output import ScheduledBatch
from engine.core.sequence import Sequence
from engine.lora.slots import LoRARange
from engine.multimodal.inputs import MultiModalFeature


@dataclass
class BatchRow:
    """A running sequence's row of the persistent batch: its index in the batch's tensors
    (`slot`), how many leading entries of its block table the row holds, and for a prompt
    pooled over several steps, its MEAN or CLS state so far (`Pooler.update`). An
    encoder-decoder sequence's cross table is written when its row is made (its cross blocks
    do not change while it runs)."""

    slot: int
    num_blocks: int = 0
    pooling_state: torch.Tensor | None = None


@dataclass
class PromptRows:
    """A sequence's rows in the step whose next prompt token needs its logprobs."""

    seq: Sequence
    first_row: int
    first_position: int
    count: int


@dataclass
class PoolRows:
    """A pooling sequence's rows in the step; `last` when they end its prompt."""

    seq: Sequence
    first_row: int
    first_position: int
    count: int
    last: bool


@dataclass
class ImageRows:
    """The rows of a step that read an image's encoder output: step `rows` take output
    rows [first, last) of `feature`."""

    feature: MultiModalFeature
    rows: list[int]
    first: int
    last: int


@dataclass(frozen=True)
class KeptRows:
    """The rows of a step whose final hidden states are read (to sample, for prompt
    logprobs, to pool), ascending, where they are fewer than all: the last layer then
    computes its attention output, MLP and final norm for these rows alone, and the
    forward pass returns them in this order. `rows` None: every row, in step order."""

    rows: list[int] | None = None
    index: torch.Tensor | None = None  # `rows` on the device

    @classmethod
    def of(cls, wanted: Iterable[int], num_tokens: int, device: torch.device) -> "KeptRows":
        """The rows in `wanted`; at least the last one, so that no product runs on no rows."""
        rows = sorted(set(wanted)) or [num_tokens - 1]
        if len(rows) == num_tokens:
            return cls()
        return cls(rows, upload(rows, torch.long, device))

    def positions(self, rows: list[int]) -> list[int]:
        """Where kept rows `rows` are in the forward pass's output."""
        if self.rows is None:
            return rows
        return [bisect.bisect_left(self.rows, row) for row in rows]

    def span(self, first_row: int, count: int) -> slice:
        """Where the kept rows among rows [first_row, first_row + count) are in the output."""
        if self.rows is None:
            return slice(first_row, first_row + count)
        return slice(bisect.bisect_left(self.rows, first_row), bisect.bisect_left(self.rows, first_row + count))


@dataclass
class StepInputs:
    """One step's rows on the device: each sequence's new tokens back to back.

    `sample_seqs[i]` samples from row `sample_rows[i]` (a forked child from its parent's
    last row); a speculating sequence samples from its last token's row and each of its
    proposals' rows, in order (`spec_token_ids`: its proposals, `sample_offsets[i]`: how many
    of them precede row i). `lora_ranges` are the runs of rows that share an adapter slot.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    num_tokens: int
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    spec_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    sample_offsets: list[int] | None = None  # None: no speculating sequence, every offset 0
    prompt_rows: list[PromptRows] = field(default_factory=list)
    pool_rows: list[PoolRows] = field(default_factory=list)
    lora_ranges: list[LoRARange] = field(default_factory=list)
    kept: KeptRows = field(default_factory=KeptRows)
    # Rows whose input id is a token still being sampled, and the batch slots it lands in.
    pending_rows: torch.Tensor | None = None
    pending_slots: torch.Tensor | None = None
    image_rows: list[ImageRows] = field(default_factory=list)
    # [3, num_tokens] rotary positions of an M-RoPE model (None: `positions`).
    rope_positions: torch.Tensor | None = None
    cross: "CrossRows | None" = None  # an encoder-decoder model's cross-attention rows


@dataclass
class CrossRows:
    """A step's cross-attention rows (an encoder-decoder model's): `meta` reads each decoder
    row's encoder keys (see `CrossInputs`); `written` are the items whose encoder outputs the
    step writes to their sequences' cross blocks, at `writes.slot_mapping`, in that order."""

    meta: AttentionMetadata
    written: list[MultiModalFeature] = field(default_factory=list)
    writes: AttentionMetadata | None = None



# Array type codes of the dtypes that host lists are uploaded as.
_ARRAY_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f"}


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`. A flat list of numbers goes through an
    `array.array`, five times faster than `torch.tensor` (which inspects every element's
    type: 26 us for 256 ints, a tenth of a decode step's host work when it was called
    eight times a step). To a GPU it goes through pinned memory with a non-blocking copy:
    a copy from pageable memory would wait for the GPU to finish the work queued before
    it, which is what asynchronous scheduling must never do."""
    typecode = _ARRAY_TYPECODES.get(dtype)
    try:
        host = torch.frombuffer(array.array(typecode, values), dtype=dtype) if typecode and values else None
    except TypeError:  # nested lists
        host = None
    if host is None:
        host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class InputBatch:
    """Rows of up to `max_num_seqs` running sequences, and the step inputs built from them."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                 uses_mrope: bool = False, max_cross_rows: int = 0) -> None:
        """`uses_mrope`: the model's rotary positions are [3, tokens] (see `_rope_positions`);
        `max_cross_rows`: an encoder-decoder model's most encoder rows per sequence (0 for
        the others), which its cross tables hold."""
        self.block_size = block_size
        self.device = device
        self.uses_mrope = uses_mrope
        max_blocks = -(-max_model_len // block_size)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
        self.cross_tables = (torch.zeros(max_num_seqs, -(-max_cross_rows // block_size), dtype=torch.int32,
                                         device=device) if max_cross_rows else None)
        self.last_token_ids = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.rows: dict[Sequence, BatchRow] = {}

    def fill_pending(self, step: StepInputs) -> None:
        """Puts the tokens still being sampled when the step was prepared into its input
        ids: device work, queued after the sampling that writes them."""
        if step.pending_rows is not None:
            step.input_ids[step.pending_rows] = self.last_token_ids[step.pending_slots]

    def release(self, seqs: list[Sequence]) -> None:
        """Frees the rows of sequences that left the running set."""
        for seq in seqs:
            row = self.rows.pop(seq, None)
            if row is not None:
                self._free_slots.append(row.slot)

    def rewind_tables(self, rewritten: dict[Sequence, int]) -> None:
        """Marks the block-table entries that blocks copied on write replaced (by sequence,
        the first one) as not held by the sequences' rows, so that `sync_rows` writes them."""
        for seq, index in rewritten.items():
            row = self.rows.get(seq)
            if row is not None:
                row.num_blocks = min(row.num_blocks, index)

    def slots(self, seqs: list[Sequence]) -> list[int]:
        """The rows of the sequences, which hold them."""
        rows = self.rows
        return [rows[seq].slot for seq in seqs]

    def sync_rows(self, seqs: list[Sequence]) -> None:
        """Gives a row to each sequence that has none, and writes the block-table entries
        that changed since the sequences' last step."""
        slots, cols, values = [], [], []
        rows = self.rows
        for seq in seqs:
            row = rows.get(seq)
            if row is None:
                row = rows[seq] = BatchRow(self._free_slots.pop())
                if seq.blocks.cross:
                    self.cross_tables[row.slot, : len(seq.blocks.cross)] = upload(seq.blocks.cross, torch.int32,
                                                                                  self.device)
            have, table = row.num_blocks, seq.blocks.table
            if have < len(table):
                slots += [row.slot] * (len(table) - have)
                cols += range(have, len(table))
                values += table[have:]
                row.num_blocks = len(table)
        if slots:
            index = (upload(slots, torch.long, self.device), upload(cols, torch.long, self.device))
            self.block_tables.index_put_(index, upload(values, torch.int32, self.device))

    def prepare(self, batch: ScheduledBatch, lora_slots: dict[int, int]) -> StepInputs:
        """The step's inputs. Sequences are grouped by adapter slot (`lora_slots`, by
        adapter id) so that an adapter's delta is one product per projection."""
        seqs, nums = batch.seqs, batch.num_new_tokens
        if lora_slots:
            order = sorted(range(len(seqs)), key=lambda i: lora_slots.get(seqs[i].lora_int_id, -1))
            seqs, nums = [seqs[i] for i in order], [nums[i] for i in order]
        self.sync_rows(seqs + [child for child, _ in batch.forks] if batch.forks else seqs)

        device = self.device
        starts = [seq.num_computed_tokens for seq in seqs]
        ends = list(itertools.accumulate(nums))
        context_lens = list(map(operator.add, starts, nums))
        spec = batch.spec_token_ids
        known = [len(seq.token_ids) + len(spec.get(seq, ())) for seq in seqs] if spec else [
            len(seq.token_ids) for seq in seqs]
        # A token still being sampled is missing from `token_ids`: a placeholder here,
        # replaced on the device by the sequence's last sampled token.
        pending = [i for i, (end, length) in enumerate(zip(context_lens, known)) if end > length]
        num_tokens, decode = ends[-1], len(seqs) == ends[-1]
        if decode and len(pending) == len(seqs):  # the steady state of asynchronous scheduling
            token_ids = [0] * num_tokens
        else:
            pieces = [(seq.token_ids + spec[seq] if spec and seq in spec else seq.token_ids)[start : start + n]
                      for seq, start, n in zip(seqs, starts, nums)]
            for i in pending:
                pieces[i].append(0)
            token_ids = list(itertools.chain.from_iterable(pieces))
        input_ids = upload(token_ids, torch.long, device)
        slots = upload(self.slots(seqs), torch.long, device)
        attention = self.attention_metadata(slots, starts, nums)
        step = StepInputs(input_ids, attention.positions, attention, num_tokens, spec_token_ids=spec)
        if len(pending) == len(seqs):
            step.pending_rows = upload([end - 1 for end in ends], torch.long, device)
            step.pending_slots = slots
        elif pending:
            step.pending_rows = upload([ends[i] - 1 for i in pending], torch.long, device)
            step.pending_slots = upload(self.slots([seqs[i] for i in pending]), torch.long, device)
        self._sample_rows(step, seqs, context_lens, known, ends, batch.forks)
        special = [i for i, seq in enumerate(seqs)
                   if seq.sampling_params.prompt_logprobs is not None or seq.pooling is not None or seq.mm_features]
        if special:
            self._prompt_pool_and_image_rows(step, [seqs[i] for i in special], [starts[i] for i in special],
                                             [nums[i] for i in special], [ends[i] for i in special])
        if self.uses_mrope:
            step.rope_positions = _rope_positions(seqs, starts, nums).to(self.device, non_blocking=True)
        if self.cross_tables is not None:
            step.cross = self.cross_attention_rows(slots, seqs, starts, nums)
        if lora_slots:
            step.lora_ranges = _lora_ranges(seqs, ends, nums, lora_slots)
        return step

    def attention_metadata(self, slots: torch.Tensor, starts: list[int], nums: list[int]) -> AttentionMetadata:
        """The attention metadata of `nums[i]` new tokens of the sequence in batch row
        `slots[i]` (on the device), from its position `starts[i]`: as many of its leading
        tokens' keys and values are cached. Its block table must cover the new tokens."""
        device, size = self.device, self.block_size
        ends = list(itertools.accumulate(nums))
        num_tokens = ends[-1]
        context_lens = list(map(operator.add, starts, nums))
        if num_tokens == len(nums):  # a decode step
            positions = upload(starts, torch.long, device)
            row_slots = slots
        else:
            row_seq = torch.repeat_interleave(torch.arange(len(nums), device=device),
                                              upload(nums, torch.long, device), output_size=num_tokens)
            first_rows = upload([end - n - start for end, n, start in zip(ends, nums, starts)], torch.long, device)
            positions = torch.arange(num_tokens, device=device) - first_rows[row_seq]
            row_slots = slots[row_seq]
        blocks = self.block_tables[row_slots, positions // size]
        width = -(-max(context_lens) // size)
        return AttentionMetadata(
            slot_mapping=blocks.long() * size + positions % size,
            query_start_loc=upload([0, *ends], torch.int32, device),
            seq_lens=upload(context_lens, torch.int32, device),
            block_tables=self.block_tables[slots, :width],
            positions=positions, query_lens=nums, context_lens=context_lens, block_size=size)

    def cross_attention_rows(self, slots: torch.Tensor, seqs: list[Sequence], starts: list[int],
                             nums: list[int]) -> CrossRows:
        """The step's cross-attention rows: each of the `nums[i]` decoder rows of the sequence in
        batch row `slots[i]` one query over its `cross_rows` keys (its position the last key's,
        so that a causal backend sees them all), and the encoder rows written by the
        sequences whose chunk starts their decoder prompt (`starts[i] == 0`)."""
        device, size = self.device, self.block_size
        keys = [seq.cross_rows for seq in seqs]
        row_keys = [k for k, n in zip(keys, nums) for _ in range(n)]
        row_slots = torch.repeat_interleave(slots, upload(nums, torch.long, device), output_size=len(row_keys))
        meta = cross_attention_metadata(row_keys, self.cross_tables[row_slots], size)
        starting = [i for i, start in enumerate(starts) if start == 0]
        if not starting:
            return CrossRows(meta)
        written = [feature for i in starting for feature in seqs[i].cross_features]
        lengths = [keys[i] for i in starting]
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        tables = self.cross_tables[slots[starting]]
        rows = torch.repeat_interleave(torch.arange(len(starting), device=device),
                                       upload(lengths, torch.long, device), output_size=len(positions))
        writes = AttentionMetadata(
            slot_mapping=tables[rows, positions // size].long() * size + positions % size,
            query_start_loc=upload([0, *itertools.accumulate(lengths)], torch.int32, device),
            seq_lens=upload(lengths, torch.int32, device), block_tables=tables, positions=positions,
            query_lens=lengths, context_lens=lengths, block_size=size)
        return CrossRows(meta, written, writes)

    def _prompt_pool_and_image_rows(self, step: StepInputs, seqs: list[Sequence], starts: list[int],
                                    nums: list[int], ends: list[int]) -> None:
        """The step's rows whose prompt logprobs are read, the pooling sequences' rows, the
        rows that read encoder outputs, given the step's sequences that have prompt
        logprobs, pooling or images."""
        step.prompt_rows = [
            PromptRows(seq, end - n, start, min(start + n, seq.num_prompt_tokens - 1) - start)
            for seq, start, n, end in zip(seqs, starts, nums, ends)
            if seq.sampling_params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1
        ]
        step.pool_rows = [PoolRows(seq, end - n, start, n, start + n == seq.num_tokens)
                          for seq, start, n, end in zip(seqs, starts, nums, ends) if seq.pooling is not None]
        step.image_rows = [ImageRows(feature, [end - n + r for r in rows], first, last)
                           for seq, start, n, end in zip(seqs, starts, nums, ends) for feature in seq.mm_features
                           for rows, first, last in [feature.embed_rows(start, start + n)] if rows]

    @staticmethod
    def _sample_rows(step: StepInputs, seqs: list[Sequence], context_lens: list[int], known: list[int],
                     ends: list[int], forks: list[tuple[Sequence, Sequence]]) -> None:
        """The sequences whose tokens (`known` on the host, and any still being sampled) are
        all computed after this step sample, from their last row (pooling ones pool
        instead); forked children from their parent's."""
        sampling = [i for i, (seq, end, length) in enumerate(zip(seqs, context_lens, known))
                    if end == length + seq.num_pending_tokens and seq.pooling is None]
        spec = step.spec_token_ids
        if spec:
            counts = [len(spec.get(seqs[i], ())) for i in sampling]
            step.sample_seqs = [seqs[i] for i, m in zip(sampling, counts) for _ in range(m + 1)]
            step.sample_rows = [ends[i] - 1 - m + j for i, m in zip(sampling, counts) for j in range(m + 1)]
            step.sample_offsets = [j for m in counts for j in range(m + 1)]
        else:
            step.sample_seqs = [seqs[i] for i in sampling]
            step.sample_rows = [ends[i] - 1 for i in sampling]
        if forks:
            row_of = dict(zip(step.sample_seqs, step.sample_rows))
            step.sample_seqs += [child for child, _ in forks]
            step.sample_rows += [row_of[parent] for _, parent in forks]
            if step.sample_offsets is not None:
                step.sample_offsets += [0] * len(forks)


def _rope_positions(seqs: list[Sequence], starts: list[int], nums: list[int]) -> torch.Tensor:
    """[3, tokens] M-RoPE positions of the step's rows: a prompt's own (its images' grid
    positions, `ProcessedPrompt.rope_positions`), and past them, or for a prompt without
    images, the token's index plus the prompt's offset in all three rows."""
    pieces = []
    for seq, start, n in zip(seqs, starts, nums):
        prompt, end = seq.multi_modal, start + n
        table = prompt.rope_positions if prompt is not None else None
        if table is not None and start < table.shape[1]:
            pieces.append(table[:, start : min(end, table.shape[1])])
            start = min(end, table.shape[1])
        if start < end:
            delta = prompt.rope_delta if prompt is not None else 0
            pieces.append((torch.arange(start, end) + delta).expand(3, -1))
    return torch.cat(pieces, dim=1)


def _lora_ranges(seqs: list[Sequence], ends: list[int], nums: list[int],
                 lora_slots: dict[int, int]) -> list[LoRARange]:
    """The runs of rows with one adapter slot (sequences come grouped by slot)."""
    ranges: list[LoRARange] = []
    for seq, end, n in zip(seqs, ends, nums):
        slot = lora_slots.get(seq.lora_int_id)
        if slot is None:
            continue
        if ranges and ranges[-1].slot == slot and ranges[-1].end == end - n:
            ranges[-1] = LoRARange(slot, ranges[-1].start, end)
        else:
            ranges.append(LoRARange(slot, end - n, end))
    return ranges
