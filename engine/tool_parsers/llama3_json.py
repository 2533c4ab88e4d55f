"""Llama 3.1/3.2/3.3 JSON calls: the answer is a JSON object `{"name": ..., "parameters":
{...}}` (some fine-tunes write "arguments"), optionally after `<|python_tag|>`, several
separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

An answer that is not such JSON is plain content: prose, code after `<|python_tag|>` (the
built-in code interpreter) and a JSON answer that is not a call (keys other than a call's).
"""

import json
import re

from engine.tool_parsers.abstract import FoundCalls, MalformedCall, ToolParser, quoted, skip_space

PYTHON_TAG = "<|python_tag|>"
# The keys of a call object; an object with others is the model's JSON answer, not a call.
_CALL_KEYS = {"name", "parameters", "arguments", "type"}
# How a call starts: text that starts so and does not parse is a broken call, not prose.
_CALL_START = re.compile(r'\{\s*"name"\s*:')
_DECODER = json.JSONDecoder()


def _is_call(value: object) -> bool:
    return isinstance(value, dict) and value.keys() <= _CALL_KEYS and bool(value.keys() & (_CALL_KEYS - {"type"}))


class Llama3JsonToolParser(ToolParser):
    """`{"name": ..., "parameters": {...}}` objects, `;`-separated, as the whole answer or
    after `<|python_tag|>` (the text before the tag is content; so is text after the calls)."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def find_calls(self, text: str) -> FoundCalls | None:
        before, tag, body = text.partition(PYTHON_TAG)
        content, body = (before.strip(), body.strip()) if tag else ("", text.strip())
        if not body.startswith("{"):
            return None
        calls, pos = [], 0
        while pos < len(body) and body[pos] == "{":
            try:
                value, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError as error:
                if not calls and not _CALL_START.match(body):
                    return None
                raise MalformedCall(len(calls) + 1, f"the call is not valid JSON ({error.msg} at char {error.pos}): "
                                                    f"{quoted(body[pos:])}") from None
            if not _is_call(value):
                if not calls:
                    return None
                raise MalformedCall(len(calls) + 1, f"expected {{\"name\": ..., \"parameters\": {{...}}}} after "
                                                    f"';', got {quoted(body[pos:end])}")
            calls.append(value)
            pos = skip_space(body, end)
            if body.startswith(";", pos):
                pos = skip_space(body, pos + 1)
        rest = body[pos:].strip()
        return FoundCalls("\n".join(piece for piece in (content, rest) if piece), calls)
