"""Data parallelism on a CPU: two replicas (this process's engine and a child process)
give the same tokens as one, greedy, seeded, with LoRA and with structured outputs, in
input order; `deal` balances a call by estimated work; `generate_as_completed` merges the
replicas' streams as requests finish; stopping early, Ctrl-C and resetting the prefix
cache reach every replica; a replica that dies fails the call instead of hanging; no
replica outlives its LLM or the process that owns it; plans the machine cannot hold fail
before anything starts.

Every engine runs in float32 on the CPU (the tiny models' logits are far from ties in
float32), so that 1 and 2 replicas can be compared token for token. Each LLM is built
once per module: one with 2 replicas takes a few seconds to start.
"""

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, LoRARequest, SamplingParams
from engine.entrypoints.data_parallel import deal, estimated_work
import engine.distributed.plan as plan_module
from engine.distributed.process import WorkerError
from engine.entrypoints.inputs import PromptType, Request, RequestChecker, valid_requests
from engine.outputs import RequestOutput
from engine.structured_output.params import StructuredOutputsParams
from tests.lora_adapters import build_lora_adapter
from tests.processes import child_pids, is_gone, wait_until_gone, within


REPO = Path(__file__).resolve().parents[2]
VOCAB = 320  # the tiny models' vocabulary
# Every LLM of this module: float32 on the CPU, room for the long requests of the merge test.
SETTINGS: dict[str, Any] = {"dtype": "float32", "device": "cpu", "max_model_len": 512}
TEXTS = ["The quick brown fox", "Paris is the capital of", "A paged KV cache stores keys", "Numbers: 0 1 2"]
CHOICES = ["apple", "banana", "cherry pie"]
# How long a call that should fail may take before the test calls it a hang.
HANG_S = 60.0


# -- helpers -------------------------------------------------------------------------------


@dataclass
class Pair:
    """The same model and settings with one replica and with two."""

    one: LLM
    two: LLM


Completions = list[list[tuple[list[int], str]]]


def completions(outputs: list[RequestOutput]) -> Completions:
    """Each output's completions as (token ids, text), in order."""
    return [[(c.token_ids, c.text) for c in output.outputs] for output in outputs]


def token_prompts(count: int, seed: int, length: tuple[int, int] = (3, 40)) -> list[dict[str, list[int]]]:
    """`count` prompts of random token ids, of lengths drawn from `length` (inclusive)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randint(*length))]}
            for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def shares_of(llm: LLM, prompts: Sequence[PromptType], params: SamplingParams | Sequence[SamplingParams],
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[list[int]]:
    """The indices of the rows each replica of a 2-replica `llm` runs, as `LLM._run` deals them."""
    requests = valid_requests(RequestChecker(llm.llm_engine).check(prompts, params, lora_request, None))
    return deal(requests, 2, llm.max_model_len)


def make_request(prompt_len: int, max_tokens: int | None, n: int = 1) -> Request:
    """A checked request of `prompt_len` tokens and `n` completions of at most `max_tokens`."""
    params = SamplingParams(temperature=1.0 if n > 1 else 0, max_tokens=max_tokens, n=n)
    return Request(None, [5] * prompt_len, params, 0, None)


class HookBar:
    """A tqdm stand-in for `use_tqdm` that calls `hook(requests finished so far)` each
    time the call updates its progress (after every step of this process's engine)."""

    def __init__(self, hook: Callable[[int], None]) -> None:
        self.hook = hook
        self.finished = 0
        self.postfix = ""

    def update(self, count: int) -> None:
        self.finished += count
        self.hook(self.finished)

    def close(self) -> None:
        pass


def bar_calling(hook: Callable[[int], None]) -> Callable[..., HookBar]:
    """A `use_tqdm` factory whose bars call `hook` (see `HookBar`)."""
    return lambda **tqdm_arguments: HookBar(hook)






def wait_for_exit(pid: int) -> None:
    """Blocks until child `pid` of this process has exited, without reaping it."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def read_lines(process: subprocess.Popen, count: int, seconds: float) -> list[str]:
    """The first `count` lines `process` prints, waiting up to `seconds` in all."""
    fd, data = process.stdout.fileno(), b""
    deadline = time.monotonic() + seconds
    while data.count(b"\n") < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            pytest.fail(f"no {count} lines from the script within {seconds} s; got {data!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            pytest.fail(f"the script exited (code {process.wait()}) after printing {data!r}")
        data += chunk
    return data.decode().splitlines()[:count]


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llms(make_llm) -> Pair:
    """The tiny Llama with 1 and 2 replicas, shared by the module's tests (each leaves
    them with no call running)."""
    return Pair(make_llm(**SETTINGS), make_llm(**SETTINGS, data_parallel_size=2))


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory) -> LoRARequest:
    """A random rank-4 adapter of the tiny Llama's q and v projections."""
    folder = build_lora_adapter(tiny_models["llama"], tmp_path_factory.mktemp("dp_lora") / "adapter", seed=0, rank=4,
                                alpha=8, target_modules=["q_proj", "v_proj"])
    return LoRARequest("adapter", 1, str(folder))


@pytest.fixture(scope="module")
def lora_llms(make_llm) -> Pair:
    """The tiny Llama with LoRA enabled, with 1 and 2 replicas."""
    lora = dict(SETTINGS, enable_lora=True, max_lora_rank=8)
    return Pair(make_llm(**lora), make_llm(**lora, data_parallel_size=2))


# -- dealing (no processes) ----------------------------------------------------------------


def test_estimated_work_counts_the_prompt_and_every_completions_tokens():
    """A request's work is its prompt plus its completions' most tokens, each generated
    token weighing at least a prompt token; max_tokens None or past the context is what
    the context leaves."""
    def decode(prompt_len: int, max_tokens: int | None, n: int = 1, max_model_len: int = 128) -> int:
        return estimated_work(make_request(prompt_len, max_tokens, n), max_model_len) - prompt_len

    assert decode(10, 20) >= 20
    assert decode(10, 20, n=2) == decode(10, 40) == 2 * decode(10, 20) == 2 * decode(30, 20)
    assert decode(10, None) == decode(10, 118) == decode(10, 1000)
    assert decode(10, None, max_model_len=64) == decode(10, 54)


@pytest.mark.parametrize("works, num_replicas, expected", [
    ([(10, 10)] * 4, 2, [[0, 2], [1, 3]]),  # equal work: alternately, ties to the lowest replica
    ([(10, 10)], 3, [[0], [], []]),  # fewer requests than replicas
    ([], 2, [[], []]),
    # Two long requests among short ones go to different replicas, the short ones fill in around them.
    ([(5, 2), (5, 100), (5, 2), (5, 2), (5, 100), (5, 2)], 2, [[0, 1, 3], [2, 4, 5]]),
    ([(5, 2), (5, 100), (5, 100), (5, 2), (5, 100)], 3, [[0, 1], [2, 3], [4]]),
], ids=["ties", "fewer-requests", "empty", "two-long", "three-long"])
def test_deal_examples(works, num_replicas, expected):
    """`deal` on small cases, (prompt tokens, max_tokens) per request: largest first to
    the least loaded replica, ties to the lowest, each share in input order."""
    requests = [make_request(prompt, max_tokens) for prompt, max_tokens in works]
    assert deal(requests, num_replicas, 512) == expected


@settings(max_examples=200, deadline=None)
@given(works=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 100), st.integers(1, 3)), max_size=40),
       num_replicas=st.integers(1, 4))
def test_deal_gives_every_request_once_balanced_and_in_order(works, num_replicas):
    """For any requests and replicas: every index is in exactly one share, each share is
    in input order, and no replica has more work than another by more than the largest
    request (the last request dealt to the busiest replica went to the least loaded);
    the longest requests go to different replicas."""
    requests = [make_request(prompt, max_tokens, n) for prompt, max_tokens, n in works]
    shares = deal(requests, num_replicas, 512)
    assert len(shares) == num_replicas
    assert sorted(i for share in shares for i in share) == list(range(len(requests)))
    assert all(share == sorted(share) for share in shares)
    work = [estimated_work(r, 512) for r in requests]
    loads = [sum(work[i] for i in share) for share in shares]
    if requests:
        assert max(loads) - min(loads) <= max(work)
    longest = sorted(range(len(requests)), key=lambda i: -work[i])[:num_replicas]
    replica_of = {i: d for d, share in enumerate(shares) for i in share}
    assert len({replica_of[i] for i in longest}) == len(longest)


# -- equal outputs -------------------------------------------------------------------------


def mixed_batch(sampling: str, count: int = 15, seed: int = 0) -> tuple[list[PromptType], list[SamplingParams]]:
    """Text and token-id prompts of 3 to 60 tokens with 1 to 24 new tokens (an odd
    count: 2 replicas cannot get as many rows each). "greedy":
    greedy rows, with a seeded n=2 row in every four (greedy needs n=1); "seeded": every
    row sampled (temperature 0.8 or 1.0, top_p 0.9) with a seed of its own, n=2 in every
    four, some stopping at EOS."""
    rng = random.Random(seed)
    prompts: list[PromptType] = []
    params = []
    for i in range(count):
        if i % 3 == 0:
            prompts.append(f"{TEXTS[i % len(TEXTS)]} {i}")
        else:
            prompts.append({"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 60))]})
        max_tokens = rng.randint(1, 24)
        if sampling == "greedy" and i % 4 != 1:
            params.append(greedy(max_tokens))
        else:
            params.append(SamplingParams(temperature=0.8 if i % 2 else 1.0, top_p=0.9, seed=1000 + i,
                                         n=2 if i % 4 == 1 else 1, max_tokens=max_tokens, ignore_eos=i % 2 == 0))
    return prompts, params


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_two_replicas_give_the_outputs_of_one_in_input_order(llms, sampling):
    """Greedy and seeded rows of different lengths, dealt unevenly over 2 replicas, give
    the tokens and text of 1 replica: seeds belong to the request, not to the replica
    that runs it; outputs come back in input order (each with its own prompt)."""
    prompts, params = mixed_batch(sampling)
    shares = shares_of(llms.two, prompts, params)
    assert all(shares) and len(shares[0]) != len(shares[1]), shares
    one = llms.one.generate(prompts, params, use_tqdm=False)
    two = llms.two.generate(prompts, params, use_tqdm=False)
    assert completions(two) == completions(one)
    for prompt, p, out, ref in zip(prompts, params, two, one):
        if isinstance(prompt, str):
            assert out.prompt == prompt
        else:
            assert out.prompt is None and out.prompt_token_ids == prompt["prompt_token_ids"]
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert len(out.outputs) == p.n and all(len(c.token_ids) <= p.max_tokens for c in out.outputs)
    if sampling == "seeded":
        greedy_one = llms.one.generate(prompts, [greedy(p.max_tokens) for p in params], use_tqdm=False)
        assert [c[0] for c in completions(one)] != [c[0] for c in completions(greedy_one)], "nothing was sampled"


@pytest.mark.parametrize("count", [0, 1], ids=["no-prompt", "one-prompt"])
def test_a_call_smaller_than_the_replicas(llms, count):
    """A call with no prompt returns none; one with a single prompt leaves replica 1
    idle and still returns its output."""
    prompts = TEXTS[:count]
    two = llms.two.generate(prompts, greedy(8), use_tqdm=False)
    assert completions(two) == completions(llms.one.generate(prompts, greedy(8), use_tqdm=False))
    assert len(two) == count


def test_lora_rows_on_both_replicas_match_one_replica(lora_llms, adapter):
    """Rows with an adapter and without, dealt to both replicas, give the tokens of one
    replica, and the adapter changes them (an adapter that changes nothing tests nothing)."""
    prompts = token_prompts(4, seed=1, length=(12, 12)) * 2  # equal work: dealt alternately
    adapters = [adapter if i in (0, 3, 5, 6) else None for i in range(len(prompts))]
    params = greedy(12)
    shares = shares_of(lora_llms.two, prompts, params, adapters)
    assert all({adapters[i] for i in share} == {adapter, None} for share in shares), shares
    one = lora_llms.one.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    two = lora_llms.two.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    assert completions(two) == completions(one)
    assert [out.lora_request for out in two] == adapters
    tokens = completions(two)  # rows k and k + 4: the same prompt, once with the adapter and once without
    assert any(tokens[k] != tokens[k + 4] for k in range(4))


def test_structured_outputs_on_both_replicas_match_one_replica(llms):
    """`choice`-constrained rows, greedy and seeded (n=2), among free rows, dealt to both
    replicas, give the tokens of one replica, and every stopped completion is a choice."""
    choice = StructuredOutputsParams(choice=CHOICES)
    prompts, params = [], []
    for i in range(9):
        prompts.append(f"{TEXTS[i % len(TEXTS)]} {i}")
        params.append([SamplingParams(temperature=0, max_tokens=32, structured_outputs=choice),
                       SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=32, structured_outputs=choice),
                       greedy(10)][i % 3])
    shares = shares_of(llms.two, prompts, params)
    assert all(any(params[i].structured_outputs for i in share) for share in shares), shares
    one = llms.one.generate(prompts, params, use_tqdm=False)
    two = llms.two.generate(prompts, params, use_tqdm=False)
    assert completions(two) == completions(one)
    stopped = [c.text for out, p in zip(two, params) if p.structured_outputs for c in out.outputs
               if c.finish_reason == "stop"]
    assert stopped and all(text in CHOICES for text in stopped), stopped


# -- merging, stopping early, counters -------------------------------------------------------


def test_as_completed_merges_replica_1_before_replica_0_finishes(llms):
    """One long request (index 0, 300 tokens) is dealt to replica 0 alone and eight
    2-token ones to replica 1: `generate_as_completed` yields replica 1's as they arrive,
    every index once, index 0 last, not in input order. Replica 0 is held back after each
    of its steps until replica 1 has reported something, until all of replica 1's
    requests are in, so the order does not depend on the two processes' speeds (replica 1
    sends a few reports at most before its requests finish, far fewer than 300)."""
    prompts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(9)]
    params = [greedy(300)] + [greedy(2)] * 8
    assert shares_of(llms.two, prompts, params) == [[0], list(range(1, 9))]
    replica_1 = llms.two._replicas.replicas[0].conn  # white-box: the parent's end of replica 1's connection
    deadline = time.monotonic() + HANG_S

    def hold_back(finished: int) -> None:
        if finished < 8:
            wait([replica_1], max(0.0, deadline - time.monotonic()))

    merged = list(llms.two.generate_as_completed(prompts, params, use_tqdm=bar_calling(hold_back)))
    order = [index for index, _ in merged]
    assert sorted(order) == list(range(9)) and order[-1] == 0, order
    outputs: list[RequestOutput] = [output for _, output in sorted(merged, key=lambda pair: pair[0])]
    assert completions(outputs) == completions(llms.one.generate(prompts, params, use_tqdm=False))
    assert [out.prompt for out in outputs] == prompts


def stop_early(llm: LLM) -> None:
    """Starts a call that keeps both replicas busy (200 tokens a row) and closes it once
    the short row (index 0, 2 tokens), dealt to replica 1, is out: replica 1's report of
    it also gave the long rows it still had running."""
    prompts = TEXTS * 2
    params = [greedy(2)] + [greedy(200)] * (len(prompts) - 1)
    assert 0 in shares_of(llm, prompts, params)[1]
    call = llm.generate_as_completed(prompts, params, use_tqdm=False)
    for index, _ in call:
        if index == 0:
            break
    call.close()


def test_a_call_after_stopping_early_is_correct(llms):
    """Closing `generate_as_completed` while both replicas are busy aborts the call on
    both: a new call on the same LLM returns its own prompts' correct outputs (no request
    or output of the old call leaks into it)."""
    stop_early(llms.two)
    prompts = [f"{text} again" for text in TEXTS] * 2
    params = [greedy(4 + i) for i in range(len(prompts))]
    two = within(HANG_S, lambda: llms.two.generate(prompts, params, use_tqdm=False))
    assert [out.prompt for out in two] == prompts
    assert completions(two) == completions(llms.one.generate(prompts, params, use_tqdm=False))


def test_stopping_early_leaves_no_unfinished_work_and_counts_every_token(llms):
    """After an early stop nothing runs anywhere: `unfinished_outputs()` is empty, and
    the next call's counters grow by exactly that call's tokens (what a replica generated
    before it dropped the stopped call counts with that call, not the next)."""
    stop_early(llms.two)
    assert llms.two.unfinished_outputs() == []
    before = llms.two.get_stats()
    llms.two.generate(TEXTS, greedy(8), use_tqdm=False)
    after = llms.two.get_stats()
    assert after.num_generated_tokens - before.num_generated_tokens == 8 * len(TEXTS)


def test_counters_grow_by_each_calls_work_on_every_replica(llms):
    """After a call, `get_stats()` has grown by exactly its prompt and generated tokens
    (replica 1's included, as its last report gave them) and `unfinished_outputs()` is
    empty."""
    llms.two.generate(TEXTS, greedy(2), use_tqdm=False)  # settles the counters of earlier tests
    prompts, params = mixed_batch("greedy", seed=3)
    assert all(shares_of(llms.two, prompts, params))
    before = llms.two.get_stats()
    outputs = llms.two.generate(prompts, params, use_tqdm=False)
    after = llms.two.get_stats()
    assert after.num_generated_tokens - before.num_generated_tokens == sum(
        len(c.token_ids) for out in outputs for c in out.outputs)
    assert (after.num_prompt_tokens_computed + after.num_cached_prompt_tokens
            - before.num_prompt_tokens_computed - before.num_cached_prompt_tokens
            == sum(len(out.prompt_token_ids) for out in outputs))
    assert after.num_steps > before.num_steps
    assert llms.two.unfinished_outputs() == []


def test_reset_prefix_cache_reaches_every_replica(llms):
    """A repeated call finds its prompts in both replicas' prefix caches; after
    `reset_prefix_cache()` (True: nothing was running) none is found."""
    prompts = token_prompts(4, seed=4, length=(40, 40))  # two full KV blocks each; equal work, dealt alternately
    assert all(shares_of(llms.two, prompts, greedy(2)))
    llms.two.generate(prompts, greedy(2), use_tqdm=False)
    assert all(out.num_cached_tokens > 0 for out in llms.two.generate(prompts, greedy(2), use_tqdm=False))
    assert llms.two.reset_prefix_cache() is True
    assert all(out.num_cached_tokens == 0 for out in llms.two.generate(prompts, greedy(2), use_tqdm=False))
    assert llms.two.reset_prefix_cache() is True


def test_ctrl_c_interrupts_the_call_and_the_llm_carries_on(llms):
    """Ctrl-C as a terminal sends it: SIGINT to every process of the LLM while a call
    runs, the parent's KeyboardInterrupt raised after the first finished request (from
    the progress bar). It reaches the caller; the replicas ignore SIGINT and abort the
    call, and the same LLM then returns correct outputs."""
    pids = llms.two.child_pids

    def interrupt(finished: int) -> None:
        if finished:
            for pid in pids:
                os.kill(pid, signal.SIGINT)
            raise KeyboardInterrupt

    prompts = TEXTS * 2
    params = [greedy(2)] + [greedy(200)] * (len(prompts) - 1)
    with pytest.raises(KeyboardInterrupt):
        within(HANG_S, lambda: llms.two.generate(prompts, params, use_tqdm=bar_calling(interrupt)))
    params = [greedy(6)] * len(prompts)
    two = within(HANG_S, lambda: llms.two.generate(prompts, params, use_tqdm=False))
    assert completions(two) == completions(llms.one.generate(prompts, params, use_tqdm=False))
    assert not any(is_gone(pid) for pid in pids)


# -- failures and processes ----------------------------------------------------------------


@pytest.mark.parametrize("when", ["between-calls", "during-a-call"])
def test_a_replica_that_dies_fails_the_call(tiny_models, when):
    """Replica 1 killed with SIGKILL, before a call or while it runs one: the call raises
    WorkerError naming the replica and the signal (within a time limit: no hang), every
    later call raises one that says to create a new LLM, and close() still works."""
    llm = LLM(str(tiny_models["llama"]), **SETTINGS, data_parallel_size=2)
    try:
        replica = llm.child_pids[0]

        def kill_replica(finished: int = 0) -> None:
            if not is_gone(replica):
                os.kill(replica, signal.SIGKILL)
                wait_for_exit(replica)

        if when == "between-calls":
            kill_replica()
        use_tqdm = bar_calling(kill_replica) if when == "during-a-call" else False
        prompts = TEXTS * 2
        assert all(shares_of(llm, prompts, greedy(100)))
        with pytest.raises(WorkerError, match=r"data-parallel replica 1 .*SIGKILL"):
            within(HANG_S, lambda: llm.generate(prompts, greedy(100), use_tqdm=use_tqdm))
        with pytest.raises(WorkerError, match="create a new LLM"):
            within(HANG_S, lambda: llm.generate(prompts, greedy(4), use_tqdm=False))
    finally:
        within(HANG_S, llm.close)


def test_close_leaves_no_replica_process(tiny_models):
    """`close()` stops every replica: their processes are gone (or zombies) at once."""
    llm = LLM(str(tiny_models["llama"]), **SETTINGS, data_parallel_size=2)
    pids = llm.child_pids
    assert len(pids) == 1 and not is_gone(pids[0])
    llm.generate(TEXTS, greedy(4), use_tqdm=False)
    llm.close()
    assert wait_until_gone(pids, 5.0) == []


# The LLM owner of the SIGKILL test: it prints its replicas' pids, then a line once a long
# call has started on both replicas (the bar's first update comes after replica 1 got its share).
_OWNER_SCRIPT = """
import json, sys
from engine import LLM, SamplingParams

class SayRunning:
    def __init__(self, **tqdm_arguments):
        self.postfix, self.said = "", False
    def update(self, count):
        if not self.said:
            print("running", flush=True)
            self.said = True
    def close(self):
        pass

llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=512, data_parallel_size=2)
print(json.dumps(llm.child_pids), flush=True)
llm.generate(["The quick brown fox"] * 64, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
             use_tqdm=SayRunning)
"""


def test_replicas_exit_when_their_owner_is_killed(tiny_models, tmp_path):
    """A process that owns a 2-replica LLM, killed with SIGKILL while replica 1 is busy
    with its share of a call, leaves no replica behind: each exits within seconds."""
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as err:
        owner = subprocess.Popen([sys.executable, "-c", _OWNER_SCRIPT, str(tiny_models["llama"])], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=err)
    try:
        pids_line, running = read_lines(owner, 2, 120)
        pids = json.loads(pids_line)
        assert len(pids) == 1 and running == "running", stderr.read_text()
        assert not is_gone(pids[0])
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    assert wait_until_gone(pids, 10.0) == []


@pytest.mark.parametrize("tensor_parallel_size, data_parallel_size", [(1, 3), (2, 2)])
def test_more_processes_than_cores_fail_before_anything_starts(tiny_models, monkeypatch, tensor_parallel_size,
                                                                data_parallel_size):
    """With 2 usable cores, a plan of 3 or 4 processes raises ValueError at once, naming
    the sizes, the cores and the fix, and starts no process."""
    monkeypatch.setattr(plan_module, "available_cpus", lambda: 2)
    usable = min(len(os.sched_getaffinity(0)), 2)
    count = tensor_parallel_size * data_parallel_size
    children, started = child_pids(), time.monotonic()
    message = (rf"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} = {count} "
               rf"processes, but this process may use {usable} CPU core\(s\).*lower tensor_parallel_size or "
               rf"data_parallel_size so that their product is at most {usable}")
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_models["llama"]), **SETTINGS, tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size)
    assert time.monotonic() - started < 5.0
    assert child_pids() <= children
