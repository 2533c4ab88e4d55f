"""The scheduler's side of images, with stand-in prompts: each image encoded once while the
cache holds it, the step's encoder budget, chunks that stop before an image the step cannot
encode, preemption that does not re-encode, prefix-cache keys by image content."""

import random

import pytest

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.encoder_cache_manager import EncoderCacheManager
from engine.core.sched_output import ScheduledBatch
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.multimodal.inputs import MultiModalFeature, ProcessedPrompt
from engine.sampling_params import SamplingParams

IMAGE_TOKEN = 999


def make_scheduler(budget: int = 32, cache_rows: int = 64, num_blocks: int = 64, chunked: bool = True) -> Scheduler:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(config, BlockManager(num_blocks, 4, True), EncoderCacheManager(cache_rows))


def image_seq(seq_id: int, layout: list[int | str], max_tokens: int = 2) -> Sequence:
    """A prompt of text tokens (ints: that many) and images ("name:rows")."""
    tokens, features = [], []
    for piece in layout:
        if isinstance(piece, int):
            tokens += [seq_id * 100 + len(tokens) + i for i in range(piece)]
        else:
            name, rows = piece.split(":")
            features.append(MultiModalFeature(name, len(tokens), int(rows), b""))
            tokens += [IMAGE_TOKEN] * int(rows)
    return Sequence(seq_id, str(seq_id), None, tokens, SamplingParams(max_tokens=max_tokens),
                    multi_modal=ProcessedPrompt(tokens, features))


def complete(sched: Scheduler, batch: ScheduledBatch) -> None:
    """The step ran: a sequence whose tokens are all computed gets a token, and finishes at max_tokens."""
    ready = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
    sched.update_computed(batch)
    for seq in ready:
        seq.token_ids.append(7)
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            sched.finish(seq)


def step(sched: Scheduler) -> tuple[list[tuple[int, int]], list[str]]:
    """One step run: (seq id, tokens) scheduled and the images encoded."""
    batch = sched.schedule()
    complete(sched, batch)
    return [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)], [f.identifier for f in batch.encoder_inputs]


def run(sched: Scheduler) -> list[str]:
    encoded = []
    while sched.has_unfinished():
        encoded += step(sched)[1]
    return encoded


def test_each_image_is_encoded_once_across_chunks_and_prompts():
    sched = make_scheduler(budget=8)
    first, second = image_seq(1, [3, "cat:10", 5]), image_seq(2, [2, "cat:10", 1])
    sched.add(first)
    sched.add(second)
    scheduled, encoded = step(sched)
    assert encoded == ["cat"] and scheduled == [(1, 8)]  # the chunk ends inside the image's tokens
    assert run(sched) == []  # the rest of the image and the other prompt read the cached output


def test_a_chunk_stops_before_an_image_the_step_cannot_encode():
    sched = make_scheduler(budget=32, cache_rows=20)
    sched.add(image_seq(1, [2, "a:12", 2, "b:12", 2]))
    assert step(sched) == ([(1, 16)], ["a"])  # b's output does not fit the cache beside a's, still in use
    assert step(sched) == ([(1, 14)], ["b"])


def test_encoder_budget_counts_rows_and_admits_one_image_at_least():
    sched = make_scheduler(budget=16, cache_rows=64)
    sched.add(image_seq(1, [1, "big:20", 1]))
    scheduled, encoded = step(sched)
    assert encoded == ["big"] and scheduled == [(1, 16)]  # one image over the budget still runs alone
    sched = make_scheduler(budget=16, cache_rows=64)
    sched.add(image_seq(1, ["x:10", 1]))
    sched.add(image_seq(2, ["y:10", 1]))
    scheduled, encoded = step(sched)
    assert encoded == ["x"] and scheduled == [(1, 11)]  # y's 10 rows would pass the budget of 16


def test_preemption_and_recompute_reuse_the_cached_output():
    sched = make_scheduler(budget=32)
    seq = image_seq(1, [2, "img:8", 2], max_tokens=4)
    sched.add(seq)
    assert step(sched)[1] == ["img"]
    sched._preempt(seq)
    assert run(sched) == []


def test_an_evicted_output_is_encoded_again_and_freed_for_the_runner():
    sched = make_scheduler(budget=32, cache_rows=10)
    sched.add(image_seq(1, ["a:8", 1]))
    assert run(sched) == ["a"]
    sched.add(image_seq(2, ["b:8", 1]))
    batch = sched.schedule()
    assert [f.identifier for f in batch.encoder_inputs] == ["b"] and batch.freed_encoder_outputs == ["a"]


def test_an_output_in_use_is_never_evicted():
    sched = make_scheduler(budget=8, cache_rows=12)
    sched.add(image_seq(1, ["a:10", 1]))
    sched.add(image_seq(2, ["b:10", 1]))
    assert step(sched) == ([(1, 8)], ["a"])
    scheduled, encoded = step(sched)
    assert encoded == [] and (2, 8) not in scheduled  # b waits until a's tokens are all computed
    assert run(sched) == ["b"]


def test_prefix_cache_blocks_are_keyed_by_image_content():
    sched = make_scheduler(budget=64)
    sched.add(image_seq(1, [4, "red:8", 5]))
    run(sched)
    same, other = image_seq(1, [4, "red:8", 5]), image_seq(1, [4, "blue:8", 5])  # the same token ids
    same.seq_id, other.seq_id = 2, 3
    assert len(sched.block_manager.find_cached_blocks(same)) == 4  # text block, two image blocks, the next
    assert len(sched.block_manager.find_cached_blocks(other)) == 1  # the text block only


def test_an_output_computed_by_the_step_is_not_evicted_by_it():
    """A sequence preempted while the step is scheduled leaves the image it was to encode
    unused; a later image of the same step must not evict it before the step computes it."""
    cache = EncoderCacheManager(10)
    first, second = image_seq(1, ["a:8", 1]), image_seq(2, ["b:8", 1])
    cache.allocate(first, first.mm_features[0])
    cache.release(first)
    assert not cache.can_hold(8, set())
    assert cache.take_freed() == []
    assert cache.can_hold(8, set())  # the step ran: a's output may go now
    cache.allocate(second, second.mm_features[0])
    assert cache.take_freed() == ["a"]


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_keep_the_runners_outputs_consistent(seed):
    """Random prompts sharing images, small budgets and caches, preemptions: the scheduler
    never schedules a token of an image whose output the runner lacks, never encodes an
    image the runner holds, and frees only what the runner holds."""
    rng = random.Random(seed)
    sched = make_scheduler(budget=rng.choice([8, 16, 40]), cache_rows=rng.choice([24, 40, 80]),
                           num_blocks=rng.choice([24, 32, 64]))
    for seq_id in range(10):
        layout: list[int | str] = []
        for _ in range(rng.randint(1, 3)):
            image = rng.randint(0, 4)  # five images, of 4 to 12 rows, shared between prompts
            layout += [rng.randint(1, 6), f"img{image}:{4 + 2 * image}"]
        sched.add(image_seq(seq_id, [*layout, 2], max_tokens=rng.randint(1, 4)))
    held: set[str] = set()
    for _ in range(2000):
        if not sched.has_unfinished():
            return
        if rng.random() < 0.1 and sched.running:
            sched._preempt(rng.choice(sched.running))
        batch = sched.schedule()
        for identifier in batch.freed_encoder_outputs:
            held.remove(identifier)
        for feature in batch.encoder_inputs:
            assert feature.identifier not in held
            held.add(feature.identifier)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            assert all(f.identifier in held for f in seq.mm_features if f.offset < start + n and f.end > start)
        complete(sched, batch)
    raise AssertionError("the requests did not finish")


def clip_seq(seq_id: int, prompt: int, clip: str, rows: int = 12, max_tokens: int = 2) -> Sequence:
    """An encoder-decoder sequence (Whisper's): a decoder prompt of `prompt` tokens and a clip
    of `rows` encoder rows, which no prompt position stands for."""
    tokens = [seq_id * 100 + i for i in range(prompt)]
    feature = MultiModalFeature(clip, 0, rows, b"", modality="audio")
    return Sequence(seq_id, str(seq_id), None, tokens, SamplingParams(max_tokens=max_tokens),
                    multi_modal=ProcessedPrompt(tokens, [], cross=[feature]))


def test_a_clip_is_encoded_for_the_chunk_that_starts_its_decoder_prompt():
    sched = make_scheduler(budget=4, cache_rows=64)
    first, second = clip_seq(1, 6, "speech"), clip_seq(2, 3, "speech")
    sched.add(first)
    sched.add(second)
    assert step(sched) == ([(1, 4)], ["speech"])  # 12 rows over the budget of 4: a step's first item fits
    assert sched.encoder_cache.users["speech"] == set()  # its rows are in the cross blocks: released
    assert len(first.blocks.cross) == 3  # ceil(12 / 4)
    assert run(sched) == []  # the second chunk, the other prompt: the cached output


def test_a_preempted_clip_is_written_again_from_the_cached_output():
    sched = make_scheduler(budget=32, cache_rows=64)
    seq = clip_seq(1, 5, "talk", max_tokens=4)
    sched.add(seq)
    assert step(sched)[1] == ["talk"]
    free = sched.block_manager.num_free_blocks
    sched._preempt(seq)
    assert seq.blocks.cross == [] and sched.block_manager.num_free_blocks == free + 5  # 2 decoder, 3 cross
    batch = sched.schedule()
    assert batch.seqs == [seq] and batch.encoder_inputs == []  # restarts at 0, reading the held output
    assert sched.encoder_cache.users["talk"] == {1}  # held until the step is computed
    complete(sched, batch)
    run(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_clip_that_does_not_fit_the_cache_waits():
    sched = make_scheduler(budget=64, cache_rows=20)
    sched.add(clip_seq(1, 3, "a", rows=12, max_tokens=3))
    sched.add(clip_seq(2, 3, "b", rows=12, max_tokens=3))
    assert step(sched) == ([(1, 3)], ["a"])  # b's rows do not fit beside a's, in use by the step
    scheduled, encoded = step(sched)
    assert encoded == ["b"] and (2, 3) in scheduled  # a's output, written, may go


def test_a_step_encodes_clips_up_to_the_encoder_budget_not_the_token_budget():
    """An encoder-decoder model's clips take no prompt positions: the engine gives the
    scheduler an encoder budget of its own (four clips' rows), beyond the step's tokens."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=8, enable_chunked_prefill=True)
    sched = Scheduler(config, BlockManager(64, 4, False), EncoderCacheManager(48), encoder_budget=36)
    for i, clip in enumerate("abcd"):
        sched.add(clip_seq(i + 1, 2, clip, rows=12))
    assert step(sched) == ([(1, 2), (2, 2), (3, 2)], ["a", "b", "c"])  # d's 12 rows would pass 36
    assert step(sched)[1] == ["d"]
