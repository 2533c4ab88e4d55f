"""Property-based tests of scheduling: random workloads, with invariants checked after every step.

Two levels:

* The engine's own step loop (`LLMEngine.step`: scheduling, forks of n > 1 requests, token
  appends, finishes, speculative proposals verified and partly accepted) over the real
  Scheduler and BlockManager, with a stand-in model runner that writes a fingerprint of each
  token's prefix into a simulated KV cache and checks that every slot a sequence attends to
  holds its own prefix. Fast: hundreds of workloads.
* `engine.LLM` end to end on a tiny llama with a KV cache small enough to force preemption,
  against an unconstrained LLM: same tokens, every block back afterwards.
"""

import itertools
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.sched_output import ScheduledBatch
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.llm_engine import LLMEngine
from engine.output_processor.processor import OutputProcessor
from engine.outputs import EngineStats
from engine.spec_decode.proposer import SpecState
from engine.worker.model_runner import StepOutput

# Hundreds of generated workloads and a set of LLMs: outside the quick set (-m 'not slow').
pytestmark = pytest.mark.slow

# ----------------------------------------------------------------------------------------
# Level 1: the engine loop over the real Scheduler and BlockManager, with a stand-in model.
# ----------------------------------------------------------------------------------------

_VOCAB = 50_000
# A few base token streams; prompts are prefixes of them, so that prefixes are shared.
_BASES = [[1000 * (k + 1) + i for i in range(64)] for k in range(3)]


def fake_next_token(token_ids: list[int], index: int) -> int:
    """The stand-in model's "greedy" token: a function of the whole sequence (so equal
    sequences continue equally) and of the completion index (so n > 1 completions diverge)."""
    return (hash(tuple(token_ids)) + 7919 * index) % _VOCAB


def expected_completion(prompt: list[int], index: int, max_tokens: int) -> list[int]:
    """What completion `index` of a prompt must be, computed without any scheduling."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_next_token(tokens, index))
    return tokens[len(prompt):]


class _FakeTokenizer:
    """Just enough of a fast tokenizer for the engine's detokenizer: ids as words."""

    clean_up_tokenization_spaces = False

    def __init__(self) -> None:
        self.backend_tokenizer = self

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids) for ids in sequences]


class FakeProposer:
    """Stands in for the n-gram proposer: up to three tokens for a decoding sequence, each
    the stand-in model's next token or, one time in three, another, so that proposals are
    accepted in part; never past the sequence's last allowed token."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.step_times = SimpleNamespace(add=lambda rows, seconds: None)

    def propose(self, seq: Sequence) -> None:
        tokens, proposals = list(seq.token_ids), []
        for _ in range(min(self.rng.randint(0, 3), seq.max_num_tokens - seq.num_tokens - 1)):
            right = fake_next_token(tokens, seq.index)
            proposals.append(right if self.rng.random() < 0.67 else (right + 1) % _VOCAB)
            tokens.append(proposals[-1])
        if seq.spec is None:
            seq.spec = SpecState()
        seq.spec.proposal = proposals

    def keep_worthwhile(self, seqs: list[Sequence]) -> None:
        pass

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        pass


class FakeModelRunner:
    """Stands in for `ModelRunner`: checks each step against the scheduler's limits,
    simulates the paged KV cache and samples `fake_next_token`.

    The simulated cache holds, for every slot written, the hash of the token prefix that
    ends there. Before a step's writes the block copies are applied; after them every
    position a scheduled sequence attends to must hold that sequence's own prefix: that is
    what makes prefix-cache hits, copy on write and recompute after preemption correct.
    The writes are simulated when the step samples: with asynchronous scheduling a step is
    launched before the previous step's token is on the host, and the real runner takes
    that token from the device.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_manager.block_size
        self.kv: dict[int, list[int | None]] = {}
        self.num_steps = 0

    def launch_forward(self, batch: ScheduledBatch) -> SimpleNamespace:
        self.num_steps += 1
        config = self.scheduler.config
        assert batch.seqs, "an empty step (the model runner cannot run one)"
        assert len(set(batch.seqs)) == len(batch.seqs)
        assert all(n >= 1 for n in batch.num_new_tokens)
        assert batch.num_tokens <= config.max_num_batched_tokens
        assert len(batch.seqs) <= config.max_num_seqs
        # Forked children join the running set in this step.
        assert len(self.scheduler.running) <= config.max_num_seqs
        assert not self.scheduler.block_manager.pending_copies
        rows = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING and seq in self.scheduler.running
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            drafts = batch.spec_token_ids.get(seq, [])
            assert not drafts or start == seq.num_tokens - 1, "proposals follow a sequence's last token"
            known = seq.num_tokens + seq.num_pending_tokens + len(drafts)
            assert end <= known
            assert len(seq.blocks.table) * self.block_size >= end
            rows.append((seq, start, end, list(seq.blocks.table), end == known, drafts))
        return SimpleNamespace(copies=batch.block_copies, rows=rows, forks=batch.forks, seqs=[], drafts={})

    def release_rows(self, seqs: list[Sequence]) -> None:
        pass

    def launch_sampling(self, step: SimpleNamespace) -> None:
        for src, dst in step.copies:
            self.kv[dst] = list(self.kv.get(src, [None] * self.block_size))
        for seq, start, end, table, samples, drafts in step.rows:
            if seq.is_finished:
                continue  # finished or aborted since: its rows are computed, never read
            tokens = seq.token_ids + drafts
            assert len(tokens) >= end, "a step samples before its input token is on the host"
            prefix_hashes = [hash(tuple(tokens[: p + 1])) for p in range(end)]
            for p in range(start, end):
                block = self.kv.setdefault(table[p // self.block_size], [None] * self.block_size)
                block[p % self.block_size] = prefix_hashes[p]
            for p in range(end):
                slot = self.kv.get(table[p // self.block_size], [None] * self.block_size)[p % self.block_size]
                assert slot == prefix_hashes[p], f"{seq} reads a foreign key/value at position {p}"
            if samples:
                step.seqs.append(seq)
                if drafts:
                    step.drafts[seq] = drafts
        for child, parent in step.forks:
            assert parent in step.seqs and child.token_ids == parent.token_ids
            step.seqs.append(child)
        for seq in step.seqs:
            seq.num_pending_tokens = 1

    def collect(self, step: SimpleNamespace) -> StepOutput:
        """One token per row: a speculating sequence's row j continues its tokens and its
        first j proposals."""
        rows = [(seq, seq.token_ids + step.drafts.get(seq, [])[:j]) for seq in step.seqs
                for j in range(len(step.drafts.get(seq, [])) + 1)]
        return StepOutput([seq for seq, _ in rows], [fake_next_token(tokens, seq.index) for seq, tokens in rows],
                          None, {}, spec_token_ids=step.drafts)


def make_engine(num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                enable_chunked_prefill: bool, policy: str, enable_prefix_caching: bool,
                async_scheduling: bool, speculate: bool = False) -> LLMEngine:
    """An LLMEngine whose step loop is the real one, over a stand-in model runner."""
    engine = LLMEngine.__new__(LLMEngine)
    engine.config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 enable_chunked_prefill=enable_chunked_prefill, scheduling_policy=policy,
                                 async_scheduling=async_scheduling)
    engine._in_flight = None
    engine.tokenizer = _FakeTokenizer()
    engine.model_config = SimpleNamespace(eos_token_ids=set(), max_model_len=1 << 20, device=torch.device("cpu"))
    engine.output_processor = OutputProcessor(engine.tokenizer, frozenset())
    engine.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    engine.scheduler = Scheduler(engine.config, engine.block_manager)
    engine.model_runner = FakeModelRunner(engine.scheduler)
    engine.stats = EngineStats()
    engine._seq_ids = itertools.count()
    engine.proposer = FakeProposer(num_blocks * 1000 + max_num_seqs) if speculate else None
    return engine


def check_invariants(engine: LLMEngine, live: list[Sequence]) -> None:
    """Block accounting after a step.

    Every block is either free (reference count 0, in the free queue, possibly still
    holding a cached prefix) or held by running sequences, with a reference count equal
    to the number of their block tables that hold it; waiting and finished sequences hold
    none; every cached key points at a block that carries that key.
    """
    scheduler, bm = engine.scheduler, engine.block_manager
    holders: dict[int, int] = {}
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.blocks.table) * bm.block_size >= seq.num_computed_tokens
        assert seq.num_computed_tokens < seq.num_tokens + seq.num_pending_tokens
        assert len(set(seq.blocks.table)) == len(seq.blocks.table)
        for block_id in seq.blocks.table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.blocks.table == [] and seq.num_computed_tokens == 0
    for seq in live:
        if seq.is_finished:
            assert seq.blocks.table == [] and seq not in scheduler.running and seq not in scheduler.waiting
    free = set(bm.free_queue)
    assert len(free) == len(bm.free_queue) == bm.num_free_blocks
    assert free.isdisjoint(holders), "a block is both free and held"
    assert len(free) + len(holders) == bm.num_blocks, "blocks leaked"
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    for key, block_id in bm.cached_blocks.items():
        assert bm.blocks[block_id].key == key
    ranks = [scheduler._rank(s) for s in scheduler.waiting]
    assert ranks == sorted(ranks), "the waiting queue is out of order"


@dataclass
class FuzzRequest:
    """One request of a random workload."""

    arrival_step: int
    base: int
    prompt_len: int
    suffix: list[int]
    max_tokens: int
    n: int
    priority: int
    abort_after: int | None  # steps after arrival; None: never aborted

    @property
    def prompt(self) -> list[int]:
        return _BASES[self.base][: self.prompt_len] + self.suffix


@dataclass
class FuzzWorkload:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    policy: str
    enable_prefix_caching: bool
    abort_all_at: int | None
    async_scheduling: bool
    speculate: bool = False  # with proposals (and without asynchronous scheduling)
    requests: list[FuzzRequest] = field(default_factory=list)


@st.composite
def workloads(draw: st.DrawFn) -> FuzzWorkload:
    """Small KV caches (4-24 blocks), tight step budgets and up to 12 requests."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(4, 24))
    capacity = num_blocks * block_size
    max_num_seqs = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    max_len = min(capacity, 48)
    count = draw(st.integers(1, 12))
    requests = []
    for _ in range(count):
        prompt_len = draw(st.integers(1, max(1, min(24, max_len - 1))))
        suffix = draw(st.lists(st.integers(0, 9), max_size=2))
        prompt_len = max(1, prompt_len - len(suffix))
        total_prompt = prompt_len + len(suffix)
        # As LLM validation requires: prompt plus max_tokens fits the whole cache.
        max_tokens = draw(st.integers(1, max(1, min(12, max_len - total_prompt))))
        requests.append(FuzzRequest(
            arrival_step=draw(st.integers(0, 15)),
            base=draw(st.integers(0, len(_BASES) - 1)),
            prompt_len=prompt_len,
            suffix=suffix,
            max_tokens=max_tokens,
            n=draw(st.integers(1, min(3, max_num_seqs))),
            priority=draw(st.integers(0, 3)),
            abort_after=draw(st.none() | st.integers(0, 20)),
        ))
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    # Without chunked prefill a recomputed sequence must fit one step (the engine requires
    # max_num_batched_tokens >= max_model_len then).
    low = 1 if chunked else longest
    budget = draw(st.integers(low, max(low, 40)))
    asynchronous = draw(st.booleans())
    return FuzzWorkload(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])), enable_prefix_caching=draw(st.booleans()),
        abort_all_at=draw(st.none() | st.integers(0, 30)), async_scheduling=asynchronous,
        speculate=not asynchronous and draw(st.booleans()), requests=requests,
    )


def run_workload(workload: FuzzWorkload, max_steps: int = 20_000) -> tuple[LLMEngine, dict[int, list[Sequence]], set[int]]:
    """Feeds the requests in at their arrival steps, aborting some, until all are done.

    Returns the engine, each request's sequences and the requests that were aborted.
    """
    engine = make_engine(workload.num_blocks, workload.block_size, workload.max_num_seqs,
                         workload.max_num_batched_tokens, workload.enable_chunked_prefill, workload.policy,
                         workload.enable_prefix_caching, workload.async_scheduling, workload.speculate)
    pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_step)
    parents: dict[int, Sequence] = {}
    aborted: set[int] = set()
    arrived: dict[int, int] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, workload.requests[pending[0]].arrival_step)  # idle: skip ahead
        while pending and workload.requests[pending[0]].arrival_step <= step:
            i = pending.pop(0)
            r = workload.requests[i]
            params = SamplingParams(max_tokens=r.max_tokens, n=r.n, temperature=1.0, top_k=1, ignore_eos=True)
            parents[i] = engine.add_request(str(i), None, r.prompt, params, r.priority)
            arrived[i] = step
        for i, r in enumerate(workload.requests):
            if i in arrived and r.abort_after is not None and arrived[i] + r.abort_after == step:
                if not parents[i].request_finished:
                    engine.abort_request(str(i))
                    aborted.add(i)
        if workload.abort_all_at == step and engine.has_unfinished_requests():
            aborted |= {i for i in arrived if not parents[i].request_finished}
            engine.abort_all()
        live = [s for p in parents.values() for s in p.group]
        check_invariants(engine, live)
        if engine.has_unfinished_requests():
            engine.step()
            check_invariants(engine, [s for p in parents.values() for s in p.group])
        step += 1
        assert step < max_steps, "the workload did not finish"
    return engine, {i: p.group for i, p in parents.items()}, aborted


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_the_scheduler_invariants(workload: FuzzWorkload):
    engine, groups, aborted = run_workload(workload)
    bm = engine.block_manager
    for i, group in groups.items():
        r = workload.requests[i]
        assert all(s.is_finished for s in group)
        if i in aborted:
            assert all(s.num_output_tokens <= r.max_tokens for s in group)
            continue
        assert sorted(s.index for s in group) == list(range(r.n))
        for seq in group:
            assert seq.finish_reason == "length"
            assert seq.output_token_ids == expected_completion(r.prompt, seq.index, r.max_tokens)
    # Everything is free again; freed blocks may still hold cached prefixes.
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.reset_prefix_cache()


# ----------------------------------------------------------------------------------------
# Level 2: engine.LLM end to end on a tiny llama, against an unconstrained LLM.
# ----------------------------------------------------------------------------------------

_MAX_MODEL_LEN = 128
_TINY_VOCAB = 320
# One thread: on a shared 2-core machine two threads of a model this small mostly wait on
# each other (a step measured 18x slower under load), and results do not depend on it.
_THREADS = 1


@dataclass(frozen=True)
class ConstrainedConfig:
    """An LLM too small for its workloads: a few KV blocks of 16 tokens, a tight step budget."""

    name: str
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True


CONSTRAINED = (
    ConstrainedConfig("fcfs", num_blocks=12, max_num_batched_tokens=32, max_num_seqs=6),
    ConstrainedConfig("priority", num_blocks=10, max_num_batched_tokens=24, max_num_seqs=4, policy="priority",
                      enable_prefix_caching=False),
    ConstrainedConfig("unchunked", num_blocks=16, max_num_batched_tokens=_MAX_MODEL_LEN, max_num_seqs=8,
                      enable_chunked_prefill=False),
)
CONSTRAINED_BY_NAME = {c.name: c for c in CONSTRAINED}


class Reference:
    """Greedy completions from an LLM with room for everything, computed once per prompt."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def tokens(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        missing = sorted({(tuple(p), m) for p, m in zip(prompts, max_tokens)} - self.cache.keys())
        if missing:
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p, _ in missing],
                                     [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in missing],
                                     use_tqdm=False)
            self.cache.update((key, out.outputs[0].token_ids) for key, out in zip(missing, outs))
        return [self.cache[(tuple(p), m)] for p, m in zip(prompts, max_tokens)]


@pytest.fixture(scope="module")
def reference(tiny_models) -> Reference:
    threads = torch.get_num_threads()  # num_threads is the process's: put it back afterwards
    with LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=_MAX_MODEL_LEN, num_threads=_THREADS) as llm:
        yield Reference(llm)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def constrained(tiny_models, reference) -> dict[str, LLM]:
    """One LLM per `CONSTRAINED` config and scheduling mode (by name, and by name plus
    " async"), shared by every example of the module."""
    bytes_per_block = reference.llm.llm_engine.model_runner.kv_cache.bytes_per_token * 16
    llms = {
        c.name + (" async" if mode else ""): LLM(
            str(tiny_models["llama"]), dtype="float32", max_model_len=_MAX_MODEL_LEN, block_size=16,
            kv_cache_memory=c.num_blocks * bytes_per_block, max_num_batched_tokens=c.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs, scheduling_policy=c.policy, enable_prefix_caching=c.enable_prefix_caching,
            enable_chunked_prefill=c.enable_chunked_prefill, async_scheduling=mode, num_threads=_THREADS)
        for c in CONSTRAINED for mode in (False, True)
    }
    for name, llm in llms.items():
        assert llm.llm_engine.block_manager.num_blocks == CONSTRAINED_BY_NAME[name.removesuffix(" async")].num_blocks
    yield llms
    for llm in llms.values():
        llm.close()


@dataclass
class E2ERequest:
    prompt: list[int]
    max_tokens: int
    n: int
    priority: int


@st.composite
def e2e_requests(draw: st.DrawFn) -> list[E2ERequest]:
    """1-8 prompts of 1-60 tokens, many starting with one of three shared prefixes."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    bases = [[rng.randrange(3, _TINY_VOCAB) for _ in range(60)] for _ in range(3)]
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        length = draw(st.integers(1, 60))
        shared = draw(st.integers(0, length))
        base = bases[draw(st.integers(0, 2))]
        prompt = base[:shared] + [rng.randrange(3, _TINY_VOCAB) for _ in range(length - shared)]
        requests.append(E2ERequest(prompt, draw(st.integers(1, 40)), draw(st.sampled_from([1, 2])),
                                   draw(st.integers(0, 3))))
    return requests


def submit_args(config: ConstrainedConfig, requests: list[E2ERequest]) -> dict:
    """`generate` arguments for the requests (priorities only under the priority policy)."""
    return dict(
        prompts=[{"prompt_token_ids": r.prompt} for r in requests],
        sampling_params=[SamplingParams(temperature=1.0, top_k=1, max_tokens=r.max_tokens, n=r.n, ignore_eos=True)
                         for r in requests],
        priority=[r.priority for r in requests] if config.policy == "priority" else None,
        use_tqdm=False,
    )


def check_idle_and_every_block_free(llm: LLM) -> None:
    """No request left in the engine; every block free (some may still hold cached prefixes)."""
    engine = llm.llm_engine
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert not bm.pending_copies


def check_matches_reference(outputs, requests: list[E2ERequest], reference: Reference) -> None:
    expected = reference.tokens([r.prompt for r in requests], [r.max_tokens for r in requests])
    for out, request, tokens in zip(outputs, requests, expected):
        assert out.finished and len(out.outputs) == request.n
        for completion in out.outputs:
            assert completion.finish_reason == "length"
            assert completion.token_ids == tokens


_E2E_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow])


@_E2E_SETTINGS
@given(config=st.sampled_from(CONSTRAINED), requests=e2e_requests(), mode=st.sampled_from(["", " async"]))
def test_constrained_llm_generates_what_an_unconstrained_one_does(constrained, reference, config, requests, mode):
    llm = constrained[config.name + mode]
    outputs = llm.generate(**submit_args(config, requests))
    check_matches_reference(outputs, requests, reference)
    check_idle_and_every_block_free(llm)


@_E2E_SETTINGS
@given(config=st.sampled_from(CONSTRAINED), requests=e2e_requests(), num_taken=st.integers(0, 8),
       mode=st.sampled_from(["", " async"]))
def test_closing_generate_as_completed_early_returns_every_block(constrained, reference, config, requests,
                                                                 num_taken, mode):
    llm = constrained[config.name + mode]
    args = submit_args(config, requests)
    finished = iter(llm.generate_as_completed(**args))
    taken = list(itertools.islice(finished, num_taken))
    finished.close()
    check_idle_and_every_block_free(llm)
    check_matches_reference([out for _, out in taken], [requests[i] for i, _ in taken], reference)
    # The engine is as good as new: the next call matches the reference.
    check_matches_reference(llm.generate(**args), requests, reference)
    check_idle_and_every_block_free(llm)


def test_the_constrained_configs_do_preempt(constrained, reference):
    """The small caches above really run out: every config preempts on a heavy workload."""
    rng = random.Random(7)
    requests = [E2ERequest([rng.randrange(3, _TINY_VOCAB) for _ in range(rng.randint(20, 60))], 40, rng.choice([1, 2]),
                           rng.randint(0, 3)) for _ in range(8)]
    for config, mode in itertools.product(CONSTRAINED, ["", " async"]):
        llm = constrained[config.name + mode]
        before = llm.llm_engine.scheduler.num_preemptions
        check_matches_reference(llm.generate(**submit_args(config, requests)), requests, reference)
        assert llm.llm_engine.scheduler.num_preemptions > before, config.name
        check_idle_and_every_block_free(llm)
