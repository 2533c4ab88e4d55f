"""GPU leases among the processes of one machine: an engine takes the GPUs it needs for
its life, so that runs launched together (an `llm` pool of N slots on a machine with N
GPUs) each get their own GPU instead of all taking the first.

A lease is an exclusive `flock` on one file per GPU in a directory every process of the
machine shares (`DAGSTER_LLM_DEVICE_LOCK_DIR`, default a folder of the user's in the
temporary directory). The kernel drops the lock when the holder's process ends, SIGKILL
included, so a crashed run never leaves a GPU taken. A GPU is named in the file by its
`CUDA_VISIBLE_DEVICES` entry where that is set (a physical index or a UUID), so processes
with different visible sets still agree on which GPU is which.
"""

import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dagster_llm.core.flock import holder_of, try_flock

DEVICE_LOCK_DIR_ENV = "DAGSTER_LLM_DEVICE_LOCK_DIR"
# How often a process waiting for GPUs looks again.
_POLL_S = 0.5


def device_lock_dir() -> Path:
    """The machine's folder of GPU lock files."""
    configured = os.environ.get(DEVICE_LOCK_DIR_ENV)
    folder = Path(configured) if configured else Path(tempfile.gettempdir()) / f"dagster-llm-gpus-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def physical_names(count: int) -> list[str]:
    """How each of this process's `count` visible GPUs is named across the machine: its
    CUDA_VISIBLE_DEVICES entry, or its index when that is not set."""
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return visible[:count] if len(visible) >= count else [str(i) for i in range(count)]


@dataclass
class GPULease:
    """GPUs `first` .. `first + count - 1` (this process's indices), held until `release`."""

    first: int
    count: int
    _handles: list[IO[str]] = field(default_factory=list, repr=False)

    @property
    def device(self) -> str:
        """The engine's `device` setting: its first GPU (the others follow it)."""
        return f"cuda:{self.first}"

    def release(self) -> None:
        """Gives the GPUs back."""
        for handle in self._handles:
            handle.close()  # closing the file drops its lock
        self._handles = []


def lease_gpus(count: int, timeout_s: float, holder: str = "") -> GPULease:
    """Takes `count` consecutive free GPUs of those this process sees, waiting up to
    `timeout_s` seconds for them; `holder` (a run id) is written beside the lock so that
    a process kept waiting can say who holds them.

    Raises:
        ValueError: fewer GPUs are visible than `count`.
        TimeoutError: no `count` consecutive GPUs came free in time; names their holders.
    """
    import torch  # here, not at import: the definitions of a code location load without torch

    names = physical_names(torch.cuda.device_count())
    if count > len(names):
        raise ValueError(f"the engine needs {count} GPU(s) but {len(names)} are visible; lower tensor_parallel_size "
                         f"x data_parallel_size or make more GPUs visible")
    folder = device_lock_dir()
    deadline = time.monotonic() + timeout_s
    while True:
        for first in range(len(names) - count + 1):
            handles = _try_lock([folder / f"gpu-{name}.lock" for name in names[first:first + count]], holder)
            if handles is not None:
                return GPULease(first, count, handles)
        if time.monotonic() >= deadline:
            holders = "; ".join(f"GPU {name}: {holder_of(folder / f'gpu-{name}.lock') or 'unknown'}" for name in names)
            raise TimeoutError(
                f"no {count} free GPU(s) after {timeout_s:g} s: every one is leased by another engine ({holders}). "
                f"Give the llm pool at most as many slots as the machine has GPUs, or raise gpu_lease_timeout_s")
        time.sleep(_POLL_S)


def _try_lock(paths: list[Path], holder: str) -> list[IO[str]] | None:
    """Exclusive locks on every path, or none of them."""
    line = f"pid {os.getpid()} on {socket.gethostname()}{f', run {holder}' if holder else ''}\n"
    handles: list[IO[str]] = []
    for path in paths:
        handle = try_flock(path, line)
        if handle is None:
            for held in handles:
                held.close()
            return None
        handles.append(handle)
    return handles
