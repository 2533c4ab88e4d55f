"""DeepSeek V3 (and R1) calls, each between its own markers inside a section of calls:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek V3.1 drops the type and the code fence (`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
{"city": "Paris"}<｜tool▁call▁end｜>`); both read the same.
"""

import re

from engine.tool_parsers.abstract import FoundCalls, MalformedCall, ToolParser, json_value, quoted

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# A call runs to its end marker, or to the end of the text (stopped on EOS before it).
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.DOTALL)
_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)


def _call(body: str, index: int) -> dict[str, object]:
    """One call's text between its markers as {"name", "arguments"}."""
    head, sep, rest = body.partition(SEP)
    if not sep:
        raise MalformedCall(index, f"expected type{SEP}name or name{SEP}arguments, got {quoted(body)}")
    if head.strip() == "function":  # V3: the name on its own line, then the arguments, fenced
        name, _, arguments = rest.strip().partition("\n")
    else:  # V3.1: the name before the separator
        name, arguments = head, rest
    arguments = arguments.strip()
    if (fenced := _FENCE.match(arguments)) is not None:
        arguments = fenced.group(1)
    return {"name": name.strip(), "arguments": json_value(arguments, index, "the arguments text")}


class DeepSeekV3ToolParser(ToolParser):
    """`<｜tool▁calls▁begin｜>` then calls `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`; the
    content is the text outside the section of calls."""

    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def find_calls(self, text: str) -> FoundCalls | None:
        begin = text.find(CALLS_BEGIN)
        begin = text.find(CALL_BEGIN) if begin < 0 else begin
        if begin < 0:
            return None
        section, _, after = text[begin:].partition(CALLS_END)
        calls = [_call(match.group(1), index) for index, match in enumerate(_CALL.finditer(section), 1)]
        content = "\n".join(piece.strip() for piece in (text[:begin], after) if piece.strip())
        return FoundCalls(content, calls)
