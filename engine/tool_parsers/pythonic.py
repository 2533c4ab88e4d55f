"""Pythonic calls (Llama 4, Llama 3.2's pythonic templates, ToolACE): a Python list of calls
with keyword arguments of literal values, optionally between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris", days=3), other(x=[1, 2], flag=True)]

The list is read with Python's `ast`, never evaluated: anything but a literal (a name, an
expression, a call) is an error.
"""

import ast
import re

from engine.tool_parsers.abstract import FoundCalls, MalformedCall, ToolParser, quoted

START, END = "<|python_start|>", "<|python_end|>"
# How a list of calls starts: text that starts so and does not parse is a broken call.
_CALLS_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


def _function_name(node: ast.expr) -> str | None:
    """`f` or a dotted `module.f`; None for anything else that is called."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (owner := _function_name(node.value)) is not None:
        return f"{owner}.{node.attr}"
    return None


def _call(node: ast.expr, index: int) -> dict[str, object]:
    """One element of the list as {"name", "arguments"}, its argument values literals."""
    name = _function_name(node.func) if isinstance(node, ast.Call) else None
    if name is None:
        raise MalformedCall(index, f"expected a call name(arg=value, ...), got {quoted(ast.unparse(node))}")
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        raise MalformedCall(index, f"{name}: arguments must be passed by keyword (name=value), got "
                                   f"{quoted(ast.unparse(node))}")
    arguments = {}
    for keyword in node.keywords:
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            raise MalformedCall(index, f"{name}: argument {keyword.arg!r} is not a literal value, got "
                                       f"{quoted(ast.unparse(keyword.value))}") from None
    return {"name": name, "arguments": arguments}


class PythonicToolParser(ToolParser):
    """`[f(a=1), g(b="x")]`, as the whole answer or between `<|python_start|>` and
    `<|python_end|>` (then the text around them is content)."""

    name = "pythonic"
    markers = (START, END)

    def find_calls(self, text: str) -> FoundCalls | None:
        before, start, after = text.partition(START)
        body, _, tail = after.partition(END)
        content = "\n".join(piece.strip() for piece in (before, tail) if piece.strip()) if start else ""
        body = (body if start else text).strip()
        if not _CALLS_START.match(body):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError as error:
            raise MalformedCall(1, f"the calls are not a Python list ({error.msg}, column {error.offset}): "
                                   f"{quoted(body)}") from None
        if not isinstance(tree, ast.List):
            raise MalformedCall(1, f"expected one list of calls [f(a=1), ...], got {quoted(body)}")
        return FoundCalls(content, [_call(node, index) for index, node in enumerate(tree.elts, 1)])
