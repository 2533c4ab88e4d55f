"""vLLM's own reasoning- and tool-parser test cases, through our engine's end-of-completion
path (tests/parser_conformance.py says how): each passes, or differs on purpose as listed."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tests.parser_cases
from tests.parser_conformance import DIFFERENCES, Case, check

ROOT = Path(__file__).resolve().parents[2]


def _all_cases() -> list[Case]:
    cases = []
    for module in pkgutil.iter_modules(tests.parser_cases.__path__):
        cases += importlib.import_module(f"tests.parser_cases.{module.name}").CASES
    return cases


CASES = _all_cases()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_vllm_case(case):
    check(case)


def test_case_ids_are_unique_and_there_are_enough():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert len(CASES) >= 150, len(CASES)


def test_the_docs_list_the_same_differences():
    docs = (ROOT / "docs" / "engine.md").read_text()
    section = docs.split("### Differences from vLLM's parsers", 1)[1].split("\n#", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_-]+)` \|", section, re.MULTILINE))
    assert listed == set(DIFFERENCES)
    used = {case.difference for case in CASES} - {None}
    assert used <= set(DIFFERENCES) and not set(DIFFERENCES) - used, set(DIFFERENCES) - used
