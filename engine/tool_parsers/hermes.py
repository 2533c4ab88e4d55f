"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2 Pro and 3, SmolLM3): each call a JSON object
between `<tool_call>` and `</tool_call>`, several in a row:

    Let me look.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

import re

from engine.tool_parsers.abstract import AnswerReading, FoundCalls, ToolParser, json_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A call runs to its closing tag, or to the end of the text: a model that stops on EOS
# before closing its last call still wrote the whole call when its JSON is complete.
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated; the content is
    the text outside the calls (normally what comes before the first one). Each call is read
    on its own: one whose JSON breaks stays in the content, tags and all."""

    name = "hermes"
    markers = (OPEN, CLOSE)

    def find_calls(self, text: str) -> FoundCalls | None:
        if OPEN not in text:
            return None
        reading, pos = AnswerReading(), 0
        for match in _CALL.finditer(text):
            reading.text(text[pos:match.start()])
            reading.call(match.group(0), lambda index: json_value(match.group(1).strip(), index))
            pos = match.end()
        reading.text(text[pos:])
        return reading.found()
