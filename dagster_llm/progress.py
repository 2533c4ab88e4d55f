"""Progress of a generation in a log, where tqdm is invisible: a line every interval, even
while one long prefill step runs, with an ETA estimated from tokens rather than rows."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Cost of computing one prompt token relative to generating one output token. Prompt
# tokens run many to a step; output tokens one per sequence per step.
PROMPT_TOKEN_WEIGHT = 0.25


@dataclass
class WorkCounters:
    """What a run has done and has to do, in rows and tokens."""

    rows_total: int = 0
    prompt_tokens_total: int = 0
    max_output_tokens_total: int = 0
    rows_done: int = 0
    prompt_tokens_done: int = 0
    output_tokens_done: int = 0
    finished_output_tokens: int = 0
    finished_max_tokens: int = 0

    def expected_output_tokens(self) -> float:
        """Output tokens the run will generate in all: what finished rows generated, plus
        the open rows' max_tokens scaled by the share of max_tokens finished rows used.
        Open rows already past that are expected halfway from where they are to their max."""
        share = self.finished_output_tokens / self.finished_max_tokens if self.finished_max_tokens else 1.0
        open_max = self.max_output_tokens_total - self.finished_max_tokens
        open_generated = max(self.output_tokens_done - self.finished_output_tokens, 0)
        typical = share * open_max
        open_expected = typical if open_generated <= typical else (open_generated + open_max) / 2
        return self.finished_output_tokens + open_expected

    def eta_seconds(self, elapsed_s: float) -> float | None:
        """Seconds left at the rate of the work done so far (None before any)."""
        done = self.prompt_tokens_done * PROMPT_TOKEN_WEIGHT + self.output_tokens_done
        total = self.prompt_tokens_total * PROMPT_TOKEN_WEIGHT + self.expected_output_tokens()
        if done <= 0:
            return None
        return elapsed_s * max(total - done, 0.0) / done


class GenerationProgress:
    """Logs `line()` every `interval_s` from a timer thread while a run generates.

    `sample()` reads the engine's counters (prompt tokens computed, output tokens
    generated since the run started); the run reports finished rows with `row_finished`.
    `check()` is called after every engine step (through `bar`, the factory that
    `LLM.generate(use_tqdm=...)` takes) and may raise to stop the run.
    """

    def __init__(self, log: Callable[[str], None], interval_s: float, counters: WorkCounters,
                 sample: Callable[[], tuple[int, int]], check: Callable[[], None] = lambda: None) -> None:
        self.log = log
        self.interval_s = interval_s
        self.counters = counters
        self.sample = sample
        self.check = check
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GenerationProgress":
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._tick, name="generation-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc_info[0] is None:
            self.log(self.line())

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.log(self.line())

    def row_finished(self, output_tokens: int, max_tokens: int) -> None:
        counters = self.counters
        counters.rows_done += 1
        counters.finished_output_tokens += output_tokens
        counters.finished_max_tokens += max_tokens

    def line(self) -> str:
        counters = self.counters
        counters.prompt_tokens_done, counters.output_tokens_done = self.sample()
        elapsed = max(time.monotonic() - self.started, 1e-9)
        eta = counters.eta_seconds(elapsed)
        return (f"generation progress: {counters.rows_done}/{counters.rows_total} rows, "
                f"{counters.prompt_tokens_done}/{counters.prompt_tokens_total} prompt tokens, "
                f"{counters.output_tokens_done} output tokens ({counters.output_tokens_done / elapsed:.1f}/s), "
                f"{elapsed:.0f} s elapsed, ETA {'unknown' if eta is None else f'{eta:.0f} s'}")

    def bar(self, **_: Any) -> "_StepHook":
        """A stand-in for tqdm that `LLM.generate` calls after every step."""
        return _StepHook(self.check)


class _StepHook:
    def __init__(self, check: Callable[[], None]) -> None:
        self.check = check
        self.postfix = ""

    def update(self, _: int) -> None:
        self.check()

    def close(self) -> None:
        pass
