"""What a step costs, as a fixed overhead plus a cost per row computed, fitted to timed
steps: speculative decoding weighs a proposed token's row against it, and the Dagster
side's progress lines estimate the steps left with it."""

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """A step's time: `overhead_s` plus `per_row_s` for each row it computes (seconds)."""

    overhead_s: float
    per_row_s: float


class StepTimes:
    """Timed steps by rows computed (the last `window` of them; None: all), fitted as
    `overhead + per_row * rows` once there are `min_steps` whose row counts span a factor of
    `min_spread` (the two parts cannot be told apart before)."""

    def __init__(self, min_steps: int = 3, min_spread: float = 2.0, window: int | None = None) -> None:
        self.min_steps, self.min_spread = min_steps, min_spread
        self.steps: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, rows: float, seconds: float) -> None:
        self.steps.append((rows, seconds))

    def fit(self) -> StepCost | None:
        """The cost by least squares, the overhead kept within [0, fastest step] and the
        rest of the time shared by the rows; None until the steps allow a fit."""
        rows = [r for r, _ in self.steps]
        times = [t for _, t in self.steps]
        if len(rows) < self.min_steps or max(rows) < self.min_spread * min(rows):
            return None
        mean_r, mean_t = sum(rows) / len(rows), sum(times) / len(times)
        slope = sum((r - mean_r) * (t - mean_t) for r, t in self.steps) / sum((r - mean_r) ** 2 for r in rows)
        overhead = min(max(mean_t - slope * mean_r, 0.0), min(times))
        return StepCost(overhead, sum(t - overhead for t in times) / sum(rows))
