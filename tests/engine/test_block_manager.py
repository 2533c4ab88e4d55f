"""Unit tests of the BlockManager: reference counts, prefix hits, LRU reuse, no leaks."""

import pytest

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.multimodal.inputs import MultiModalFeature, ProcessedPrompt
from engine.sampling_params import SamplingParams


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, str(seq_id), None, tokens, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, num_new: int, cached: list[int] = ()) -> None:
    """What the scheduler and engine do around one step of `num_new` tokens."""
    assert bm.allocate(seq, num_new, cached)
    seq.num_computed_tokens = seq.num_computed_tokens or len(cached) * bm.block_size
    seq.num_computed_tokens += num_new
    bm.register_full_blocks(seq)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    counts = {}
    for seq in live:
        for b in (*seq.blocks.table, *seq.blocks.cross):
            counts[b] = counts.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == counts.get(block.block_id, 0) >= 0
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
    for key, block_id in bm.cached_blocks.items():
        assert bm.blocks[block_id].key == key


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(10)))
    compute(bm, seq, 10)
    assert len(seq.blocks.table) == 3 and bm.num_free_blocks == 5
    check_invariants(bm, [seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.blocks.table == []
    check_invariants(bm, [])


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.blocks.table == [] and bm.num_free_blocks == 2


def test_prefix_hits_share_blocks_and_leave_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)), 0)
    compute(bm, first, 12)
    # Same 12 tokens: only 2 blocks may hit, since the last token must be computed.
    again = make_seq(list(range(12)), 1)
    hits = bm.find_cached_blocks(again)
    assert hits == first.blocks.table[:2]
    compute(bm, again, 4, hits)
    assert again.blocks.table[:2] == first.blocks.table[:2]
    assert bm.blocks[hits[0]].ref_count == 2
    check_invariants(bm, [first, again])
    # A different first block breaks the chain even if later tokens agree.
    other = make_seq([99] + list(range(1, 12)), 2)
    assert bm.find_cached_blocks(other) == []
    for seq in (first, again):
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 16


def test_freed_blocks_stay_cached_until_evicted_in_lru_order():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], 0)  # two full blocks and one partial
    compute(bm, a, 5)
    partial = a.blocks.table[2]
    bm.free(a)
    # The partial block holds nothing reusable, so it is handed out first.
    assert next(iter(bm.free_queue)) == partial
    reuse = make_seq([1, 2, 3, 4, 9], 1)
    assert len(bm.find_cached_blocks(reuse)) == 2
    filler = make_seq(list(range(100, 104)), 2)
    compute(bm, filler, 4)  # takes the 2 blocks that held no cached prefix
    assert len(bm.find_cached_blocks(reuse)) == 2
    bm.free(filler)
    big = make_seq(list(range(200, 208)), 3)
    compute(bm, big, 8)  # needs every block: the cached ones are evicted
    assert bm.find_cached_blocks(reuse) == []
    assert bm.num_evicted_blocks >= 2
    bm.free(big)
    check_invariants(bm, [])


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], 0)
    compute(bm, a, 5)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 7, 8], 1)
    hits = bm.find_cached_blocks(b)
    assert len(hits) == 2
    compute(bm, b, 2, hits)
    assert all(h not in bm.free_queue for h in hits)
    check_invariants(bm, [b])
    bm.free(b)
    check_invariants(bm, [])


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3], 0)
    compute(bm, a, 3)
    table = list(a.blocks.table)
    bm.free(a)
    a.blocks.table = table
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(a)


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], 0)
    compute(bm, a, 5)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.find_cached_blocks(make_seq([1, 2, 3, 4, 5], 1)) == []


def cross_seq(tokens: list[int], cross_rows: int, seq_id: int = 0) -> Sequence:
    """An encoder-decoder sequence (Whisper's): a decoder prompt, and a clip of `cross_rows`
    encoder rows that its cross-attention reads."""
    clip = MultiModalFeature(f"clip{seq_id}", 0, cross_rows, b"", modality="audio")
    return Sequence(seq_id, str(seq_id), None, tokens, SamplingParams(),
                    multi_modal=ProcessedPrompt(list(tokens), [], cross=[clip]))


def test_cross_blocks_are_taken_once_with_the_first_blocks_all_or_none():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    seq = cross_seq([1, 2, 3], cross_rows=10)  # 3 cross blocks
    blocked = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    assert not blocked.allocate(seq, 3)  # 1 decoder block and 3 cross blocks do not fit 3
    assert seq.blocks.table == [] and seq.blocks.cross == [] and blocked.num_free_blocks == 3
    compute(bm, seq, 3)
    assert len(seq.blocks.table) == 1 and len(seq.blocks.cross) == 3 and bm.num_free_blocks == 2
    cross = list(seq.blocks.cross)
    seq.token_ids += [4, 5, 6]
    compute(bm, seq, 3)  # the decoder grows; its cross blocks stay
    assert len(seq.blocks.table) == 2 and seq.blocks.cross == cross and bm.num_free_blocks == 1
    bm.free(seq)
    assert bm.num_free_blocks == 6 and seq.blocks.cross == []


def test_forks_share_cross_blocks_and_the_last_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent, child = cross_seq([1, 2, 3, 4, 5], cross_rows=8), cross_seq([1, 2, 3, 4, 5], cross_rows=8, seq_id=1)
    compute(bm, parent, 5)
    bm.fork(parent, child)
    assert child.blocks.cross == parent.blocks.cross
    check_invariants(bm, [parent, child])
    assert all(bm.blocks[b].ref_count == 2 for b in parent.blocks.cross)
    child.token_ids.append(6)
    compute(bm, child, 1)  # writes into its own copy of the shared partial block, never into cross blocks
    assert child.blocks.cross == parent.blocks.cross and not any(b in bm.free_queue for b in parent.blocks.cross)
    bm.free(parent)
    assert all(bm.blocks[b].ref_count == 1 for b in child.blocks.cross)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_encoder_decoder_sequences_never_hit_or_fill_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = cross_seq(list(range(9)), cross_rows=4)
    compute(bm, first, 9)
    assert bm.cached_blocks == {}  # its blocks' keys and values depend on its clip
    bm.free(first)
    assert bm.find_cached_blocks(cross_seq(list(range(9)), cross_rows=4, seq_id=1)) == []
