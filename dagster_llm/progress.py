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
    step_seconds: float = 0.0  # the recent mean time of one engine step
    finished_output_tokens: int = 0
    finished_max_tokens: int = 0
    finished_rows_at_max: int = 0
    # (tokens generated, max_tokens) of each completion still open, when the engine tells.
    open_outputs: list[tuple[int, int]] | None = None

    def share_reaching_max(self) -> float:
        """Share of rows that run to max_tokens rather than stopping at EOS or a stop
        string, from the finished rows (with a prior of half a row each way)."""
        return (self.finished_rows_at_max + 0.5) / (self.rows_done + 1)

    def _open_rows(self) -> list[tuple[int, int]]:
        if self.open_outputs is not None:
            return self.open_outputs
        # Without the engine's view: all open rows as one.
        return [(max(self.output_tokens_done - self.finished_output_tokens, 0),
                 self.max_output_tokens_total - self.finished_max_tokens)]

    def expected_remaining(self, generated: int, max_tokens: int) -> float:
        """Tokens an open row is expected to add: the rest of its max_tokens if it runs to
        the end, half of it if it stops early (a stop is as likely anywhere before
        max_tokens), weighted by `share_reaching_max`."""
        return (1 + self.share_reaching_max()) / 2 * max(max_tokens - generated, 0)

    def expected_output_tokens(self) -> float:
        """Output tokens the run will generate in all."""
        return self.output_tokens_done + sum(self.expected_remaining(g, m) for g, m in self._open_rows())

    def eta_seconds(self, elapsed_s: float) -> float | None:
        """Seconds left: the token work left at the rate of the work done so far, but no
        less than the steps the longest open row still needs at the recent step time once
        every open row runs (near the end few rows run, and tokens come slower than the
        mean rate). None before any work."""
        prompt_done = min(self.prompt_tokens_done, self.prompt_tokens_total)
        done = prompt_done * PROMPT_TOKEN_WEIGHT + self.output_tokens_done
        if done <= 0:
            return None
        total = self.prompt_tokens_total * PROMPT_TOKEN_WEIGHT + self.expected_output_tokens()
        by_tokens = elapsed_s * max(total - done, 0.0) / done
        open_rows = self._open_rows()
        if not self.rows_done or any(done == 0 for done, _ in open_rows):
            # Rows still waiting to start keep the batch full; early steps run cold.
            return by_tokens
        longest = max((self.expected_remaining(g, m) for g, m in open_rows), default=0.0)
        return max(by_tokens, self.step_seconds * longest)


class GenerationProgress:
    """Logs `line()` every `interval_s` from a timer thread while a run generates.

    `sample()` reads the engine's counters (prompt tokens computed or cached, output
    tokens generated, steps, all since the run started) and `open_outputs()` its open completions;
    the run reports finished rows with `row_finished`.
    `check()` is called after every engine step (through `bar`, the factory that
    `LLM.generate(use_tqdm=...)` takes) and may raise to stop the run.
    """

    def __init__(self, log: Callable[[str], None], interval_s: float, counters: WorkCounters,
                 sample: Callable[[], tuple[int, int, int]], check: Callable[[], None] = lambda: None,
                 open_outputs: Callable[[], list[tuple[int, int]] | None] = lambda: None) -> None:
        self.log = log
        self.open_outputs = open_outputs
        self.interval_s = interval_s
        self.counters = counters
        self.sample = sample
        self.check = check
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._last_steps = (self.started, 0, 0)
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GenerationProgress":
        self.started = time.monotonic()
        self._last_steps = (self.started, 0, 0)
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
        counters.finished_rows_at_max += output_tokens >= max_tokens

    def line(self) -> str:
        counters = self.counters
        counters.prompt_tokens_done, counters.output_tokens_done, steps = self.sample()
        now = time.monotonic()
        since, steps_then, prompt_then = self._last_steps
        if steps > steps_then:
            # Step time of decode-only stretches: a prefill step is many times longer.
            decoding = counters.prompt_tokens_done == prompt_then
            counters.step_seconds = (now - since) / (steps - steps_then) if decoding else 0.0
            self._last_steps = (now, steps, counters.prompt_tokens_done)
        counters.open_outputs = self.open_outputs()
        elapsed = max(now - self.started, 1e-9)
        eta = counters.eta_seconds(elapsed)
        return (f"generation progress: {counters.rows_done}/{counters.rows_total} rows, "
                f"{min(counters.prompt_tokens_done, counters.prompt_tokens_total)}/{counters.prompt_tokens_total} "
                "prompt tokens, "
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
