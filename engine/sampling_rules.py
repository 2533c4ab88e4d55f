"""The allowed values of each sampling setting, as words and as tests: what
`SamplingParams` declares beside each field, and what its errors quote."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A test of a value, given the whole settings object (some rules depend on another field).
Test = Callable[[Any, Any], bool]


@dataclass(frozen=True)
class Rule:
    """A field's allowed values: in words, as a type test and as a value test (run only
    on a value of the right type). NaN fails every comparison, so ranges refuse it too."""

    words: str
    type_ok: Test
    value_ok: Test = lambda v, p: True

    def holds_type(self, value: object, params: object) -> bool:
        return holds(self.type_ok, value, params)

    def holds_value(self, value: object, params: object) -> bool:
        return holds(self.value_ok, value, params)


def holds(test: Test, value: object, params: object) -> bool:
    """The test's verdict; a test that meets a value it cannot compare says no."""
    try:
        return bool(test(value, params))
    except TypeError:
        return False


def number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: object) -> bool:
    return number(value) and math.isfinite(value)


def integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def flag() -> Rule:
    return Rule("true or false", lambda v, p: isinstance(v, bool))


def list_of(test: Callable[[object], bool]) -> Test:
    return lambda v, p: isinstance(v, list) and all(test(x) for x in v)


def optional(test: Test) -> Test:
    return lambda v, p: v is None or test(v, p)


def number_in(low: float, high: float, note: str = "") -> Rule:
    words = f"in [{low:g}, {high:g}]" + (f" ({note})" if note else "")
    return Rule(words, lambda v, p: number(v), lambda v, p: low <= v <= high)


def logprobs() -> Rule:
    return Rule("None, -1 (the whole vocabulary) or a non-negative integer",
                optional(lambda v, p: integer(v)), lambda v, p: v is None or v >= -1)


def min_tokens() -> Rule:
    """At most max_tokens (any number when max_tokens is None)."""
    def within(v: int, p: Any) -> bool:
        limit = p.max_tokens if integer(p.max_tokens) else math.inf if p.max_tokens is None else 0
        return 0 <= v <= limit
    return Rule("an integer in [0, max_tokens]", lambda v, p: integer(v), within)


def token_bias() -> Rule:
    return Rule("None or a mapping of token id to a finite number",
                optional(lambda v, p: isinstance(v, dict) and all(integer(k) and number(x) for k, x in v.items())),
                lambda v, p: v is None or all(math.isfinite(x) for x in v.values()))
