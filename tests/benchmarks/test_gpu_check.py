"""benchmarks/gpu_check.py, the one-shot GPU check: its dry run sets every stage up at tiny
size on the CPU and runs it, so that a broken stage shows up here and not on a lent GPU."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_check import DRY_SIZES, NOT_RUN_TIME, STAGES, Check, outcome_counts, run_stages
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
