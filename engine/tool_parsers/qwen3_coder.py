"""Qwen3-Coder's (and Qwen3.5's) XML calls: a function element holding one element per
parameter, each value written as it is, several calls in a row:

    Let me look.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is text; the tool's JSON schema (the request's `tools`) says what it holds, read as
vLLM's `qwen3_coder` parser reads it: a string stays a string, an integer, a number or a
boolean is converted, an object or an array is read as JSON (or a Python literal), "null"
(or "None") is null unless the type is a string that is not nullable. A value that does not
read as its type stays the text; a parameter the schema does not name, and every parameter
of a call without a schema (no `tools`: a `generate` prompt), stays a string.

Values are code and documents, which may hold the format's own tags as text (a parser's test
fixtures, a chat template). A tag is the format's where its place says so: a `</parameter>`
closes its value only where a `</function>`, a `</tool_call>`, another of the tool's
parameters or the end of the call follows it; a `<parameter=` that starts a line inside a
value opens an element of the value's own, which the next `</parameter>` closes. A function
whose name cannot be one (`<function={{ tc.name }}>`: a template written out) is no call:
its text stays in the content.
"""

import ast
import json
import math
import re
from typing import Any

from engine.tool_parsers import hermes
from engine.tool_parsers.abstract import FoundCalls, MalformedCall, ToolParser, joined, quoted, skip_space
from engine.tool_parsers.request_tools import Tools, parameter_schemas

CALL_OPEN, CALL_CLOSE = hermes.OPEN, hermes.CLOSE
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# A parameter's tag at the start of a line (or of the function's body).
_LINE_PARAMETER = re.compile("^" + re.escape(PARAMETER), re.MULTILINE)
_NOT_IN_A_NAME = re.compile(r"[{}<>\"'\s]")
# The schema types (lower-cased) read as strings, booleans and integers, as vLLM names them.
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_BOOLEAN_TYPES = frozenset({"boolean", "bool", "binary"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")


class Qwen3CoderToolParser(ToolParser):
    """`<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
    repeated; the content is the text outside the calls."""

    name = "qwen3_coder"
    markers = (CALL_OPEN, CALL_CLOSE)

    def find_calls(self, text: str) -> FoundCalls | None:
        return self.find_calls_for(text, None)

    def find_calls_for(self, text: str, tools: Tools) -> FoundCalls | None:
        schemas = parameter_schemas(tools)
        tagged = CALL_OPEN in text  # without the tag anywhere, a model that dropped it: every function is a call
        outside, calls = [], []
        taken = search = 0  # the end of the last call; where the next function is looked for
        while (head := text.find(FUNCTION, search)) >= 0:
            search = head + len(FUNCTION)
            start = _call_start(text, head) if tagged else head
            if start is None:  # a function written in the prose, not in a call
                continue
            name_end = text.find(">", search)
            name = text[search:name_end] if name_end >= 0 else None
            if not name or _NOT_IN_A_NAME.search(name):
                header = quoted(text[head:name_end + 1 or None])  # its text stays in the content
                calls.append(MalformedCall(len(calls) + 1, f"{header} names no function (<function=NAME>)"))
                continue
            limit = _calls_end(text, name_end + 1)
            properties = schemas.get(name, {})
            values, body_end = _read_body(text[name_end + 1:limit], set(properties) or None)
            end = name_end + 1 + body_end
            if text.startswith(CALL_CLOSE, close := skip_space(text, end)):
                end = close + len(CALL_CLOSE)
            outside.append(text[taken:start])
            calls.append({"name": name, "arguments": {key: _typed(value, properties[key]) if key in properties
                                                      else value for key, value in values.items()}})
            taken = search = end
        outside.append(text[taken:])
        return FoundCalls(joined(outside), calls) if calls else None


def _call_start(text: str, head: int) -> int | None:
    """Where the call whose function starts at `head` starts: its `<tool_call>` (whitespace
    between them), or None when none opens it."""
    start = head
    while start and text[start - 1].isspace():
        start -= 1
    start -= len(CALL_OPEN)
    return start if start >= 0 and text.startswith(CALL_OPEN, start) else None


def _calls_end(text: str, pos: int) -> int:
    """The end of the call going on at `pos`: its `</tool_call>` that is followed by the next
    call or by the end of the text (one inside a value is followed by more of the value), or
    the end of the text."""
    search = pos
    while (close := text.find(CALL_CLOSE, search)) >= 0:
        after = skip_space(text, close + len(CALL_CLOSE))
        if after == len(text) or text.startswith(CALL_OPEN, after):
            return close
        search = close + len(CALL_CLOSE)
    return len(text)


def _read_body(body: str, names: set[str] | None) -> tuple[dict[str, str], int]:
    """A function's parameters as written, from its `body` (the call's text after the
    function's name), and where the function ends in it (after its `</function>`).
    `names`: the tool's parameters (None: the tool has no schema, any name is one)."""
    values: dict[str, str] = {}
    pos = 0
    while True:
        pos = skip_space(body, pos)
        if pos == len(body) or body.startswith(CALL_CLOSE, pos):
            return values, pos
        if body.startswith(FUNCTION_END, pos):
            return values, pos + len(FUNCTION_END)
        name_end = body.find(">", pos) if body.startswith(PARAMETER, pos) else -1
        if name_end < 0:  # stray text: on to the next tag
            pos = _next_tag(body, pos + 1)
            continue
        start = name_end + 1
        end = _value_end(body, start, names)
        if end >= 0:
            following = end + len(PARAMETER_END)
        else:  # the model left the value open: it runs to the tool's next parameter, or to the function's end
            end = following = _next_parameter(body, start, names)
            if end < 0:
                end = following = _function_end(body, start)
        values[body[pos + len(PARAMETER):name_end]] = _trimmed(body[start:end])
        pos = following


def _value_end(body: str, start: int, names: set[str] | None) -> int:
    """Where the `</parameter>` that closes the value starting at `start` is, or -1."""
    depth, pos = 0, start
    while (close := body.find(PARAMETER_END, pos)) >= 0:
        nested = _LINE_PARAMETER.search(body, pos, close)
        if nested is not None:
            depth += 1
            pos = nested.end()
            continue
        pos = close + len(PARAMETER_END)
        if depth:
            depth -= 1
        elif _closes_a_value(body, pos, names):
            return close
    return -1


def _closes_a_value(body: str, pos: int, names: set[str] | None) -> bool:
    """Whether a `</parameter>` that ends at `pos` is the format's: what follows it is the
    end of the call, of the function, or another parameter of the tool."""
    pos = skip_space(body, pos)
    return pos == len(body) or body.startswith((FUNCTION_END, CALL_CLOSE), pos) or _is_parameter(body, pos, names)


def _is_parameter(body: str, pos: int, names: set[str] | None) -> bool:
    """Whether a parameter of the tool (any parameter, without `names`) starts at `pos`."""
    name_end = body.find(">", pos) if body.startswith(PARAMETER, pos) else -1
    return name_end >= 0 and (names is None or body[pos + len(PARAMETER):name_end] in names)


def _next_parameter(body: str, pos: int, names: set[str] | None) -> int:
    """Where the next parameter of the tool starts a line, or -1."""
    for match in _LINE_PARAMETER.finditer(body, pos):
        if _is_parameter(body, match.start(), names):
            return match.start()
    return -1


def _function_end(body: str, pos: int) -> int:
    """Where the function's `</function>` (the last thing in the call) is, or the body's end."""
    search = pos
    while (end := body.find(FUNCTION_END, search)) >= 0:
        if skip_space(body, end + len(FUNCTION_END)) == len(body):
            return end
        search = end + len(FUNCTION_END)
    return len(body)


def _next_tag(body: str, pos: int) -> int:
    """Where the next parameter, `</function>` or `</tool_call>` at or after `pos` is (the body's end: none)."""
    found = [p for p in (body.find(FUNCTION_END, pos), body.find(CALL_CLOSE, pos)) if p >= 0]
    if (parameter := _LINE_PARAMETER.search(body, pos)) is not None:
        found.append(parameter.start())
    return min(found, default=len(body))


def _trimmed(value: str) -> str:
    """A value without the line break after its opening tag and the one before its closing tag."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _declared_type(schema: object) -> tuple[str, bool]:
    """The type a parameter's schema declares (lower-cased; its first type that is not null,
    "string" when it says none) and whether it admits null."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    else:
        options = schema.get("anyOf", schema.get("oneOf"))
        types = [option["type"] for option in options if isinstance(option, dict) and "type" in option] \
            if isinstance(options, list) else []
    types = [str(kind).strip().lower() for kind in types]
    return next((kind for kind in types if kind != "null"), "string"), "null" in types


def _typed(value: str, schema: object) -> Any:
    """A parameter's text as the value its schema's type says it holds (the text where it
    does not read as one)."""
    kind, nullable = _declared_type(schema)
    if value.lower() in ("null", "none") and (nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in _BOOLEAN_TYPES:
        return value.lower() == "true"  # as vLLM: anything else is false
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    read = _literal(value, container)
    return read if _is_json(read) else value


def _literal(value: str, container: bool) -> Any:
    """The value an object, array or other typed parameter's text holds: JSON first for a
    container (read again when it is a string holding one: templates that wrote a Python
    repr as a JSON string), else a Python literal; the text itself when neither reads."""
    if container:
        try:
            read = json.loads(value)
        except ValueError:
            pass
        else:
            return _python_literal(read) if isinstance(read, str) else read
    read = _python_literal(value)
    return _python_literal(read) if container and isinstance(read, str) else read


def _python_literal(text: str) -> Any:
    """The Python literal `text` holds, or `text`."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError):
        return text


def _is_json(value: Any) -> bool:
    """Whether `value` is a JSON value (a Python literal may be a set, bytes or infinite)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
