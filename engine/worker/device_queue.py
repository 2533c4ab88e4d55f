"""Device work whose results the host reads later: the seam between asynchronous
scheduling and the hardware.

On a GPU a step's kernels are queued by launching them, and an event recorded behind the
non-blocking copies of its results marks the point the host waits for, so the host goes
on (reading back the previous step, checking stops, scheduling the next one) while the
GPU computes. A CPU computes as the work is launched: the results are there at once. (A
worker thread standing in for a stream was measured on a 2-core CPU: the forward pass and
the host's Python work then compete for the cores and the interpreter lock, and steps got
no faster.)
"""

from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


class Pending(Generic[T]):
    """The result of launched device work; `result()` waits until it has landed."""

    def __init__(self, value: T, event: torch.cuda.Event | None = None) -> None:
        self._value, self._event = value, event

    def result(self) -> T:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._value


def launch(work: Callable[[], T], device: torch.device, read_back: bool = False) -> Pending[T]:
    """Runs `work`, which queues device work and returns its results. With `read_back`
    they include host copies made with non-blocking copies: on a GPU an event then marks
    when they land."""
    value = work()
    if read_back and device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        return Pending(value, event)
    return Pending(value)
