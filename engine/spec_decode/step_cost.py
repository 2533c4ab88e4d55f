"""What a decode step costs, as a fixed part plus a part per row computed, fitted to the
steps the engine timed: speculation weighs a proposed token's row against it."""

from collections import deque

# Steps the fit remembers.
_WINDOW = 64


class StepCost:
    """Times of recent decode steps (those that computed no prompt), by rows computed."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=_WINDOW)

    def add(self, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))

    def estimate(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row): least squares over the remembered steps, the
        fixed part kept in [0, fastest step]; None until there are 8 whose row counts span
        a factor of 1.5 (the two parts cannot be told apart before)."""
        steps = self.steps
        rows = [r for r, _ in steps]
        times = [t for _, t in steps]
        if len(steps) < 8 or max(rows) < 1.5 * min(rows):
            return None
        mean_r, mean_t = sum(rows) / len(rows), sum(times) / len(times)
        slope = sum((r - mean_r) * (t - mean_t) for r, t in steps) / sum((r - mean_r) ** 2 for r in rows)
        fixed = min(max(mean_t - slope * mean_r, 0.0), min(times))
        per_row = max(slope, 1e-9)
        return fixed, per_row
