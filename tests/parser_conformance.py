"""vLLM's parser test cases run through our engine's end-of-completion path.

Each case is a model output from one of vLLM's reasoning- or tool-parser tests (vLLM's
`tests/reasoning/`, `tests/tool_parsers/`, run-batch's tests), written here in our words
as a `Case`: the output, the parsers, and what vLLM's test expects. `run` tokenizes the
output with a tiny tokenizer carrying the family's markers as its real tokenizer holds them
(special tokens, or plain added tokens), feeds the tokens one by one to the reasoning
tracker and the detokenizer as the output processor does, and ends with
`engine.output_processor.parsing.parse_completion`, the function the engine calls on a finished
completion. vLLM's streaming tests and its one-shot tests check the same final result; the
engine's path is token by token in both cases.

A case we answer differently on purpose names its difference, one of `DIFFERENCES` (the
one list; docs/engine.md lists the same, checked by the test), and gives our result for
the fields that differ. The check then asserts both that we give our result and that it
differs from vLLM's (a difference that no longer holds fails), and that no difference loses
a call, a reasoning section or an answer.

Representation, not difference: vLLM's None and "" are the same for `content` and
`reasoning` (our `text` is always a string); calls compare by name and arguments as JSON
values (vLLM's tests mostly compare `json.loads` of the arguments; a case whose test compares
the text gives it as "arguments_text").
"""

import functools
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AddedToken, AutoTokenizer, PreTrainedTokenizerBase

from engine.output_processor.detokenizer import IncrementalDetokenizer
from engine.output_processor.parsing import ParsedCompletion, parse_completion
from engine.reasoning import reasoning_parser
from engine.tool_parsers import tool_parser
from engine.tool_parsers.request_tools import RequestTools
from tests.tiny_models import build_tokenizer

# The deliberate differences from vLLM, each with its reason (docs/engine.md's
# "Differences from vLLM's parsers" lists the same names).
DIFFERENCES: dict[str, str] = {
    "stripped": "The reasoning is stripped of the whitespace around it and the answer of the line breaks before "
                "its first line, whose indentation stays (vLLM keeps '\\nThe answer'): a table's cell holds the "
                "thinking and the answer, not the template's line breaks, as Qwen3's template strips them when the "
                "turn is fed back.",
    "broken_call_flagged": "A call that cannot be read (no name, no JSON list after Mistral's marker) stays in the "
                           "content as the model wrote it, its markers included, and is named in tool_call_error, "
                           "where vLLM drops it (or its marker) silently: the row is flagged and keeps what the model "
                           "wrote.",
    "content_around_calls": "The content keeps the text the model writes after its calls (and Llama 3 JSON's text "
                            "before them), where vLLM keeps only the text before the first call (none for Llama 3 "
                            "JSON): nothing the model wrote leaves the row.",
    "content_stripped": "The content beside the calls is stripped of the whitespace next to them, as for every call "
                        "format here (vLLM keeps Kimi K2's 'I'll check. ' before its calls section): a table's cell "
                        "holds the model's words, the same whatever the format.",
    "arguments_normalised": "Arguments are JSON text written one way for every format (json.dumps, unicode kept), as "
                            "vLLM writes them for hermes, llama3_json, mistral and pythonic; vLLM passes DeepSeek's "
                            "text on as the model spaced it: a table's arguments column holds one form whatever the "
                            "model, so the same call compares equal.",
}


@dataclass(frozen=True)
class Family:
    """A model family's marker tokens as its real tokenizer holds them: `special` (a decode
    with special tokens skipped drops them) and `plain` (added tokens kept in the text)."""

    special: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "qwen3": Family(special=("<|im_end|>", "<|im_start|>"), plain=("<think>", "</think>", "<tool_call>", "</tool_call>")),
    "deepseek_r1": Family(special=("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"), plain=("<think>", "</think>")),
    "mistral": Family(special=("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
    "harmony": Family(special=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                               "<|constrain|>")),
    # A tokenizer without markers (vLLM's pythonic tests run on a plain one).
    "plain": Family(),
    "llama3": Family(special=("<|python_tag|>", "<|eom_id|>", "<|eot_id|>")),
    "llama4": Family(special=("<|python_start|>", "<|python_end|>", "<|eom|>", "<|eot|>")),
    # DeepSeek V3, R1 and V3.1: the call markers are plain added tokens (vLLM's parsers find them
    # in the text decoded with special tokens skipped).
    "deepseek_v3": Family(special=("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
                          plain=("<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                 "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")),
    "kimi_k2": Family(special=("<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                               "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"),
                      plain=("<think>", "</think>")),
}


@functools.cache
def _base_tokenizer_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="conformance_tokenizer_"))
    build_tokenizer(folder)
    return folder


@functools.cache
def family_tokenizer(family: str) -> PreTrainedTokenizerBase:
    """The tiny test tokenizer with `family`'s markers added as its real tokenizer has them
    (one instance per family and process: callers must not add tokens to it)."""
    tokens = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(_base_tokenizer_folder())
    if tokens.special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(tokens.special)})
    if tokens.plain:
        tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in tokens.plain])
    return tokenizer


def run(output: str, family: str, reasoning: str | None = None, tools: str | None = None, prompt: str = "",
        skip_special_tokens: bool = True, request_tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
    """`output`, tokenized on `family`'s tokenizer, through the engine's path: the tracker
    and the detokenizer one token at a time after `prompt`'s tokens, then `parse_completion`
    (`request_tools`: the tools the request declared)."""
    tokenizer = family_tokenizer(family)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids if prompt else []
    ids = tokenizer(output, add_special_tokens=False).input_ids
    parser = reasoning_parser(reasoning, tokenizer) if reasoning else None
    tracker = parser.tracker(prompt_ids) if parser else None
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    for count, token in enumerate(ids, start=1):
        detokenizer.add_token(token)
        if tracker is not None:
            tracker.advance(token, count, detokenizer.text)
    calls = tool_parser(tools, tokenizer) if tools else None
    return parse_completion(detokenizer.text, ids, parser, tracker, calls, skip_special_tokens,
                            RequestTools(request_tools) if request_tools is not None else None)


def calls_of(parsed: ParsedCompletion) -> list[tuple[str, Any]] | None:
    """The calls as (name, arguments as a JSON value, or as their text where they are not
    JSON: a broken call passed on as written), None without any."""
    if parsed.tool_calls is None:
        return None
    return [(call.function.name, _json_or_text(call.function.arguments)) for call in parsed.tool_calls]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def observed(parsed: ParsedCompletion) -> dict[str, Any]:
    """The fields a case checks, in vLLM's terms."""
    return {"reasoning": parsed.reasoning or None, "content": parsed.text or None, "tool_calls": calls_of(parsed),
            "reasoning_ended": parsed.reasoning_ended, "error": parsed.tool_call_error,
            "ids": [call.id for call in parsed.tool_calls] if parsed.tool_calls else None,
            "arguments_text": [call.function.arguments for call in parsed.tool_calls] if parsed.tool_calls else None}


class Contains(str):
    """An expected "content" or "reasoning" that vLLM's test checks with `in`: the field holds this text."""


@dataclass(frozen=True)
class Case:
    """One of vLLM's cases. `source`: vLLM's test file and case name; `expected`: what vLLM's
    test expects, by field of `observed` ("reasoning", "content", "tool_calls": a list of
    (name, arguments) or None, "reasoning_ended", "error": True for "an error is reported",
    or None, "ids": the calls' ids where the format keeps the model's, "arguments_text": the
    calls' arguments as exact text, where vLLM's test compares the text); `difference`: the
    name of one of `DIFFERENCES` where we differ on purpose, with `ours`, our value of each
    field that differs; `request_tools`: the tools the request declared (OpenAI's function
    tools), for parsers that read the calls by them; `skip_special_tokens`: the request's,
    False where vLLM's test reads a text that keeps the family's special markers."""

    id: str
    source: str
    family: str
    output: str
    expected: dict[str, Any]
    reasoning: str | None = None
    tools: str | None = None
    prompt: str = ""
    difference: str | None = None
    ours: dict[str, Any] = field(default_factory=dict)
    request_tools: list[dict[str, Any]] | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if (self.difference is None) != (not self.ours):
            raise ValueError(f"case {self.id}: a difference needs our values and our values need a difference")
        if self.difference is not None and self.difference not in DIFFERENCES:
            raise ValueError(f"case {self.id}: difference {self.difference!r} is not one of {sorted(DIFFERENCES)}")


def _matches(want: dict[str, Any], got: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields of `want` that `got` does not match, as (wanted, got)."""
    wrong = {}
    for name, value in want.items():
        actual = got[name]
        if name == "error":
            ok = (actual is not None) == bool(value) if isinstance(value, bool) or value is None else value in (actual or "")
        elif isinstance(value, Contains):
            ok = value in (actual or "")
        elif name == "tool_calls" and value is not None:
            ok = actual is not None and [(n, a) for n, a in value] == actual
        else:
            ok = (value or None) == actual if name in ("content", "reasoning") else value == actual
        if not ok:
            wrong[name] = (value, actual)
    return wrong


def check(case: Case) -> None:
    """Runs the case and asserts vLLM's result, or our listed difference from it."""
    got = observed(run(case.output, case.family, case.reasoning, case.tools, case.prompt,
                       case.skip_special_tokens, case.request_tools))
    if case.difference is None:
        wrong = _matches(case.expected, got)
        assert not wrong, f"{case.id} ({case.source}): differs from vLLM (wanted, got): {wrong}"
        return
    wrong = _matches({**case.expected, **case.ours}, got)
    assert not wrong, f"{case.id} ({case.source}): differs from our listed result (wanted, got): {wrong}"
    assert _matches(case.expected, got), f"{case.id}: listed as {case.difference!r}, but now matches vLLM: unlist it"
    _keeps_everything(case, got)


def _keeps_everything(case: Case, got: dict[str, Any]) -> None:
    """A deliberate difference never loses a call, a reasoning section or an answer: it has
    at least vLLM's calls, and a reasoning and a content wherever vLLM has them."""
    want = case.expected
    if want.get("tool_calls"):
        assert len(got["tool_calls"] or []) >= len(want["tool_calls"]), \
            f"{case.id}: the difference {case.difference!r} loses a call"
    for name in ("reasoning", "content"):
        if (want.get(name) or "").strip():
            assert (got[name] or "").strip(), f"{case.id}: the difference {case.difference!r} loses the {name}"


def ids_of(cases: Sequence[Case]) -> list[str]:
    return [case.id for case in cases]
