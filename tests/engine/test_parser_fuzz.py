"""A model's output is the parsers' hostile input: text built from each family's markers,
JSON and XML fragments and arbitrary characters, run through the engine's end-of-completion
path (tests/parser_conformance.py's `run`) on every reasoning and tool parser we ship. None
raises, and each result keeps the contract the tables rely on."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tool_parsers import TOOL_CALL_PARSERS
from tests.fuzzing import examples
from tests.parser_conformance import FAMILIES, run

# (tokenizer family, reasoning parser, tool parser): each parser we ship, on its family's tokenizer.
SETUPS = [
    ("qwen3", "qwen3", "hermes"), ("qwen3", "qwen3", "qwen3_coder"), ("deepseek_v3", "deepseek_r1", "deepseek_v3"),
    ("deepseek_v3", "deepseek_v31", "deepseek_v31"), ("mistral", "mistral", "mistral"),
    ("harmony", "openai_gptoss", "openai"), ("kimi_k2", "kimi_k2", "kimi_k2"), ("llama3", None, "llama3_json"),
    ("llama4", None, "pythonic"), ("plain", None, "pythonic"),
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hourly": {"type": "boolean"}, "tags": {"type": "array"}}}}}]
FRAGMENTS = ['{', '}', '[', ']', ',', ':', '"', '"name"', '"arguments"', '"parameters"', '"get_weather"', '"city"',
             '1', '1e999', 'true', 'null', '\n', ' ', '(', ')', '=', "'", 'get_weather', 'functions.get_weather:0',
             '<function=get_weather>', '<parameter=city>', '<parameter=days>', '</parameter>', '</function>',
             '<|channel|>final', '<|channel|>commentary to=functions.get_weather', '<|channel|>analysis',
             ' <|constrain|>json', 'Paris', '```json', '```', 'function', '\\', '\u00e9', '\U0001f642']
FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def outputs(family: str) -> st.SearchStrategy[str]:
    """Texts made of the family's markers, fragments of the call formats and arbitrary text."""
    markers = [*FAMILIES[family].special, *FAMILIES[family].plain]
    piece = st.one_of(st.sampled_from(markers + FRAGMENTS), st.text(max_size=6))
    return st.lists(piece, max_size=40).map("".join)


def test_every_shipped_tool_parser_is_fuzzed():
    assert {tools for _, _, tools in SETUPS} == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize(("family", "reasoning", "tools"), SETUPS, ids=[f"{r}-{t}" for _, r, t in SETUPS])
def test_hostile_output_parses_without_raising_and_keeps_the_contract(family, reasoning, tools):
    @settings(max_examples=examples(150), **FUZZ)
    @given(output=outputs(family), with_tools=st.booleans())
    def check(output: str, with_tools: bool) -> None:
        parsed = run(output, family, reasoning, tools, request_tools=TOOLS if with_tools else None)
        assert isinstance(parsed.text, str) and parsed.reasoning_ended in (None, True, False)
        assert (parsed.reasoning is None) == (parsed.reasoning_ended is None)
        if parsed.reasoning_ended is False:  # stopped while reasoning: no answer to read calls from
            assert parsed.tool_calls is None and parsed.tool_call_error is None
        for call in parsed.tool_calls or []:
            assert call.type == "function" and call.id and isinstance(call.function.name, str)
            assert call.function.name.strip() and isinstance(call.function.arguments, str)
        if parsed.tool_call_error is None:  # every call returned without an error can be run
            for call in parsed.tool_calls or []:
                assert isinstance(json.loads(call.function.arguments), dict), call
        else:
            assert parsed.tool_call_error.startswith("tool call"), parsed.tool_call_error

    check()
