"""Progress of a generation in a log, where tqdm is invisible: a line every interval, even
while one long prefill step runs, with an ETA estimated from tokens rather than rows."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dagster_llm.core.engine_surface import EngineStats, StepCost, StepTimes, UnfinishedOutput

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
    # Decode step time, once measured over batches of different sizes: see `StepTimes`.
    step_cost: "StepCost | None" = None
    finished_output_tokens: int = 0
    finished_max_tokens: int = 0
    finished_rows_at_max: int = 0
    # Each completion still open, when the engine tells.
    open_outputs: list[UnfinishedOutput] | None = None

    def share_reaching_max(self) -> float:
        """Share of rows that run to max_tokens rather than stopping at EOS or a stop
        string, from the finished rows (with a prior of half a row each way)."""
        return (self.finished_rows_at_max + 0.5) / (self.rows_done + 1)

    def _open_rows(self) -> list[UnfinishedOutput]:
        if self.open_outputs is not None:
            return self.open_outputs
        # Without the engine's view: all open rows as one.
        return [UnfinishedOutput(max(self.output_tokens_done - self.finished_output_tokens, 0),
                                 self.max_output_tokens_total - self.finished_max_tokens)]

    def expected_remaining(self, row: UnfinishedOutput) -> float:
        """Tokens an open row is expected to add: the rest of its max_tokens if it runs to
        the end, half of it if it stops early (a stop is as likely anywhere before
        max_tokens), weighted by `share_reaching_max`."""
        return (1 + self.share_reaching_max()) / 2 * max(row.max_tokens - row.num_generated_tokens, 0)

    def expected_output_tokens(self) -> float:
        """Output tokens the run will generate in all."""
        return self.output_tokens_done + sum(self.expected_remaining(row) for row in self._open_rows())

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
        remaining = [self.expected_remaining(row) for row in open_rows]
        if self.step_cost is None or not self.rows_done or any(row.num_generated_tokens == 0 for row in open_rows):
            # Rows still waiting keep the batch full: the rate so far holds.
            left = (self.prompt_tokens_total - prompt_done) * PROMPT_TOKEN_WEIGHT + sum(remaining)
            return elapsed_s * left / done
        cost = self.step_cost
        return cost.overhead_s * max(remaining, default=0.0) + cost.per_row_s * sum(remaining)


def speculation_summary(start: EngineStats, now: EngineStats) -> dict[str, float | int] | None:
    """Speculative decoding between two readings of the engine's counters: verifications,
    proposed and accepted tokens, the acceptance rate and the tokens a verification added
    on average (vLLM's mean acceptance length); None where nothing was proposed."""
    drafts = now.num_drafts - start.num_drafts
    proposed = now.num_draft_tokens - start.num_draft_tokens
    if not proposed:
        return None
    accepted = now.num_accepted_tokens - start.num_accepted_tokens
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 4), "mean_acceptance_length": round(1 + accepted / drafts, 3)}


@dataclass(frozen=True)
class _Mark:
    """Where the counters stood when steps were last timed."""

    time: float
    steps: int
    prompt_tokens: int
    output_tokens: int


class GenerationProgress:
    """Logs `line()` every `interval_s` from a timer thread while a run generates.

    `stats()` reads the engine's counters and `open_outputs()` its open completions; the
    run reports finished rows with `row_finished`.
    `check()` is called after every engine step (through `bar`, the factory that
    `LLM.generate(use_tqdm=...)` takes) and may raise to stop the run.
    """

    def __init__(self, log: Callable[[str], None], interval_s: float, counters: WorkCounters,
                 stats: Callable[[], EngineStats], check: Callable[[], None] = lambda: None,
                 open_outputs: Callable[[], list[UnfinishedOutput] | None] = lambda: None) -> None:
        self.log = log
        self.open_outputs = open_outputs
        self.interval_s = interval_s
        self.counters = counters
        self.stats = stats
        self.check = check
        self._stop = threading.Event()
        self._restart()
        self._step_times = StepTimes()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GenerationProgress":
        self._restart()
        self._thread = threading.Thread(target=self._tick, name="generation-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc_info[0] is None:
            self.log(self.line())

    def _restart(self) -> None:
        """Counts time and the engine's work from now."""
        self.started = time.monotonic()
        self._start = self._latest = self.stats()
        self._last = _Mark(self.started, 0, 0, 0)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.log(self.line())

    def row_finished(self, output_tokens: int, max_tokens: int) -> None:
        counters = self.counters
        counters.rows_done += 1
        counters.finished_output_tokens += output_tokens
        counters.finished_max_tokens += max_tokens
        counters.finished_rows_at_max += output_tokens >= max_tokens

    def _sample(self) -> int:
        """Updates the counters from the engine's (since the run started); returns the steps."""
        stats, start = self.stats(), self._start
        self._latest = stats
        # Prompt tokens computed, or found in the prefix cache.
        self.counters.prompt_tokens_done = (stats.num_prompt_tokens_computed + stats.num_cached_prompt_tokens
                                            - start.num_prompt_tokens_computed - start.num_cached_prompt_tokens)
        self.counters.output_tokens_done = stats.num_generated_tokens - start.num_generated_tokens
        return stats.num_steps - start.num_steps

    def line(self) -> str:
        counters = self.counters
        steps = self._sample()
        now = time.monotonic()
        last = self._last
        if steps > last.steps:
            # Decode-only stretches after the first row finished: a prefill step is many
            # times longer, and the first steps of each batch shape run cold.
            if counters.prompt_tokens_done == last.prompt_tokens and counters.rows_done:
                self._step_times.add((counters.output_tokens_done - last.output_tokens) / (steps - last.steps),
                                     (now - last.time) / (steps - last.steps))
                counters.step_cost = self._step_times.fit()
            self._last = _Mark(now, steps, counters.prompt_tokens_done, counters.output_tokens_done)
        counters.open_outputs = self.open_outputs()
        elapsed = max(now - self.started, 1e-9)
        eta = counters.eta_seconds(elapsed)
        speculation = speculation_summary(self._start, self._latest)
        accepted = f", {speculation['acceptance_rate']:.0%} of proposed tokens accepted" if speculation else ""
        return (f"generation progress: {counters.rows_done}/{counters.rows_total} rows, "
                f"{min(counters.prompt_tokens_done, counters.prompt_tokens_total)}/{counters.prompt_tokens_total} "
                "prompt tokens, "
                f"{counters.output_tokens_done} output tokens ({counters.output_tokens_done / elapsed:.1f}/s{accepted}), "
                f"{elapsed:.0f} s elapsed, ETA {'unknown' if eta is None else f'{eta:.0f} s'}")

    def bar(self, **_: Any) -> "StepHook":
        """A stand-in for tqdm that `LLM.generate` calls after every step."""
        return StepHook(self.check)


class StepHook:
    """A stand-in for tqdm's bar that runs `check` after every engine step (and shows nothing)."""

    def __init__(self, check: Callable[[], None]) -> None:
        self.check = check
        self.postfix = ""

    def update(self, _: int) -> None:
        self.check()

    def close(self) -> None:
        pass
