"""Example counts of the property-based tests: small in the suite, large on demand.

`make test` runs each fuzz test's own bounded count; `HYPOTHESIS_PROFILE=thorough` (registered in
tests/conftest.py) runs 10,000 examples of each, to search before a release."""

import os

from hypothesis import settings


def examples(quick: int, thorough: int | None = None) -> int:
    """A fuzz test's example count: `quick` in the suite; under HYPOTHESIS_PROFILE the loaded
    profile's count, or `thorough` where a test whose examples each run a model caps it."""
    if not os.environ.get("HYPOTHESIS_PROFILE"):
        return quick
    return min(settings.default.max_examples, thorough or settings.default.max_examples)
