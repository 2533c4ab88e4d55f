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

from engine.tool_parsers.abstract import FoundCalls, MalformedCall, ToolParser, quoted, skip_space

PYTHON_TAG = "<|python_tag|>"
# Where a call may start: an object whose first key is "name".
_CALL_START = re.compile(r'\{\s*"name"\s*:')
_DECODER = json.JSONDecoder()


def _is_call(value: object) -> bool:
    """A call object: a "name" and arguments under "parameters" or "arguments" (a JSON answer
    with a "name" alone is not a call)."""
    return isinstance(value, dict) and "name" in value and ("parameters" in value or "arguments" in value)


def _object_at(body: str, pos: int, index: int) -> tuple[object, int]:
    """The JSON value starting at `pos` and the position after it; MalformedCall when it breaks."""
    try:
        return _DECODER.raw_decode(body, pos)
    except json.JSONDecodeError as error:
        raise MalformedCall(index, f"the call is not valid JSON ({error.msg} at char {error.pos - pos}): "
                                   f"{quoted(body[pos:])}") from None


def _first_call(body: str) -> int | None:
    """Where the first call object starts in `body`, None when it holds none."""
    for match in _CALL_START.finditer(body):
        value, _ = _object_at(body, match.start(), 1)
        if _is_call(value):
            return match.start()
    return None


def _calls_from(body: str, start: int) -> tuple[list[object], int]:
    """The calls from `start` on, `;`- or whitespace-separated, and where the text after them
    starts (a dangling `;` left out)."""
    value, end = _object_at(body, start, 1)
    calls = [value]
    while True:
        after = skip_space(body, end)
        separated = body.startswith(";", after)
        following = skip_space(body, after + 1) if separated else after
        if not body.startswith("{", following):
            return calls, following if separated else end
        try:  # after a `;`, a call; after whitespace, a call or the text after the calls
            value, next_end = _object_at(body, following, len(calls) + 1)
            if not _is_call(value):
                raise MalformedCall(len(calls) + 1, f"expected {{\"name\": ..., \"parameters\": {{...}}}} after "
                                                    f"';', got {quoted(body[following:next_end])}")
        except MalformedCall:
            if separated:
                raise
            return calls, end
        calls.append(value)
        end = next_end


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
        calls, end = _calls_from(body, start)
        content = "\n".join(piece.strip() for piece in (before, body[:start], body[end:]) if piece.strip())
        return FoundCalls(content, calls)
