"""Helpers of the tests that start, kill and wait for processes: a call with a time
limit (a hang fails the test instead of blocking the run), the state of processes as
/proc shows it, and a test rerun in a child process whose oneDNN stays off AMX."""

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engine.hardware import BATCH_INVARIANT_ONEDNN_ISA, ONEDNN_ISA_ENV, amx_products, detect_cpu

T = TypeVar("T")


def within(seconds: float, call: Callable[[], T]) -> T:
    """`call()`'s result, or its exception, from a daemon thread: a call still running
    after `seconds` fails the test (a hang) instead of blocking the run."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed over to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="within")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s: it hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def is_gone(pid: int) -> bool:
    """Whether process `pid` has exited: no longer there, or a zombie nobody reaped yet
    whose threads have all ended (its main thread shows "Z" while the others, and its
    open files, may still be going)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return True
    return state in ("Z", "X") and threads <= 1


def wait_until_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after up to `seconds` (none, as soon as all have exited)."""
    deadline = time.monotonic() + seconds
    while (alive := [pid for pid in pids if not is_gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def child_pids() -> set[int]:
    """The live processes whose parent is this one."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
        except OSError:
            continue
        if int(ppid) == os.getpid() and state not in ("Z", "X"):
            children.add(int(stat.parent.name))
    return children


def run_in_batch_mode(request: pytest.FixtureRequest, batch_invariant: bool) -> bool:
    """Readies a test of a batch-invariance mode in this process's oneDNN: returns False
    where its body should run here; where oneDNN here runs AMX kernels (the `amx` run of
    tests/cpu_kinds.py), skips the default mode, which promises nothing there, and runs
    the test of `batch_invariant=True` in a child process started with oneDNN off AMX (as
    a fresh process under that mode has it), failing with its output if it fails there,
    and returns True."""
    if not amx_products(detect_cpu(), batch_invariant=False):
        return False
    if not batch_invariant:
        pytest.skip("AMX's kernels pick their summation order by the batch's size: only batch_invariant=True "
                    "promises a row's bits there")
    env = {**os.environ, ONEDNN_ISA_ENV: BATCH_INVARIANT_ONEDNN_ISA}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                          env=env, capture_output=True, text=True, check=False, timeout=900)
    assert done.returncode == 0 and re.search(r"\b1 passed\b", done.stdout), \
        f"in a child process with oneDNN off AMX:\n{done.stdout[-4000:]}"
    return True
