"""GPU leases on a machine with several GPUs, with the device detection mocked: engines
created together get different GPUs, one that needs two gets two in a row, a fifth
waits for a free one or fails naming the holders, and a holder's process that dies
(SIGKILL) gives its GPU back."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import dagster as dg
import pytest
import torch

import engine
from dagster_llm import LLMResource
from dagster_llm.core.devices import DEVICE_LOCK_DIR_ENV, lease_gpus

REPO = Path(__file__).resolve().parents[2]


class _FakeLLM:
    """Stands in for the engine: records the device it was given."""

    def __init__(self, model: str, **settings: object) -> None:
        self.device = settings["device"]

    def close(self) -> None:
        pass


@pytest.fixture
def four_gpus(monkeypatch, tmp_path):
    """A machine that shows 4 GPUs, with its lock files under tmp_path."""
    monkeypatch.setenv(DEVICE_LOCK_DIR_ENV, str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(engine, "LLM", _FakeLLM)  # LLMResource imports it when it builds the engine
    return tmp_path / "locks"


def _resources(count: int, **fields: object) -> list[LLMResource]:
    return [LLMResource(gpu_lease_timeout_s=0.5, **fields) for _ in range(count)]


def test_four_engines_get_four_gpus_and_a_fifth_fails_naming_the_holders(four_gpus):
    resources = _resources(5)
    devices = [r.get_llm().device for r in resources[:4]]
    assert sorted(devices) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(TimeoutError, match=r"no 1 free GPU\(s\) after 0.5 s") as failed:
        resources[4].get_llm()
    assert f"pid {os.getpid()}" in str(failed.value) and "llm pool" in str(failed.value)
    resources[2].teardown_after_execution(dg.build_init_resource_context())
    assert resources[4].get_llm().device == devices[2]


def test_a_waiting_engine_takes_the_gpu_released_while_it_waits(four_gpus):
    holders = _resources(4)
    for r in holders:
        r.get_llm()
    waiting = LLMResource(gpu_lease_timeout_s=30)
    got: list[str] = []
    thread = threading.Thread(target=lambda: got.append(waiting.get_llm().device))
    thread.start()
    holders[1].teardown_after_execution(dg.build_init_resource_context())
    thread.join(30)
    assert got == ["cuda:1"]


def test_an_engine_of_two_ranks_leases_two_gpus_in_a_row(four_gpus):
    single = LLMResource(gpu_lease_timeout_s=0.5)
    assert single.get_llm().device == "cuda:0"
    pair = LLMResource(gpu_lease_timeout_s=0.5, tensor_parallel_size=2)
    assert pair.get_llm().device == "cuda:1"  # GPUs 1 and 2
    with pytest.raises(TimeoutError, match="no 2 free GPU"):
        LLMResource(gpu_lease_timeout_s=0.5, data_parallel_size=2).get_llm()
    with pytest.raises(ValueError, match="needs 8 GPU"):
        LLMResource(tensor_parallel_size=8).get_llm()


def test_an_explicit_device_or_a_cpu_takes_no_lease(four_gpus):
    pinned = [LLMResource(device="cuda:3", gpu_lease_timeout_s=0.5) for _ in range(2)]
    assert [r.get_llm().device for r in pinned] == ["cuda:3", "cuda:3"]
    assert not list(four_gpus.glob("*.lock"))


_HOLDER = """
import json, sys, time, torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 4
from dagster_llm.core.devices import lease_gpus
lease = lease_gpus(1, timeout_s=5)
print(json.dumps(lease.first), flush=True)
time.sleep(300)
"""


def test_gpus_held_by_killed_processes_come_free(four_gpus):
    """Four processes lease four GPUs; with every GPU held, a lease here fails; once one
    holder is SIGKILLed, its GPU is free at once (the kernel dropped its lock)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDER], env=env, stdout=subprocess.PIPE, text=True)
               for _ in range(4)]
    try:
        firsts = [json.loads(p.stdout.readline()) for p in holders]
        assert sorted(firsts) == [0, 1, 2, 3]
        with pytest.raises(TimeoutError):
            lease_gpus(1, timeout_s=0.2)
        victim = holders[firsts.index(2)]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert lease_gpus(1, timeout_s=5).first == 2
    finally:
        for p in holders:
            p.kill()
            p.wait()
            p.stdout.close()
