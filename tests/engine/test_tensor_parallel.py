"""Tensor parallelism on a CPU: two ranks (this process and a child over gloo) give the
same tokens as one, with every scheduler feature, LoRA, structured outputs and seeded
sampling; workers never outlive the engine or its process; a rank that dies or raises
fails the call with its own error; plans that cannot run fail before anything starts;
each rank reads only its slices of the checkpoint.

Every engine is float32 (a tensor-parallel sum rounds differently from one rank's, and
the tiny models' logits are far from ties in float32), with short generations: each
step costs several all-reduces of about 1.5 ms over the loopback.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine import LLM, LoRARequest, SamplingParams
from engine.config import EngineConfig
from engine.distributed.communicator import TensorParallelGroup
import engine.distributed.plan as plan_module
from engine.distributed.plan import check_tensor_parallel, plan_parallelism
from engine.distributed.process import WorkerError
from engine.layers.linear import Linear, ShardSlice
from engine.model_loader import loader as model_loader
from engine.model_loader.folder import check_model_folder
from engine.model_loader.model_config import resolve_model_config
from engine.model_loader.weights import CheckpointTensor
from engine.outputs import RequestOutput
from engine.structured_output.params import StructuredOutputsParams
from tests.lora_adapters import build_lora_adapter
from tests.processes import child_pids, is_gone, wait_until_gone, within
from tests.tiny_models import FAMILIES, build_tiny_model


REPO = Path(__file__).resolve().parents[2]
VOCAB = 320  # the tiny models' vocabulary
BLOCK_SIZE = 16
# A 4-head model with 1 key/value head: each of 2 ranks holds a copy of it.
ONE_KV_HEAD = "llama-1kv"
# Each family whose layers split differently over ranks (Llama 3 and Mistral split as Llama
# does, Qwen3-MoE as Qwen3's attention and Mixtral's experts), and a model with one KV head.
MODELS = (*(f for f in FAMILIES if f not in ("llama3", "mistral", "qwen3_moe")), ONE_KV_HEAD)
# Room for 10 blocks: the mixed batch below needs over twice that, so the scheduler preempts.
KV_CACHE_TOKENS = 10 * BLOCK_SIZE
# Below every prompt's length, so that prompts are computed in chunks.
STEP_TOKENS = 32
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# -- helpers -------------------------------------------------------------------------------






def worker_pids(llm: LLM) -> list[int]:
    """The process ids of the LLM's tensor-parallel ranks other than 0."""
    return llm.llm_engine.model_runner.workers.pids


def kv_bytes_per_token(folder: Path, tensor_parallel_size: int) -> int:
    """Bytes of float32 keys and values one token takes on one rank: each rank holds its
    share of the key/value heads, or a copy of one when there are fewer than ranks."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = max(1, config["num_key_value_heads"] // tensor_parallel_size)
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * 4


def engine_settings(folder: Path, tensor_parallel_size: int, **extra: Any) -> dict[str, Any]:
    """Float32, prompts in chunks of `STEP_TOKENS` and a KV cache of `KV_CACHE_TOKENS`
    tokens on every rank (kv_cache_memory is per rank): the same blocks, and so the same
    schedule, whatever the number of ranks."""
    return dict(dtype="float32", tensor_parallel_size=tensor_parallel_size, max_model_len=128,
                max_num_batched_tokens=STEP_TOKENS, block_size=BLOCK_SIZE,
                kv_cache_memory=KV_CACHE_TOKENS * kv_bytes_per_token(folder, tensor_parallel_size), **extra)


def token_prompts(count: int, seed: int, shared_prefix: int = 0, length: tuple[int, int] = (3, 8)) -> list[dict]:
    """`count` prompts of random token ids: a common prefix of `shared_prefix` tokens,
    then `length` (low, high) tokens of their own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(*length))]}
            for _ in range(count)]


# Four prompts sharing 40 tokens (2.5 blocks: prefix hits), two of 36-60 tokens of their
# own; all longer than a step's budget, and together more than the KV cache holds.
MIXED_BATCH = token_prompts(4, seed=1, shared_prefix=40) + token_prompts(2, seed=2, length=(36, 60))


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    """Every completion's token ids, request by request."""
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@dataclass
class EnginePair:
    """One model on one rank and on two, with the same settings."""

    tp1: LLM
    tp2: LLM

    def generate(self, prompts: list[dict], params: SamplingParams | list[SamplingParams],
                 **kwargs: Any) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """The same call on both engines: (one rank's outputs, two ranks')."""
        return tuple(llm.generate(prompts, params, use_tqdm=False, **kwargs) for llm in (self.tp1, self.tp2))


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model of every family, and `ONE_KV_HEAD`: fewer key/value heads than ranks."""
    folder = tmp_path_factory.mktemp("tp_models") / ONE_KV_HEAD
    return {**tiny_models, ONE_KV_HEAD: build_tiny_model(folder, "llama", num_key_value_heads=1)}


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[EnginePair]:
    """The model named by the test's parameter on one rank and on two (`engine_settings`);
    module-scoped, so tests of one model share the pair and only one pair is alive."""
    folder = models[request.param]
    tp1 = LLM(str(folder), **engine_settings(folder, 1))
    try:
        tp2 = LLM(str(folder), **engine_settings(folder, 2))
    except BaseException:
        tp1.close()
        raise
    yield EnginePair(tp1, tp2)
    tp2.close()
    tp1.close()


@pytest.fixture(scope="module")
def llama_tp2_async(models: dict[str, Path]) -> Iterator[LLM]:
    """The tiny Llama on two ranks with asynchronous scheduling (off by default on a CPU)."""
    with LLM(str(models["llama"]), **engine_settings(models["llama"], 2, async_scheduling=True)) as llm:
        yield llm


@pytest.fixture(scope="module")
def adapters(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    """Two random adapters for the tiny Qwen2 on every projection: column-parallel
    (q, k, v, gate, up: B split by rows) and row-parallel (o, down: A split by columns)."""
    root = tmp_path_factory.mktemp("tp_adapters")
    return [LoRARequest(f"a{i}", i + 1, str(build_lora_adapter(models["qwen2"], root / f"a{i}", rank=8, alpha=16,
                                                               target_modules=ATTENTION + MLP, seed=20 + i)))
            for i in range(2)]


@pytest.fixture(scope="module")
def lora_pair(models: dict[str, Path]) -> Iterator[EnginePair]:
    """The tiny Qwen2 on one rank and on two, with two adapter slots."""
    settings = {"dtype": "float32", "max_model_len": 128, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    with LLM(str(models["qwen2"]), **settings) as tp1, \
            LLM(str(models["qwen2"]), tensor_parallel_size=2, **settings) as tp2:
        yield EnginePair(tp1, tp2)


# -- the same tokens on two ranks as on one --------------------------------------------


@pytest.mark.parametrize("pair", MODELS, indirect=True)
def test_two_ranks_give_one_ranks_greedy_tokens_through_chunks_prefix_hits_and_preemption(pair: EnginePair) -> None:
    """Every way of splitting a family's layers, and a model with fewer key/value heads than
    ranks, gives the same greedy tokens on two ranks as on one, while the two-rank engine computes prompts in
    chunks, reuses cached prefixes and preempts (its KV cache, per rank, holds a third of
    the batch); each rank holds half the key/value heads, or a copy of the only one."""
    engine = pair.tp2.llm_engine
    preemptions = engine.scheduler.num_preemptions
    one, two = pair.generate(MIXED_BATCH, GREEDY)
    assert token_ids(two) == token_ids(one)
    assert engine.scheduler.num_preemptions > preemptions
    assert any(o.num_cached_tokens > 0 for o in two)
    assert all(len(p["prompt_token_ids"]) > STEP_TOKENS for p in MIXED_BATCH)
    assert engine.kv_cache_tokens == pair.tp1.llm_engine.kv_cache_tokens == KV_CACHE_TOKENS
    halved = pair.tp1.llm_engine.model_config.hf_config.num_key_value_heads >= 2  # else the one head is copied
    one_rank_bytes = pair.tp1.llm_engine.model_runner.kv_cache.bytes_per_token
    assert engine.model_runner.kv_cache.bytes_per_token == (one_rank_bytes // 2 if halved else one_rank_bytes)


@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_asynchronous_scheduling_on_two_ranks_gives_one_ranks_tokens(pair: EnginePair, llama_tp2_async: LLM) -> None:
    """With async_scheduling=True (each step launched before the previous one's tokens
    are read back, the ranks' forward passes queued behind it) two ranks still give one
    rank's greedy tokens, through chunks and preemption."""
    preemptions = llama_tp2_async.llm_engine.scheduler.num_preemptions
    asynchronous = llama_tp2_async.generate(MIXED_BATCH, GREEDY, use_tqdm=False)
    assert token_ids(asynchronous) == token_ids(pair.tp1.generate(MIXED_BATCH, GREEDY, use_tqdm=False))
    assert llama_tp2_async.llm_engine.scheduler.num_preemptions > preemptions


@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_a_draft_model_on_two_ranks_gives_one_ranks_tokens(pair: EnginePair, models: dict[str, Path]) -> None:
    """Speculative decoding with a draft model (the target itself, whole, on the first rank)
    on two ranks gives one rank's greedy tokens through chunks and preemption. The first
    rank's budget holds its half of the target's cache and the whole draft's: given three
    times a half's budget, the ranks agree on one rank's blocks."""
    folder = models["llama"]
    settings = engine_settings(folder, 2, speculative_config={"model": str(folder), "num_speculative_tokens": 3})
    settings["kv_cache_memory"] *= 3
    with LLM(str(folder), **settings) as llm:
        speculated = llm.generate(MIXED_BATCH, GREEDY, use_tqdm=False)
        assert llm.llm_engine.kv_cache_tokens == KV_CACHE_TOKENS
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert llm.get_stats().acceptance_rate > 0.9
    assert token_ids(speculated) == token_ids(pair.tp1.generate(MIXED_BATCH, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_structured_outputs_on_two_ranks(pair: EnginePair, llama_tp2_async: LLM, scheduling: str) -> None:
    """A choice constraint (a grammar masking the gathered logits on rank 0) gives one of
    the choices, and the same one as on one rank, with either scheduling."""
    choices = ["yes", "no", "maybe", "perhaps not"]
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices))
    prompts = token_prompts(6, seed=3, length=(5, 20))
    tp2 = pair.tp2 if scheduling == "sync" else llama_tp2_async
    two = tp2.generate(prompts, params, use_tqdm=False)
    one = pair.tp1.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in two] == [o.outputs[0].text for o in one]
    assert {o.outputs[0].text for o in two} <= set(choices)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_seeded_sampling_on_two_ranks(pair: EnginePair, llama_tp2_async: LLM, scheduling: str) -> None:
    """Seeded random sampling (n=1 and n=2) gives the same tokens on two ranks as on one:
    rank 0 samples alone, from the whole vocabulary's gathered logits."""
    prompts = token_prompts(6, seed=4, length=(5, 30))
    params = [SamplingParams(temperature=0.8, seed=100 + i, n=1 + i % 2, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    tp2 = pair.tp2 if scheduling == "sync" else llama_tp2_async
    two = tp2.generate(prompts, params, use_tqdm=False)
    one = pair.tp1.generate(prompts, params, use_tqdm=False)
    assert token_ids(two) == token_ids(one)
    assert len({tuple(c[0]) for c in token_ids(one)}) == len(prompts)  # sampled, not one repeated answer


def test_mixed_lora_batch_on_two_ranks(lora_pair: EnginePair, adapters: list[LoRARequest]) -> None:
    """A batch mixing two adapters (two slots) and none gives the same greedy tokens on
    two ranks as on one: each rank applies its slices of A and B, and the row-parallel
    projections' partial deltas are summed with their products."""
    prompts = [p for p in token_prompts(3, seed=5, length=(10, 40)) for _ in range(3)]
    rows = [None, *adapters] * 3
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one, two = lora_pair.generate(prompts, params, lora_request=rows)
    assert token_ids(two) == token_ids(one)
    for first in range(0, len(rows), 3):  # each prompt's three rows differ: the adapters change the tokens
        assert len({tuple(c[0]) for c in token_ids(one[first:first + 3])}) == 3
    assert lora_pair.tp2.llm_engine.lora_manager.stats.num_slot_loads >= 2


# -- worker processes ------------------------------------------------------------------


def test_close_leaves_no_worker_process(models: dict[str, Path]) -> None:
    """close() stops and reaps the other ranks' processes."""
    llm = LLM(str(models["llama"]), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    pids = worker_pids(llm)
    assert len(pids) == 1 and set(pids) <= child_pids()
    llm.generate("a b c", GREEDY, use_tqdm=False)
    llm.close()
    assert wait_until_gone(pids, 5) == []


# Builds a two-rank engine, then prints its workers' pids and, idle, sleeps; or starts a
# long call and prints them once its first request is done (the call then goes on).
_PARENT_SCRIPT = """
import json, sys, time
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, max_model_len=512)
pids = json.dumps(llm.llm_engine.model_runner.workers.pids)
if sys.argv[2] == "idle":
    print(pids, flush=True)
    time.sleep(300)
params = [SamplingParams(temperature=0, max_tokens=1 if i == 0 else 480, ignore_eos=True) for i in range(16)]
for index, _ in llm.generate_as_completed(["a b c"] * 16, params, use_tqdm=False):
    if index == 0:
        print(pids, flush=True)
"""


@pytest.mark.parametrize("parent_state", ["idle", "generating"])
def test_workers_exit_when_their_parent_is_killed(models: dict[str, Path], tmp_path: Path,
                                                  parent_state: str) -> None:
    """A process holding a two-rank engine, killed with SIGKILL (no cleanup runs) while
    idle or in the middle of a call, leaves no worker running: each exits on its own."""
    stderr_path = tmp_path / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with stderr_path.open("w") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", _PARENT_SCRIPT, str(models["llama"]), parent_state],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = within(120, parent.stdout.readline)
        assert line, f"the script printed no pids; its stderr:\n{stderr_path.read_text()}"
        pids = json.loads(line)
        assert len(pids) == 1 and not is_gone(pids[0])
        parent.kill()
        parent.wait()
        assert wait_until_gone(pids, 10) == [], "a worker outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()


# -- failures in a rank --------------------------------------------------------------------


def test_a_rank_that_dies_fails_the_call(models: dict[str, Path]) -> None:
    """A rank killed with SIGKILL fails the next call with WorkerError naming the rank
    and the signal (not a hang in a collective waiting for it); every later call says to
    create a new LLM, and close() still works. The call starts at once, while the rank
    may still be exiting (its sockets closed, its exit status not yet there)."""
    llm = LLM(str(models["llama"]), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    [pid] = worker_pids(llm)
    try:
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError) as died:
            within(60, lambda: llm.generate(MIXED_BATCH, GREEDY, use_tqdm=False))
        assert "tensor-parallel rank 1" in str(died.value) and "SIGKILL" in str(died.value)
        with pytest.raises(WorkerError, match="create a new LLM"):
            within(60, lambda: llm.generate("a b c", GREEDY, use_tqdm=False))
    finally:
        within(60, llm.close)
    assert is_gone(pid)


def test_an_error_in_a_rank_fails_the_call_with_that_ranks_error(models: dict[str, Path],
                                                                 adapters: list[LoRARequest],
                                                                 tmp_path: Path) -> None:
    """Rank 0 reads an adapter when the request is checked, rank 1 only when the adapter
    first goes into a slot: an adapter folder deleted in between makes rank 1 raise, and
    the call fails with WorkerError carrying rank 1's LoRA error."""
    folder = shutil.copytree(adapters[0].lora_path, tmp_path / "doomed")
    request = LoRARequest("doomed", 1, str(folder))
    with LLM(str(models["qwen2"]), dtype="float32", tensor_parallel_size=2, max_model_len=128, enable_lora=True,
             max_lora_rank=8) as llm:
        llm.llm_engine.add_lora(request)
        assert llm.llm_engine.lora_manager.stats.num_host_loads == 1  # in rank 0's host memory
        shutil.rmtree(folder)
        with pytest.raises(WorkerError) as error:
            within(60, lambda: llm.generate("a b c", GREEDY, lora_request=request, use_tqdm=False))
        assert llm.llm_engine.lora_manager.stats.num_host_loads == 1  # rank 0 did not read it again
    message = str(error.value)
    assert "tensor-parallel rank 1 failed" in message
    assert "LoRAError" in message and "'doomed'" in message and "the folder does not exist" in message


# -- plans that cannot run -------------------------------------------------------------


def llama_config(**fields: int) -> transformers.LlamaConfig:
    """A Llama config of the tiny models' shape (4 query heads, 2 key/value heads,
    intermediate size 128), with `fields` changed."""
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    return transformers.LlamaConfig(**{**shape, **fields})


@pytest.mark.parametrize(("fields", "tp", "problem", "sizes"), [
    ({}, 3, "num_attention_heads=4 is not divisible by it", "[1, 2, 4]"),
    ({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 192}, 2,
     "num_key_value_heads=3 neither divides it nor is divisible by it", "[1, 3, 6]"),
    ({"intermediate_size": 130}, 4, "intermediate_size=130 is not divisible by it", "[1, 2]"),
])
def test_a_model_that_does_not_split_is_refused(fields: dict[str, int], tp: int, problem: str, sizes: str) -> None:
    """check_tensor_parallel names each dimension that does not split and the sizes that do."""
    with pytest.raises(ValueError) as error:
        check_tensor_parallel(llama_config(**fields), tp)
    assert f"tensor_parallel_size={tp} does not split this model" in str(error.value)
    assert problem in str(error.value) and f"Sizes that do: {sizes}" in str(error.value)


def test_models_that_split_pass() -> None:
    """Key/value heads may be fewer than the ranks when they divide them (each is copied)."""
    check_tensor_parallel(llama_config(), 2)
    check_tensor_parallel(llama_config(), 4)
    check_tensor_parallel(llama_config(num_key_value_heads=1), 4)


def fake_cpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This process may use cores 0..count-1, as far as the planner can tell."""
    monkeypatch.setattr(plan_module, "available_cpus", lambda: count)
    monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)


def test_more_processes_than_cores_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU each process needs a core of its own: 2 x 2 processes on 3 cores fail
    with the numbers and the fix; on 4 they fit, each rank but the first pinned to its own."""
    fake_cpus(monkeypatch, 3)
    with pytest.raises(ValueError) as error:
        plan_parallelism(2, 2, torch.device("cpu"))
    message = str(error.value)
    assert "tensor_parallel_size=2 x data_parallel_size=2 = 4 processes" in message
    assert "may use 3 CPU core(s)" in message and "their product is at most 3" in message
    fake_cpus(monkeypatch, 4)
    plan = plan_parallelism(2, 2, torch.device("cpu"))
    cores = [[p.cores for p in replica.placements] for replica in plan.replicas]
    assert cores == [[None, (1,)], [(2,), (3,)]]


def test_more_processes_than_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs each process needs a device of its own: 2 x 2 processes over 3 visible
    GPUs fail with the numbers, CUDA_VISIBLE_DEVICES and the fix."""
    monkeypatch.delenv(plan_module.RANKS_ON_ONE_DEVICE_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ValueError) as error:
        plan_parallelism(2, 2, torch.device("cuda", 0))
    message = str(error.value)
    assert "tensor_parallel_size=2 x data_parallel_size=2 = 4 GPUs from cuda:0" in message
    assert "3 GPU(s) are visible (CUDA_VISIBLE_DEVICES=0,1,2)" in message
    assert "their product is at most 3" in message
    plan = plan_parallelism(2, 1, torch.device("cuda", 1))
    assert [p.device for p in plan.replicas[0].placements] == [torch.device("cuda", 1), torch.device("cuda", 2)]


def test_each_kind_of_machine_gets_its_placement_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan picks by hardware (detection mocked): GPUs one per process over NCCL,
    replica by replica; every rank on the first GPU over gloo when asked to
    (RANKS_ON_ONE_DEVICE_ENV); on a CPU gloo, with rank 0 of replica 0 unpinned and the
    others each pinned to their own equal share of the cores."""
    monkeypatch.delenv(plan_module.RANKS_ON_ONE_DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpus = plan_parallelism(2, 2, torch.device("cuda", 0))
    assert [r.backend for r in gpus.replicas] == ["nccl", "nccl"]
    assert [[p.device.index for p in r.placements] for r in gpus.replicas] == [[0, 1], [2, 3]]
    monkeypatch.setenv(plan_module.RANKS_ON_ONE_DEVICE_ENV, "1")
    one = plan_parallelism(2, 2, torch.device("cuda", 0))
    assert [r.backend for r in one.replicas] == ["gloo", "gloo"]
    assert {p.device for r in one.replicas for p in r.placements} == {torch.device("cuda", 0)}
    monkeypatch.setattr(plan_module, "available_cpus", lambda: 4)
    monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cpus = plan_parallelism(2, 2, torch.device("cpu"))
    assert [r.backend for r in cpus.replicas] == ["gloo", "gloo"]
    assert [[p.cores for p in r.placements] for r in cpus.replicas] == [[None, (1,)], [(2,), (3,)]]


@pytest.mark.parametrize(("tp", "cores", "problem"), [
    (3, None, "num_attention_heads=4 is not divisible by it"),
    (2, 1, "may use 1 CPU core(s)"),
])
def test_llm_refuses_an_impossible_plan_before_starting_a_process(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tp: int, cores: int | None, problem: str) -> None:
    """LLM(...) raises ValueError for a model that does not split or a machine too small,
    before any rank's process starts."""
    if cores is not None:
        fake_cpus(monkeypatch, cores)
    before = child_pids()
    with pytest.raises(ValueError, match=re.escape(problem)):
        LLM(str(models["llama"]), dtype="float32", tensor_parallel_size=tp)
    assert child_pids() - before == set()


# -- sliced loading ------------------------------------------------------------------------


def test_rank_1_reads_only_its_slices_of_the_checkpoint(models: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading rank 1 of 2 reads half of every split tensor (q/k/v with their biases, o,
    gate/up, down, the embedding and the LM head) and norms whole: about half the
    checkpoint; and the parameters hold the right slices (q's and the vocabulary's second
    halves of rows, o's and down's second halves of columns)."""
    folder = models["qwen2"]  # untied LM head, q/k/v biases
    [weights_file] = check_model_folder(folder)
    full = load_file(weights_file)
    read_bytes: dict[str, int] = {}
    real_open = model_loader.open_safetensors

    class Recorded:
        """A checkpoint tensor whose reads are counted in `read_bytes`."""

        def __init__(self, name: str, tensor: CheckpointTensor) -> None:
            self.name, self.tensor, self.shape = name, tensor, tensor.shape

        def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
            data = self.tensor.read(piece)
            read_bytes[self.name] = read_bytes.get(self.name, 0) + data.numel() * data.element_size()
            return data

    @contextmanager
    def recorded_open(files: list[Path]) -> Iterator[list[tuple[str, Recorded]]]:
        with real_open(files) as tensors:
            yield [(name, Recorded(name, t)) for name, t in tensors]

    monkeypatch.setattr(model_loader, "open_safetensors", recorded_open)
    monkeypatch.setattr(Linear, "prepack", lambda self: None)  # keep .weight (not oneDNN's packed copy)
    model_config = resolve_model_config(folder, EngineConfig(dtype="float32", device="cpu"), eos_token_id=2)
    model = model_loader.load_model(model_config, TensorParallelGroup(rank=1, size=2))

    whole = {name: t.numel() * t.element_size() for name, t in full.items()}
    assert read_bytes.keys() == whole.keys()
    split = [n for n in whole if {*ATTENTION, *MLP, "embed_tokens", "lm_head"} & set(n.split("."))]
    assert len(split) == 2 * 7 + 2 * 3 + 2  # 2 layers x 7 weights, 2 x q/k/v biases, embedding and head
    assert {n: read_bytes[n] for n in split} == {n: whole[n] // 2 for n in split}
    assert {n: read_bytes[n] for n in whole if n not in split} == {n: whole[n] for n in whole if n not in split}
    assert sum(read_bytes.values()) < 0.6 * sum(whole.values())

    layer, prefix = model.model.layers[1], "model.layers.1"
    q, k, v = (full[f"{prefix}.self_attn.{x}_proj.weight"] for x in "qkv")
    qkv = layer.self_attn.qkv_proj
    torch.testing.assert_close(qkv.weight.data, torch.cat([q[32:], k[16:], v[16:]]), rtol=0, atol=0)
    torch.testing.assert_close(qkv.bias.data, torch.cat([full[f"{prefix}.self_attn.{x}_proj.bias"][n // 2:]
                                                         for x, n in zip("qkv", (64, 32, 32))]), rtol=0, atol=0)
    torch.testing.assert_close(layer.self_attn.o_proj.weight.data, full[f"{prefix}.self_attn.o_proj.weight"][:, 32:],
                               rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.down_proj.weight.data, full[f"{prefix}.mlp.down_proj.weight"][:, 64:],
                               rtol=0, atol=0)
    gate, up = full[f"{prefix}.mlp.gate_proj.weight"], full[f"{prefix}.mlp.up_proj.weight"]
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight.data, torch.cat([gate[64:], up[64:]]), rtol=0, atol=0)
    torch.testing.assert_close(model.model.embed_tokens.weight.data, full["model.embed_tokens.weight"][160:],
                               rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight.data, full["lm_head.weight"][160:], rtol=0, atol=0)
