"""The suite's time budget, a pytest plugin (loaded by tests/conftest.py).

A test that takes over the budget (30 s on 2 cores; `--budget-s`) is made cheaper or says why
it needs that long: `@pytest.mark.long("two CLI runs of the crash pipeline, one SIGKILLed")`.
A `long` marker without a reason is refused at collection, and a `long` test is `slow` too (so
that `make test-quick` leaves it out). At the end of a session the summary lists every test
over the budget with its reason, and those without one as a warning. Nothing fails on a time:
a slower machine would turn such a check red, so the list is for the reader of `make test`'s
output, CI's included.
"""

from collections import defaultdict

import pytest

TEST_BUDGET_S = 30.0
_LONG = "long"


def long_reason(item: pytest.Item) -> str | None:
    """Why `item` may take over the budget, where a `long` marker says; raises where one
    says nothing."""
    marker = item.get_closest_marker(_LONG)
    if marker is None:
        return None
    why = marker.args[0] if marker.args else marker.kwargs.get("why")
    if not isinstance(why, str) or not why.strip():
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.long needs the reason the test takes over the budget, e.g. "
            '@pytest.mark.long("two CLI runs of the crash pipeline")')
    return why


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--budget-s", type=float, default=TEST_BUDGET_S,
                     help=f"a test's time budget in seconds (default {TEST_BUDGET_S:.0f}): the session's summary "
                          "lists the tests over it, and those over it without a `long` marker as a warning")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by markers: a `long` test is `slow`
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Carries each `long` test's reason in its reports (to the controller, under xdist)."""
    for item in items:
        if (why := long_reason(item)) is not None:
            item.user_properties.append((_LONG, why))
            item.add_marker(pytest.mark.slow)


class BudgetReport:
    """Sums each test's setup, call and teardown, and lists those over the budget."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.seconds: dict[str, float] = defaultdict(float)
        self.why: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        self.why.update({report.nodeid: value for name, value in report.user_properties if name == _LONG})

    def over_budget(self) -> list[tuple[float, str]]:
        """(seconds, node id) of the tests over the budget, the longest first."""
        return sorted(((s, nodeid) for nodeid, s in self.seconds.items() if s > self.budget_s), reverse=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        over = self.over_budget()
        if not over:
            return
        terminalreporter.write_sep("=", f"tests over {self.budget_s:g} s (setup, call and teardown)")
        for seconds, nodeid in over:
            why = self.why.get(nodeid)
            if why is None:
                terminalreporter.write_line(
                    f"{seconds:6.1f} s {nodeid}: no reason given; make it cheaper or mark it "
                    '@pytest.mark.long("why")', yellow=True)
            else:
                terminalreporter.write_line(f"{seconds:6.1f} s {nodeid}: {why}")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller: pytest-xdist's workers send it their reports
        config.pluginmanager.register(BudgetReport(config.getoption("budget_s")), "test-budget")
