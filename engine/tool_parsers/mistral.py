"""Mistral calls, after the `[TOOL_CALLS]` marker, in the two forms of its tokenizers:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]      (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other[ARGS]{...}       (v11 and later)

(v13 may put `[CALL_ID]id` between the name and `[ARGS]`; the id is dropped.) The markers
are special tokens of Mistral's tokenizers, so they are missing from the user's text; the
parser finds them in the token ids (`ToolParser.marked_text`), or in the text when the
model wrote them as text. The calls' ids are 9 alphanumerics, the only ids Mistral's chat
templates take back.
"""

import json
import re

from engine.tool_parsers.abstract import MISTRAL_CALL_IDS, FoundCalls, MalformedCall, ToolParser, quoted, skip_space

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# v11+: the name, an optional call id, an optional [ARGS], up to the arguments' "{".
_NAMED_CALL = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:" + re.escape(CALL_ID) + r"[^\[{]*)?(?:" + re.escape(ARGS)
                         + r")?\s*(?=\{)")
# A JSON list of calls after some other text (a pre-v11 model writing a word before its list).
_LIST_START = re.compile(r"\[\s*\{")
_DECODER = json.JSONDecoder()


def _json_at(text: str, pos: int, index: int, what: str) -> tuple[object, int]:
    """The JSON value starting at `pos` and the position after it."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as error:
        raise MalformedCall(index, f"{what} are not valid JSON ({error.msg} at char {error.pos - pos}): "
                                   f"{quoted(text[pos:])}") from None


def _segment_calls(segment: str, index: int) -> tuple[list[object], str, str]:
    """The calls of the text after one `[TOOL_CALLS]` (`index`: the first one's number), the
    text before them (other than whitespace: words before a JSON list) and the text after."""
    pos = skip_space(segment, 0)
    if not segment.startswith(("[", "{"), pos):
        if (match := _NAMED_CALL.match(segment)) is not None:
            arguments, end = _json_at(segment, match.end(), index, "the arguments")
            return [{"name": match.group(1), "arguments": arguments}], "", segment[end:]
        if (found := _LIST_START.search(segment, pos)) is None:
            raise MalformedCall(index, f"expected a JSON list of calls or name{ARGS}{{...}} after {TOOL_CALLS}, "
                                       f"got {quoted(segment)}")
        pos = found.start()
    value, end = _json_at(segment, pos, index, "the calls")
    return (value if isinstance(value, list) else [value]), segment[:pos], segment[end:]


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` followed by a JSON list of calls (before v11) or by `name[ARGS]{...}`
    (v11+), repeated; the content is the text before the first marker (and any other text
    outside the calls, such as words a model writes before its list)."""

    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID)
    call_ids = MISTRAL_CALL_IDS

    def find_calls(self, text: str) -> FoundCalls | None:
        if TOOL_CALLS not in text:
            return None
        before, *segments = text.split(TOOL_CALLS)
        outside, calls = [before], []
        for segment in segments:
            found, before_calls, after = _segment_calls(segment, len(calls) + 1)
            calls.extend(found)
            outside += [before_calls, after]
        return FoundCalls("\n".join(piece.strip() for piece in outside if piece.strip()), calls)
