"""DeepSeek V3.1 calls (vLLM's `deepseek_v31`), each between its own markers inside a section
of calls, the name before the separator and the arguments' JSON after it:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

(all on one line).

The section and its markers are DeepSeek's since V3 (`deepseek_v3` reads V3's own calls in
the same section); the markers are plain added tokens of DeepSeek's tokenizers, kept in the
user's text. Each call is read on its own; a section that holds no call that parses is a
broken call, never text cut away.
"""

import re

from engine.tool_parsers.abstract import AnswerReading, FoundCalls, MalformedCall, ToolParser, WrittenCall, quoted

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# A call runs to its end marker, or to the end of the text (stopped on EOS before it).
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.DOTALL)


def v31_call(body: str, index: int) -> WrittenCall:
    """One call's text between its markers in V3.1's form, `name<｜tool▁sep｜>{...}`."""
    name, sep, arguments = body.partition(SEP)
    if not sep:
        raise MalformedCall(index, f"expected name{SEP}arguments, got {quoted(body)}")
    return WrittenCall(name, arguments)


class DeepSeekV31ToolParser(ToolParser):
    """`<｜tool▁calls▁begin｜>` then calls `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`, each read by
    `read_call`; the content is the text outside the section of calls."""

    name = "deepseek_v31"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def read_call(self, body: str, index: int) -> WrittenCall:
        """One call's text between its markers: its name and its arguments' text."""
        return v31_call(body, index)

    def find_calls(self, text: str) -> FoundCalls | None:
        begin = text.find(CALLS_BEGIN)
        begin = text.find(CALL_BEGIN) if begin < 0 else begin
        if begin < 0:
            return None
        section, _, after = text[begin:].partition(CALLS_END)
        reading = AnswerReading()
        reading.text(text[:begin])
        for match in _CALL.finditer(section):
            reading.call(match.group(0), lambda index: self.read_call(match.group(1), index))
        if not reading.calls:
            reading.broken(section, f"the section of calls holds no {CALL_BEGIN}...{CALL_END}: {quoted(section)}")
        reading.text(after)
        return reading.found()
