"""Llama 3.1/3.2/3.3 JSON calls: JSON objects `{"name": ..., "parameters": {...}}` (some
fine-tunes write "arguments"), optionally after `<|python_tag|>`, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The small Llama 3.2 models often write a sentence before the call, or after it; as vLLM does,
the first object with a "name" and its arguments starts the calls wherever it is, and the text
around them is the content. An answer without such an object is plain content: prose, code
after `<|python_tag|>` (the built-in code interpreter), a JSON answer that is not a call.
"""

import json
import re

from engine.tool_parsers.abstract import (AnswerReading, FoundCalls, MalformedCall, ToolParser, json_at, quoted,
                                          skip_space)

PYTHON_TAG = "<|python_tag|>"
# Where a call may start: an object whose first key is "name".
_CALL_START = re.compile(r'\{\s*"name"\s*:')


def _is_call(value: object) -> bool:
    """A call object: a "name" and arguments under "parameters" or "arguments" (a JSON answer
    with a "name" alone is not a call)."""
    return isinstance(value, dict) and "name" in value and ("parameters" in value or "arguments" in value)


def _is_call_at(body: str, pos: int) -> bool:
    """Whether a call object starts at `pos`."""
    found = json_at(body, pos)
    return not isinstance(found, str) and _is_call(found[0])


def _first_call(body: str) -> int | None:
    """Where the first call starts in `body` (an object that is a call, or one whose JSON
    breaks: a broken call), None when it holds none."""
    for match in _CALL_START.finditer(body):
        found = json_at(body, match.start())
        if isinstance(found, str) or _is_call(found[0]):
            return match.start()
    return None


def _call_after_separator(value: object, index: int) -> object:
    """An object written after a `;`, which must be a call."""
    if not _is_call(value):
        raise MalformedCall(index, f"expected {{\"name\": ..., \"parameters\": {{...}}}} after ';', got "
                                   f"{quoted(json.dumps(value, ensure_ascii=False))}")
    return value


def _read_calls(body: str, start: int, reading: AnswerReading) -> int:
    """Reads the calls from `start` on, `;`- or whitespace-separated, each on its own, into
    `reading`; returns where the text after them starts (a dangling `;` left out). After a
    `;` an object is a call, broken or not; after whitespace only a call goes on."""
    pos = start
    while True:
        found = json_at(body, pos)
        if isinstance(found, str):  # no end to find: the rest is the broken call
            reading.broken(body[pos:], found)
            return len(body)
        value, end = found
        reading.call(body[pos:end], lambda index: _call_after_separator(value, index))
        after = skip_space(body, end)
        separated = body.startswith(";", after)
        following = skip_space(body, after + 1) if separated else after
        if not body.startswith("{", following):
            return following if separated else end
        if not separated and not _is_call_at(body, following):
            return end
        pos = following


class Llama3JsonToolParser(ToolParser):
    """`{"name": ..., "parameters": {...}}` objects, `;`-separated, where the first one starts
    (after `<|python_tag|>` when the model writes it); the text around them is content."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def find_calls(self, text: str) -> FoundCalls | None:
        before, tag, body = text.partition(PYTHON_TAG)
        if not tag:
            before, body = "", text
        start = _first_call(body)
        if start is None:
            return None
        reading = AnswerReading()
        reading.text(before)
        reading.text(body[:start])
        end = _read_calls(body, start, reading)
        reading.text(body[end:])
        return reading.found()
