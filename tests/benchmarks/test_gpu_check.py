"""benchmarks/gpu_check.py, the one-shot GPU check: its dry run sets every stage up at tiny
size on the CPU and runs it, so that a broken stage shows up here and not on a lent GPU."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import (
    DRY_SIZES, NEAR_TIE_NATS, NOT_RUN_TIME, STAGES, Check, Divergence, compare_greedy, outcome_counts, run_stages,
)
from engine import CompletionOutput, RequestOutput
from engine.outputs import Logprob
from tests.triton_launches import LAUNCHES_DIR_ENV

ROOT = Path(__file__).resolve().parents[2]


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of the table's rows (stage, workload, figure, target, result)."""
    return [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in markdown.splitlines() if re.match(r"\| [a-z] \|", line)]


def test_dry_run_runs_every_stage_without_dagster(tmp_path):
    """Every stage runs and has its rows in the table (printed and written), none crashed,
    nothing judged; Dagster, absent from the GPU machine, is never imported."""
    blocker = tmp_path / "blocker" / "dagster"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('the GPU check must not import Dagster')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker.parent), str(ROOT)])}
    # Out of the suite's bookkeeping: the run's own output only, and no Triton launches to record.
    for name in ("OUT", LAUNCHES_DIR_ENV, "TRITON_LAUNCHES_OUT"):
        env.pop(name, None)
    output = tmp_path / "gpu-check.md"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--output", str(output)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = table_rows(output.read_text())
    assert {row[0] for row in rows} == set(STAGES)
    assert {row[-1] for row in rows} == {"dry run"}, rows
    assert table_rows(done.stdout) == rows
    assert "tests collected" in (tmp_path / "gpu-check-tests.log").read_text()
    print(f"dry run: {time.monotonic() - started:.1f} s")


def test_a_stage_out_of_time_is_reported_not_run(tmp_path):
    """With no time left, the stage's engine is stopped at its first step (warm-up) and the
    stage is one 'not run (time)' row; the engine is closed."""
    check = Check(DRY_SIZES, torch.device("cpu"), tmp_path, tmp_path / "tests.log", fp8_kv_cache=False)
    rows = run_stages(check, "b", budget_s=0.0, started=time.monotonic(), write=lambda rows, seconds: None)
    assert [(row.stage, row.result) for row in rows] == [("b", NOT_RUN_TIME)]
    assert check._open is None


def test_outcomes_are_counted_from_a_verbose_run_cut_short():
    output = """tests/engine/test_gpu.py::test_embedded_model_bfloat16_matches_float32_greedy XFAIL (measured) [ 16%]
tests/engine/test_gpu.py::test_two_ranks_over_gloo_on_one_gpu_match_one_rank PASSED [ 33%]
tests/engine/test_gpu.py::test_quantized_checkpoints_use_the_gpu_products[fp8-channel] FAILED [ 50%]
FAILED tests/engine/test_gpu.py::test_quantized_checkpoints_use_the_gpu_products[fp8-channel] - AssertionError
"""
    counts = outcome_counts(output)
    assert {k: v for k, v in counts.items() if v} == {"xfailed": 1, "passed": 1, "failed": 1}


def greedy_row(token_ids: list[int], top: list[dict[int, float]] | None = None) -> RequestOutput:
    """A greedy row's output: its tokens and, per token, its top logprobs by token id."""
    logprobs = None if top is None else [{t: Logprob(lp, rank) for rank, (t, lp) in enumerate(step.items(), 1)}
                                         for step in top]
    return RequestOutput("0", None, [1], [CompletionOutput(0, "", token_ids, logprobs=logprobs)], finished=True)


# The reference's token 5 leads token 6 by 0.02 nats at the second position (a near tie), 1.5 at the third.
REFERENCE = [greedy_row([4, 5, 7], [{4: -0.1, 9: -3.0}, {5: -0.70, 6: -0.72}, {7: -0.2, 8: -1.7}]),
             greedy_row([3, 3, 3], [{3: -0.1, 9: -3.0}] * 3)]


def test_greedy_runs_agree_where_they_must_and_may_part_at_a_near_tie():
    """(g)'s rule: identical rows agree; in bfloat16 a row may part where the reference's two
    tokens were within NEAR_TIE_NATS, not at a clear lead nor at a token it did not rank; in
    float32 every row must be identical."""
    same = compare_greedy(REFERENCE, REFERENCE, torch.bfloat16)
    assert same.ok and same.describe() == "2 of 2 rows identical"
    near = compare_greedy(REFERENCE, [greedy_row([4, 6, 1]), REFERENCE[1]], torch.bfloat16)
    assert near.ok and near.divergences == [Divergence(0, 1, pytest.approx(0.02))]
    assert near.describe() == ("1 of 2 rows differ, each at a near tie (gap at most 0.1 nats): row 0 at token 1 "
                               "(gap 0.020)")
    clear = compare_greedy(REFERENCE, [greedy_row([4, 5, 8]), greedy_row([3, 2, 3])], torch.bfloat16)
    assert not clear.ok and [(d.row, d.position) for d in clear.clear] == [(0, 2), (1, 1)]
    assert clear.divergences[0].gap == pytest.approx(1.5) and clear.divergences[1].gap is None  # 2 was not ranked
    assert clear.describe().startswith("2 of 2 rows differ, 2 clearly (gap over 0.1 nats): row 0 at token 2 (gap "
                                       "1.500), row 1 at token 1 (gap -)")
    assert not compare_greedy(REFERENCE, [greedy_row([4, 6, 1]), REFERENCE[1]], torch.float32).ok
    assert NEAR_TIE_NATS[torch.float32] == 0
    cut = compare_greedy(REFERENCE, [greedy_row([4, 5]), REFERENCE[1]], torch.bfloat16)  # a row cut short
    assert not cut.ok and cut.divergences == [Divergence(0, 2, None)]
