"""Unit tests of the Scheduler with a stand-in model: budgets, chunking, preemption, priority."""

import random

import pytest

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True,
                   policy="fcfs", prefix_caching=True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                          scheduling_policy=policy)
    return Scheduler(config, bm)


def make_seq(seq_id: int, prompt_len: int, max_tokens: int, priority: int = 0, start: int = 0) -> Sequence:
    tokens = [start + i for i in range(prompt_len)]
    return Sequence(seq_id, str(seq_id), None, tokens, SamplingParams(max_tokens=max_tokens), priority)


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[tuple[list[Sequence], list[int]]]:
    """Steps until done, appending a fake token whenever a sequence's tokens are all computed."""
    history = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return history
        batch = sched.schedule()
        assert batch.num_tokens <= sched.config.max_num_batched_tokens
        assert len(batch.seqs) <= sched.config.max_num_seqs
        assert len(set(batch.seqs)) == len(batch.seqs)
        history.append((list(batch.seqs), list(batch.num_new_tokens)))
        ready = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
        sched.update_computed(batch)
        for seq in ready:
            seq.token_ids.append(1000 + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish(seq)
        check_block_invariants(sched)
    raise AssertionError("requests did not finish")


def check_block_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    counts = {}
    for seq in sched.running:
        assert len(seq.blocks.table) * bm.block_size >= seq.num_computed_tokens
        for b in seq.blocks.table:
            counts[b] = counts.get(b, 0) + 1
    for seq in sched.waiting:
        assert seq.blocks.table == [] and seq.num_computed_tokens == 0
    for block in bm.blocks:
        assert block.ref_count == counts.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)


def test_every_request_finishes_and_all_blocks_come_back():
    sched = make_scheduler()
    seqs = [make_seq(i, prompt_len=3 + 5 * i, max_tokens=4 + i) for i in range(6)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == s.sampling_params.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_long_prompt_is_chunked_under_the_budget_and_decodes_ride_along():
    sched = make_scheduler(budget=10)
    short = make_seq(0, prompt_len=3, max_tokens=6)
    long = make_seq(1, prompt_len=37, max_tokens=2)
    sched.add(short)
    sched.add(long)
    history = run_to_completion(sched)
    long_chunks = [n for seqs, ns in history for s, n in zip(seqs, ns) if s is long]
    assert sum(long_chunks[:-1]) == 37 and max(long_chunks) <= 10 and len(long_chunks) >= 5
    # The short request keeps decoding while the long prompt is prefilled.
    mixed = [seqs for seqs, _ in history if short in seqs and long in seqs]
    assert len(mixed) >= 3


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=16, chunked=False)
    a, b = make_seq(0, 10, 3), make_seq(1, 10, 3)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.seqs == [a] and first.num_new_tokens == [10]


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    seqs = [make_seq(i, prompt_len=6, max_tokens=10, start=100 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert any(s.metrics.num_preemptions for s in seqs)
    assert all(s.num_output_tokens == 10 for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_fcfs_preempts_the_newest_request():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    old, new = make_seq(0, 7, 8, start=0), make_seq(1, 7, 8, start=100)
    sched.add(old)
    sched.add(new)
    run_to_completion(sched)
    assert new.metrics.num_preemptions > 0 and old.metrics.num_preemptions == 0


def test_priority_policy_runs_low_values_first_and_preempts_high_values():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, max_num_seqs=8, policy="priority")
    seqs = [make_seq(i, 7, 8, priority=p, start=100 * i) for i, p in enumerate([5, 0, 9])]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert first.seqs[0] is seqs[1]
    run_to_completion(sched)
    assert seqs[1].metrics.num_preemptions == 0
    finish_order = sorted(seqs, key=lambda s: s.metrics.first_scheduled_time)
    assert finish_order[0] is seqs[1]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=3, budget=100)
    for i in range(7):
        sched.add(make_seq(i, 2, 3, start=10 * i))
    history = run_to_completion(sched)
    assert max(len(seqs) for seqs, _ in history) == 3


def test_prefix_hits_skip_computation_of_shared_blocks():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=100)
    first = make_seq(0, 17, 2)
    sched.add(first)
    run_to_completion(sched)
    second = make_seq(1, 17, 2)
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached_tokens == 16 and batch.num_new_tokens == [1]


@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_keep_invariants(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(8, 20), block_size=rng.choice([2, 4]),
                           max_num_seqs=rng.randint(1, 6), budget=rng.randint(4, 40),
                           policy=rng.choice(["fcfs", "priority"]))
    capacity = sched.block_manager.num_blocks * sched.block_manager.block_size
    seqs = []
    for i in range(12):
        prompt_len = rng.randint(1, min(20, capacity - 1))
        max_tokens = rng.randint(1, max(1, min(15, capacity - prompt_len)))
        # Shared starts make prefix hits happen.
        seqs.append(make_seq(i, prompt_len, max_tokens, priority=rng.randint(0, 3), start=rng.choice([0, 50])))
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert all(s.is_finished and s.num_output_tokens == s.sampling_params.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
