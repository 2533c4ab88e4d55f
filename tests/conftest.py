"""Shared fixtures for the engine and Dagster tests."""

import gc
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

# Property-based tests run their own bounded example counts in the suite; HYPOTHESIS_PROFILE=thorough
# runs 10,000 examples of each (tests/fuzzing.py's `examples` reads it), to search before a release.
hypothesis_settings.register_profile("thorough", max_examples=10_000)
if os.environ.get("HYPOTHESIS_PROFILE"):
    hypothesis_settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])

# Under pytest-xdist (`make test` runs two workers) the workers' OpenMP threads share the cores:
# a waiting thread sleeps instead of spinning on a core another worker needs. Read once, when
# PyTorch loads its OpenMP runtime, so set before torch is imported (here and in the processes
# the tests start).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Each worker, with the processes its tests start, takes its share of the cores: with two
    # threads each on two cores, the threads of one process wait on those of another (a tiny
    # model's step measured 18x slower so; on a Sapphire Rapids the tests that start engines in
    # child processes took 6-30x their time on a Zen 4). The kernels' tests ask for two threads.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

import torch  # noqa: E402

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It is chosen
# when a kernel (triton.language's own included) is defined, so it must be set before
# anything imports Triton: the engine, or transformers' processing modules through torch._dynamo.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM  # noqa: E402
from engine.hardware import (  # noqa: E402
    BATCH_INVARIANT_ONEDNN_ISA, ONEDNN_ISA_ENV, chosen_cpu_kind, detect_cpu, machine_cpu,
)
from engine.layers.linear import rows_kept_apart  # noqa: E402
from tests.tiny_models import FAMILIES, build_tiny_model  # noqa: E402
from tests.triton_launches import LAUNCHES_DIR_ENV, record_launches, save_launches  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Run as another kind of CPU (tests/cpu_kinds.py): PyTorch's kernels capped at its
# instruction set too, before any of them runs in this process or the ones it starts.
if _kind := chosen_cpu_kind():
    for _name, _value in _kind.torch_env.items():
        os.environ.setdefault(_name, _value)
# On a CPU with AMX the suite keeps oneDNN off AMX, as batch_invariant=True does: its tests
# compare a row's bits across batches, which AMX's kernels do not keep. The AMX kernels run
# in the `amx` run of tests/cpu_kinds.py, whose batch-invariance tests check each mode.
elif machine_cpu().amx:
    os.environ.setdefault(ONEDNN_ISA_ENV, BATCH_INVARIANT_ONEDNN_ISA)
# oneDNN reads its cap once, at its first product: one runs now, so that the cap holds for the
# whole process whatever a test sets later (`onednn_uncapped` unsets it for the engine's choices;
# a `make test-cpu-kinds` worker whose first product came under it ran uncapped from then on, its
# `avx2` run's bfloat16 rows a Zen 4's, which depend on the batch).
rows_kept_apart(torch.float32)
# The launches the interpreter runs, compiled for a GPU by the session's last test.
TRITON_LAUNCHES = record_launches() if os.environ.get("TRITON_INTERPRET") == "1" else set()
# Each test's time against the suite's budget, in the session's summary.
pytest_plugins = ["tests.budget"]


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the test modules imported lives as long as the session: frozen out of the garbage
    collector, it is not walked again by every full collection, one per `LLM.close()` (the
    suite closes hundreds of engines; a module's teardown took 11 s, 4 s frozen)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Thawed at the end, so that the interpreter's shutdown frees it as it would (Triton's
    bindings report objects still alive at exit as leaks)."""
    gc.unfreeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Triton compile check runs last, once the session has launched every kernel."""
    items.sort(key=lambda item: item.path.name == "test_triton_compile.py")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if path := os.environ.get("TRITON_LAUNCHES_OUT"):  # a session test_triton_compile.py started
        Path(path).write_text(json.dumps(sorted(TRITON_LAUNCHES)))
    if os.environ.get(LAUNCHES_DIR_ENV):  # `make test`: each worker's, for the compile check after them
        save_launches(TRITON_LAUNCHES)


def pytest_report_header() -> str:
    return f"CPU: {detect_cpu().describe()}; PyTorch kernels: {torch.backends.cpu.get_cpu_capability()}"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model folder per supported family."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: build_tiny_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def make_llm(tiny_models) -> Iterator[Callable[..., LLM]]:
    """Builds `LLM(<tiny model folder of family>, **settings)`: `make_llm(dtype="float32",
    max_model_len=128)` or `make_llm("qwen2", ...)`. Every LLM it built is closed when the
    test module ends, so a module-scoped `llm` fixture is `return make_llm(...)`."""
    built: list[LLM] = []

    def make(family: str = "llama", **settings) -> LLM:
        built.append(LLM(str(tiny_models[family]), **settings))
        return built[-1]

    yield make
    for llm in built:
        llm.close()
