"""Mistral calls, after the `[TOOL_CALLS]` marker, in the two forms of its tokenizers:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]      (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other[ARGS]{...}       (v11 and later)

(v13 may put `[CALL_ID]id` between the name and `[ARGS]`; the id is dropped.) The markers
are special tokens of Mistral's tokenizers, so they are missing from the user's text; the
parser finds them in the token ids (`ToolParser.marked_text`), or in the text when the
model wrote them as text. The calls' ids are 9 alphanumerics, the only ids Mistral's chat
templates take back.
"""

import re

from engine.tool_parsers.abstract import (MISTRAL_CALL_IDS, AnswerReading, FoundCalls, ToolParser, WrittenCall, json_at,
                                          quoted, skip_space)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# v11+: the name, an optional call id, an optional [ARGS], up to the arguments' "{".
_NAMED_CALL = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:" + re.escape(CALL_ID) + r"[^\[{]*)?(?:" + re.escape(ARGS)
                         + r")?\s*(?=\{)")
# A JSON list of calls after some other text (a pre-v11 model writing a word before its list).
_LIST_START = re.compile(r"\[\s*\{")


def _read_named(segment: str, match: re.Match, reading: AnswerReading) -> int:
    """A v11 call, `name[ARGS]{...}`, into `reading`; returns where the text after it starts.
    Arguments whose JSON breaks are the rest of the segment, as written."""
    found = json_at(segment, match.end())
    end = len(segment) if isinstance(found, str) else found[1]
    reading.call(TOOL_CALLS + segment[:end], lambda index: WrittenCall(match.group(1), segment[match.end():end]))
    return end


def _read_list(segment: str, pos: int, reading: AnswerReading) -> int:
    """The calls of the JSON list (or the one object) at `pos`, each read on its own into
    `reading`; returns where the text after them starts. A call whose JSON breaks keeps the
    rest of the segment, as written."""
    listed = segment.startswith("[", pos)
    item = skip_space(segment, pos + 1) if listed else pos
    if listed and segment.startswith("]", item):
        return item + 1
    while True:
        found = json_at(segment, item)
        if isinstance(found, str):
            reading.broken(segment[item:], found)
            return len(segment)
        value, end = found
        reading.call(segment[item:end], lambda index: value)
        after = skip_space(segment, end)
        if not listed:
            return end
        if segment.startswith("]", after):
            return after + 1
        if not segment.startswith(",", after):
            reading.broken(segment[after:], f"expected ',' or ']' after a call of the list, got "
                                            f"{quoted(segment[after:])}")
            return len(segment)
        item = skip_space(segment, after + 1)


def _read_segment(segment: str, reading: AnswerReading) -> None:
    """The text after one `[TOOL_CALLS]` into `reading`: its calls, and the text around them
    (words before a JSON list, text after the calls)."""
    pos = skip_space(segment, 0)
    if not segment.startswith(("[", "{"), pos):
        if (match := _NAMED_CALL.match(segment)) is not None:
            reading.text(segment[_read_named(segment, match, reading):])
            return
        if (found := _LIST_START.search(segment, pos)) is None:
            reading.broken(TOOL_CALLS + segment, f"expected a JSON list of calls or name{ARGS}{{...}} after "
                                                 f"{TOOL_CALLS}, got {quoted(segment)}")
            return
        pos = found.start()
    reading.text(segment[:pos])
    reading.text(segment[_read_list(segment, pos, reading):])


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` followed by a JSON list of calls (before v11) or by `name[ARGS]{...}`
    (v11+), repeated; the content is the text before the first marker (and any other text
    outside the calls, such as words a model writes before its list). Each call is read on
    its own."""

    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID)
    call_ids = MISTRAL_CALL_IDS

    def find_calls(self, text: str) -> FoundCalls | None:
        if TOOL_CALLS not in text:
            return None
        before, *segments = text.split(TOOL_CALLS)
        reading = AnswerReading()
        reading.text(before)
        for segment in segments:
            _read_segment(segment, reading)
        return reading.found()
