"""The suite's time budget (tests/budget.py): a session's summary lists the tests over it with
their `long` reasons, warns of those without one, and refuses a `long` marker that gives none."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = '''
import time
import pytest

def test_quick():
    pass

def test_slow_without_a_reason():
    time.sleep(0.6)

@pytest.mark.long("waits on purpose")
def test_slow_with_a_reason():
    time.sleep(0.6)
'''


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.budget", "-p", "no:cacheprovider",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", *args, str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_the_summary_lists_the_tests_over_the_budget_with_their_reasons(tmp_path):
    """On two xdist workers, as `make test` runs: the reasons travel with the workers' reports."""
    (tmp_path / "test_timed.py").write_text(TESTS)
    done = run_pytest(tmp_path, "--budget-s", "0.4", "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("tests over 0.4 s (setup, call and teardown)", 1)[1]
    lines = [line for line in summary.splitlines() if "test_timed.py::" in line]
    assert len(lines) == 2 and not any("test_quick" in line for line in lines), summary
    [unmarked] = [line for line in lines if "without_a_reason" in line]
    assert unmarked.endswith('no reason given; make it cheaper or mark it @pytest.mark.long("why")')
    [marked] = [line for line in lines if "with_a_reason" in line]
    assert marked.endswith("test_timed.py::test_slow_with_a_reason: waits on purpose")
    assert "tests over" not in run_pytest(tmp_path, "--budget-s", "5").stdout  # nothing over: no section


def test_a_long_marker_without_a_reason_is_refused(tmp_path):
    (tmp_path / "test_unexplained.py").write_text("import pytest\n\n@pytest.mark.long\ndef test_x():\n    pass\n")
    done = run_pytest(tmp_path)
    assert done.returncode == 4  # a usage error, before any test runs
    assert "test_unexplained.py::test_x: @pytest.mark.long needs the reason" in done.stdout + done.stderr
