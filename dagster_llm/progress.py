"""Progress of a generation in the Dagster event log, where tqdm is invisible."""

import time
from collections.abc import Callable
from typing import Any


class EventLogProgress:
    """A tqdm stand-in for `LLM.generate(use_tqdm=...)` that writes a log line every
    `interval` seconds: rows done, generated tokens per second and the time left.

    `generated_tokens` reads the engine's running count of generated tokens.
    """

    def __init__(self, log: Any, generated_tokens: Callable[[], int], interval: float = 5.0) -> None:
        self.log = log
        self.generated_tokens = generated_tokens
        self.interval = interval
        self.total = 0
        self.done = 0
        self.postfix = ""

    def __call__(self, total: int, **_: Any) -> "EventLogProgress":
        self.total, self.done = total, 0
        self.started = self.last = time.monotonic()
        self.tokens_at_start = self.generated_tokens()
        return self

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.log.info(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        tokens = self.generated_tokens() - self.tokens_at_start
        eta = (self.total - self.done) * elapsed / self.done if self.done else None
        eta_text = f"{eta:.0f} s" if eta is not None else "unknown"
        return (f"generation progress: {self.done}/{self.total} rows, {tokens / elapsed:.1f} generated tokens/s, "
                f"{elapsed:.0f} s elapsed, ETA {eta_text}")

    def close(self) -> None:
        self.log.info(self.line(time.monotonic()))
