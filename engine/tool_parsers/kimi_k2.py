"""Kimi K2's calls: a section of calls (special tokens), each call its id, then its arguments
as a JSON object:

    Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id, `functions.NAME:N` (or `NAME:N`), names the function and stays the call's id: Kimi's
chat template writes it back when the conversation goes on. Kimi K2.5 may write a bare counter
(`0`) instead; the function is then the request's only tool, or the one tool whose parameters
hold every argument the call gives. A call whose id is neither, or whose function the tools do
not tell, is not read (vLLM drops it; here it stays in the content and is named in the error);
a section that holds no call is an error.
"""

import json

from engine.tool_parsers.abstract import AnswerReading, FoundCalls, MalformedCall, ToolParser, WrittenCall, quoted
from engine.tool_parsers.request_tools import Tools, parameter_schemas

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_NOT_IN_AN_ID = frozenset(" \t\n\r<|")


class KimiK2ToolParser(ToolParser):
    """`<|tool_calls_section_begin|>` then calls `<|tool_call_begin|>ID<|tool_call_argument_begin|>
    {...}<|tool_call_end|>`; the content is the text outside the section."""

    name = "kimi_k2"
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARGUMENTS)

    def find_calls(self, text: str) -> FoundCalls | None:
        return self.find_calls_for(text, None)

    def find_calls_for(self, text: str, tools: Tools) -> FoundCalls | None:
        before, begun, section = text.partition(SECTION_BEGIN)
        if not begun:
            return None
        section, _, after = section.partition(SECTION_END)
        calls = section.split(CALL_BEGIN)[1:]
        if not calls:
            raise MalformedCall(1, "the calls section holds no call")
        schemas = parameter_schemas(tools)
        reading, ids = AnswerReading(), []
        reading.text(before)
        for written in calls:
            header, marked, arguments = written.partition(CALL_END)[0].partition(ARGUMENTS)
            ids.append(header.strip())
            reading.call(CALL_BEGIN + written, lambda index: _call(header.strip(), marked, arguments, schemas, index))
        reading.text(after)
        return reading.found(ids)


def _call(call_id: str, marked: str, arguments: str, schemas: dict[str, dict], index: int) -> WrittenCall:
    """One call: its id (`marked`: the arguments' marker, when the call has one) names the
    function, its arguments as written."""
    name = None if not marked or _NOT_IN_AN_ID & set(call_id) else _function_name(call_id, arguments, schemas)
    if name is None:
        raise MalformedCall(index, f"{quoted(call_id)} is not a call id (functions.NAME:N), nor a counter whose "
                                   "function the request's tools tell")
    return WrittenCall(name, arguments)


def _function_name(call_id: str, arguments: str, schemas: dict[str, dict]) -> str | None:
    """The function a call's id names: NAME of `functions.NAME:N` or `NAME:N`; for a bare
    counter, the request's only tool, or its one tool whose parameters hold every argument
    given (`arguments`, JSON text). None when the id is neither or the tools do not tell."""
    if call_id.isdigit():
        if len(schemas) == 1:
            return next(iter(schemas))
        try:
            given = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(given, dict) or not given:
            return None
        fitting = [name for name, properties in schemas.items() if given.keys() <= properties.keys()]
        return fitting[0] if len(fitting) == 1 else None
    name, colon, counter = call_id.rpartition(":")
    if not (colon and counter.isdigit()):
        return None
    return name.removeprefix("functions.") or None
