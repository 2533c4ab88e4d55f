"""gpt-oss's calls in its harmony format (vLLM's `openai` parser): a message on the commentary
channel addressed to a function, its arguments as the message:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or with the recipient in the role part of the header, as gpt-oss's chat template writes
earlier calls: `<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>...`.
The reasoning parser (`openai_gptoss`) ends the analysis where the commentary channel starts
and hands the rest over as the answer, so the answer starts inside the first message's
header. A commentary message without a recipient (a preamble to the user) is content.
"""

import re

from engine.tool_parsers.abstract import AnswerReading, FoundCalls, MalformedCall, ToolParser, WrittenCall, quoted

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
RECIPIENT = "to=functions."
# A message: its header (or the rest of one), then its body up to the next terminator.
_MESSAGE = re.compile(re.escape(MESSAGE) + r"(?P<body>.*?)(?:" + "|".join(map(re.escape, (CALL, END, RETURN)))
                      + r"|\Z)", re.DOTALL)
_NAME = re.compile(re.escape(RECIPIENT) + r"(?P<name>[^\s<]*)")


def _call(header: str, body: str, index: int) -> WrittenCall:
    """A message addressed to a function: its body, the arguments' JSON text (an empty body:
    none)."""
    name = _NAME.search(header)["name"]
    if not name:
        raise MalformedCall(index, f"the recipient names no function: {quoted(header.strip())}")
    return WrittenCall(name, body)


class OpenAIToolParser(ToolParser):
    """Messages whose header holds `to=functions.NAME` are calls, their bodies the arguments;
    other messages' bodies (and text outside any message) are the content."""

    name = "openai"
    markers = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)

    def find_calls(self, text: str) -> FoundCalls | None:
        if RECIPIENT not in text or MESSAGE not in text:
            return None
        reading, position = AnswerReading(), 0
        for match in _MESSAGE.finditer(text):
            header = text[position : match.start()]
            if RECIPIENT in header:
                reading.call(text[position : match.end()], lambda index: _call(header, match["body"], index))
            else:
                reading.text(match["body"])
            position = match.end()
        return reading.found() if reading.calls else None
