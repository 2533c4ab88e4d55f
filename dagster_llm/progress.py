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
    # Decode step time as overhead + per-token cost (seconds), once measured over batches of
    # different sizes: see `StepTimes`.
    step_cost: tuple[float, float] | None = None
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
        """Seconds left: the token work left at the rate of the work done so far. Once every
        open row runs and decode steps were timed at batches of different sizes, the steps
        left instead: each costs a fixed overhead plus a share per row still generating, so
        the last steps of a shrinking batch are not taken at the full batch's rate. None
        before any work."""
        prompt_done = min(self.prompt_tokens_done, self.prompt_tokens_total)
        done = prompt_done * PROMPT_TOKEN_WEIGHT + self.output_tokens_done
        if done <= 0:
            return None
        open_rows = self._open_rows()
        remaining = [self.expected_remaining(generated, limit) for generated, limit in open_rows]
        if self.step_cost is None or not self.rows_done or any(generated == 0 for generated, _ in open_rows):
            # Rows still waiting keep the batch full: the rate so far holds.
            left = (self.prompt_tokens_total - prompt_done) * PROMPT_TOKEN_WEIGHT + sum(remaining)
            return elapsed_s * left / done
        overhead, per_token = self.step_cost
        return overhead * max(remaining, default=0.0) + per_token * sum(remaining)


class StepTimes:
    """Decode step times by batch size, fitted as `overhead + per_token * batch`."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (rows per step, seconds per step)

    def add(self, batch: float, step_s: float) -> None:
        self.samples.append((batch, step_s))

    def fit(self) -> tuple[float, float] | None:
        """(overhead, per-token) seconds by least squares, once the batch sizes seen span
        at least a factor of two; the overhead is kept within [0, fastest step]."""
        if len(self.samples) < 3:
            return None
        batches = [b for b, _ in self.samples]
        if max(batches) < 2 * min(batches):
            return None
        n = len(self.samples)
        mean_b = sum(batches) / n
        mean_t = sum(t for _, t in self.samples) / n
        spread = sum((b - mean_b) ** 2 for b in batches)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in self.samples) / spread
        overhead = min(max(mean_t - slope * mean_b, 0.0), min(t for _, t in self.samples))
        per_token = sum(t - overhead for _, t in self.samples) / sum(batches)
        return overhead, per_token


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
        self._last = (self.started, 0, 0, 0)  # time, steps, prompt tokens, output tokens
        self._step_times = StepTimes()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GenerationProgress":
        self.started = time.monotonic()
        self._last = (self.started, 0, 0, 0)
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
        since, steps_then, prompt_then, output_then = self._last
        if steps > steps_then:
            # Decode-only stretches after the first row finished: a prefill step is many
            # times longer, and the first steps of each batch shape run cold.
            if counters.prompt_tokens_done == prompt_then and counters.rows_done:
                self._step_times.add((counters.output_tokens_done - output_then) / (steps - steps_then),
                                     (now - since) / (steps - steps_then))
                counters.step_cost = self._step_times.fit()
            self._last = (now, steps, counters.prompt_tokens_done, counters.output_tokens_done)
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
