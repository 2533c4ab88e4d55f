"""Pythonic calls (Llama 4, Llama 3.2's pythonic templates, ToolACE): a Python list of calls
with keyword arguments of literal values, optionally between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris", days=3), other(x=[1, 2], flag=True)]

Each call of the list is read with Python's `ast` on its own, never evaluated: the list is
split at its top-level commas first (strings and brackets followed), so a call that is not
a call of literal JSON values (a name, an expression, bytes, 1e999, a broken quote) stays in
the content as written and the others are still read.
"""

import ast
import json
import re

from engine.tool_parsers.abstract import AnswerReading, FoundCalls, MalformedCall, ToolParser, quoted

START, END = "<|python_start|>", "<|python_end|>"
# How a list of calls starts: text that starts so and does not parse is a broken call.
_CALLS_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_OPENING, _CLOSING = "([{", ")]}"


def _function_name(node: ast.expr) -> str | None:
    """`f` or a dotted `module.f`; None for anything else that is called."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (owner := _function_name(node.value)) is not None:
        return f"{owner}.{node.attr}"
    return None


def _argument(name: str, keyword: ast.keyword, written: str, index: int) -> object:
    """A keyword argument's value (`written`: the call's text): a literal that JSON can hold."""
    try:
        value = ast.literal_eval(keyword.value)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        raise MalformedCall(index, f"{name}: argument {keyword.arg!r} is not a literal JSON value, got "
                                   f"{quoted(ast.get_source_segment(written, keyword.value) or '')}") from None
    return value


def _call(written: str, index: int) -> dict[str, object]:
    """One element of the list, `written` as the model wrote it, as {"name", "arguments"}."""
    try:
        node = ast.parse(written, mode="eval").body
    except SyntaxError as error:
        raise MalformedCall(index, f"not a Python call ({error.msg}, column {error.offset}): "
                                   f"{quoted(written)}") from None
    name = _function_name(node.func) if isinstance(node, ast.Call) else None
    if name is None:
        raise MalformedCall(index, f"expected a call name(arg=value, ...), got {quoted(written)}")
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        raise MalformedCall(index, f"{name}: arguments must be passed by keyword (name=value), got {quoted(written)}")
    return {"name": name,
            "arguments": {keyword.arg: _argument(name, keyword, written, index) for keyword in node.keywords}}


def _string_end(text: str, pos: int) -> int:
    """Where the string literal opening at `pos` ends (after its closing quote; the end of
    `text` when it is never closed), escapes and triple quotes followed."""
    quote = text[pos] * 3 if text.startswith(text[pos] * 3, pos) else text[pos]
    i = pos + len(quote)
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text.startswith(quote, i):
            return i + len(quote)
        else:
            i += 1
    return len(text)


def _elements(body: str) -> tuple[list[str], str]:
    """The elements of the list `body` starts with, as written (split at its top-level
    commas), and the text after its closing bracket. A list that is never closed (a string
    left open, a cut answer) ends with the text."""
    elements, depth, start, i = [], 0, 1, 1
    while i < len(body):
        char = body[i]
        if char in "'\"":
            i = _string_end(body, i)
            continue
        if depth == 0 and char in ",]":
            elements.append(body[start:i])
            start = i + 1
            if char == "]":
                return elements, body[start:]
        elif char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            depth = max(depth - 1, 0)
        i += 1
    elements.append(body[start:])
    return elements, ""


class PythonicToolParser(ToolParser):
    """`[f(a=1), g(b="x")]`, as the whole answer or between `<|python_start|>` and
    `<|python_end|>` (then the text around them is content); text after the list is content
    too."""

    name = "pythonic"
    markers = (START, END)

    def find_calls(self, text: str) -> FoundCalls | None:
        before, start, after = text.partition(START)
        body, _, tail = after.partition(END)
        body = (body if start else text).strip()
        if not _CALLS_START.match(body):
            return None
        elements, rest = _elements(body)
        reading = AnswerReading()
        if start:
            reading.text(before)
        for element in filter(str.strip, elements):
            reading.call(element.strip(), lambda index: _call(element.strip(), index))
        reading.text(rest)
        if start:
            reading.text(tail)
        return reading.found()
