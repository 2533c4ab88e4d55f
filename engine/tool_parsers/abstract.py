"""The contract of a tool-call parser: a completion's answer in, OpenAI-shaped calls out.

Each format (one module per format) finds the calls the model wrote and hands them over as
the objects the model meant, `{"name": ..., "arguments": {...}}`; this module checks them
the same way for every format (a name, arguments that are a JSON object), normalises the
arguments to JSON text written one way for every format, and gives each call an id derived
from the text, so that the same output gives the same ids (reproducible tables), in the
format's id style (`CallIds`: OpenAI's `call_...` by default, Mistral's 9 alphanumerics).

A call that does not parse never raises out of `ToolParser.parse`, and never takes the other
calls with it: the calls that parse are returned; a call the format names whose arguments are
not a JSON object is returned too, its arguments as the model wrote them; a call the format
cannot name stays in the content as the model wrote it (markers written back in). Either is
named in `error` ("tool call N: ..."), so the row is flagged and nothing the model wrote is
lost.
"""

import hashlib
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.outputs import FunctionCall, ToolCall
from engine.tool_parsers.request_tools import Tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How much of a wrong piece of text an error message quotes.
_QUOTED_CHARS = 80
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallResult:
    """What a parser found in an answer: `content`, the text the model wrote besides the
    calls (their markup removed; a call that cannot be read stays in it as written);
    `tool_calls`, None when there are none; `error`, which calls do not parse and why (the
    calls that parse are still in `tool_calls`; when none does, `content` is the whole text
    as the model wrote it, its markers written back in)."""

    content: str
    tool_calls: list[ToolCall] | None
    error: str | None


@dataclass(frozen=True)
class FoundCalls:
    """A format's reading of an answer before the checks: the text besides the calls and
    each call as the model wrote it (a JSON value, a dict built from the markup, a
    `WrittenCall`), or the `MalformedCall` saying why the call cannot be read (its text is
    then in `content`)."""

    content: str
    calls: list[object]
    ids: list[str] | None = None  # the format's own call ids, one per call (None: derived from the text)


@dataclass(frozen=True)
class WrittenCall:
    """A call whose name the format reads from its markup and whose `arguments` are the text
    the model wrote for them (JSON text; empty: no arguments)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallIds:
    """How a format's tool-call ids look: `prefix`, then `length` characters of `alphabet`
    drawn from a hash of the answer's text and the call's position, so the same output gives
    the same ids. A format whose chat template checks the ids it is fed back declares its
    own style (Mistral's templates refuse anything but 9 alphanumerics)."""

    prefix: str
    length: int
    alphabet: str

    def make(self, text: str, index: int) -> str:
        """The id of call `index` (1-based) of the answer `text`."""
        digest = hashlib.sha256(f"{text}\x00{index}".encode()).digest()
        fraction, bits = int.from_bytes(digest, "big"), 8 * len(digest)
        characters = []
        for _ in range(self.length):  # the digest's leading digits in base len(alphabet)
            digit, fraction = divmod(fraction * len(self.alphabet), 1 << bits)
            characters.append(self.alphabet[digit])
        return self.prefix + "".join(characters)


# OpenAI's style, `call_` and 24 hex digits (the digest's first 24); Mistral's, as vLLM makes them.
OPENAI_CALL_IDS = CallIds("call_", 24, "0123456789abcdef")
MISTRAL_CALL_IDS = CallIds("", 9, string.ascii_letters + string.digits)


class MalformedCall(ValueError):
    """A call that does not parse; the message starts with "tool call N: " (1-based)."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(f"tool call {index}: {problem}")


class ArgumentsNotObject(MalformedCall):
    """A named call whose arguments are not a JSON object; `call` is the call with its
    arguments as the model wrote them."""

    def __init__(self, index: int, problem: str, call: ToolCall) -> None:
        super().__init__(index, f"arguments are not a JSON object {problem}")
        self.call = call


def quoted(text: str) -> str:
    """`text` shortened for an error message."""
    return repr(text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "...")


def json_value(text: str, index: int, what: str = "the call") -> object:
    """The JSON value `text` holds, or MalformedCall naming where the JSON breaks."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise MalformedCall(index, f"{what} is not valid JSON ({error.msg} at char {error.pos}): "
                                   f"{quoted(text.strip())}") from None
    except RecursionError:  # nested deeper than Python's recursion limit (a model stuck repeating "[")
        raise MalformedCall(index, f"{what} is nested too deeply to read") from None


def json_at(text: str, pos: int) -> tuple[object, int] | str:
    """The JSON value of the call starting at `pos` and the position after it, or why its
    JSON breaks."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as error:
        return f"the call is not valid JSON ({error.msg} at char {error.pos - pos}): {quoted(text[pos:])}"


def skip_space(text: str, pos: int) -> int:
    """The position of the first non-whitespace character of `text` at or after `pos`."""
    return _SPACE.match(text, pos).end()


def joined(pieces: list[str]) -> str:
    """The pieces of text besides the calls as one content: each stripped, one per line."""
    return "\n".join(piece.strip() for piece in pieces if piece.strip())


class AnswerReading:
    """A format's reading of an answer in the order the model wrote it: pieces of text and
    calls. A call that cannot be read (its reader raises MalformedCall, or it has no name)
    keeps its text, as written, in the content, and its problem in the calls' place."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.calls: list[object] = []

    def text(self, piece: str) -> None:
        """Text the model wrote besides the calls."""
        self.pieces.append(piece)

    def call(self, written: str, read: Callable[[int], object]) -> None:
        """The next call, `written` as the model wrote it (markers included) and read by
        `read(index)` (`index`: its 1-based number among the answer's calls)."""
        index = len(self.calls) + 1
        try:
            self.calls.append(named_call(read(index), index))
        except MalformedCall as problem:
            self.broken(written, problem)

    def broken(self, written: str, problem: MalformedCall | str) -> None:
        """A call that cannot be read: `written` stays in the content, `problem` says why."""
        index = len(self.calls) + 1
        self.calls.append(problem if isinstance(problem, MalformedCall) else MalformedCall(index, problem))
        self.pieces.append(written)

    def found(self, ids: list[str] | None = None) -> FoundCalls:
        """The reading as the checks take it (`ids`: the format's own, one per call)."""
        return FoundCalls(joined(self.pieces), self.calls, ids)


class ToolParser:
    """Finds the tool calls in a completion's answer (one format per subclass).

    `name` is the format's name (`tool_call_parser=`); `markers` are the format's marker
    strings, which a tokenizer may hold as special tokens that the user's text (decoded with
    special tokens skipped) lacks: `parse` writes them back in from `token_ids` before the
    format reads the text. `call_ids` is the style of the ids the parser gives the calls.
    Subclasses implement `find_calls`.
    """

    name: str = ""
    markers: tuple[str, ...] = ()
    call_ids: CallIds = OPENAI_CALL_IDS

    def __init__(self, tokenizer: "PreTrainedTokenizerBase | None") -> None:
        """`tokenizer`: the model's (transformers); None reads the markers from the text only."""
        self.tokenizer = tokenizer
        self._hidden_markers = self._markers_decoding_drops(tokenizer)

    def _markers_decoding_drops(self, tokenizer: "PreTrainedTokenizerBase | None") -> dict[int, str]:
        """The markers that are single tokens of the vocabulary and vanish from a decode with
        special tokens skipped, by token id."""
        if tokenizer is None:
            return {}
        found = {}
        for marker in self.markers:
            token_id = single_token_id(tokenizer, marker)
            if token_id is not None and tokenizer.decode([token_id], skip_special_tokens=True) == "":
                found[token_id] = marker
        return found

    def marked_text(self, text: str, token_ids: list[int]) -> str:
        """`text` with the markers it lost to special-token skipping written back in: the
        tokens between markers decoded as the user's text was, the markers as their strings.
        `text` itself when none of its tokens is such a marker."""
        if not any(token_id in self._hidden_markers for token_id in token_ids):
            return text
        pieces, start = [], 0
        for i, token_id in enumerate(token_ids):
            if token_id in self._hidden_markers:
                pieces.append(self.tokenizer.decode(token_ids[start:i], skip_special_tokens=True))
                pieces.append(self._hidden_markers[token_id])
                start = i + 1
        pieces.append(self.tokenizer.decode(token_ids[start:], skip_special_tokens=True))
        return "".join(pieces)

    def find_calls(self, text: str) -> FoundCalls | None:
        """The calls in `text` (markers written back in) as the model wrote them, or None when
        it holds no call; MalformedCall where a call's syntax is broken."""
        raise NotImplementedError

    def find_calls_for(self, text: str, tools: Tools) -> FoundCalls | None:
        """`find_calls` for a request that declared `tools`: formats that read the calls by
        the tools override it (qwen3_coder's typed parameters); the others ignore them."""
        return self.find_calls(text)

    def parse(self, text: str, token_ids: list[int], tools: Tools = None) -> ToolCallResult:
        """The calls in a completion's answer: `text` as decoded for the user (special tokens
        skipped), `token_ids` the same answer's tokens, `tools` the request's (None: none)."""
        marked = self.marked_text(text, token_ids)
        try:
            found = self.find_calls_for(marked, tools)
            if found is None:
                return ToolCallResult(text, None, None)
            calls, problems = self._checked(text, found)
        except MalformedCall as error:  # a format that reads its calls all or nothing
            return ToolCallResult(marked, None, str(error))
        except RecursionError:  # nested deeper than Python's recursion limit (a model stuck repeating "[")
            return ToolCallResult(marked, None, "tool calls: nested too deeply to read")
        error = "; ".join(problems) or None
        if not calls:
            return ToolCallResult(marked if error else found.content, None, error)
        return ToolCallResult(found.content, calls, error)

    def _checked(self, text: str, found: FoundCalls) -> tuple[list[ToolCall], list[str]]:
        """The calls of `found` that can be returned (those whose arguments are not a JSON
        object too, as written), and the problems of those that are wrong, by call."""
        calls, problems = [], []
        native_ids = found.ids or [None] * len(found.calls)
        for index, (call, native_id) in enumerate(zip(found.calls, native_ids), 1):
            if isinstance(call, MalformedCall):
                problems.append(str(call))
                continue
            try:
                checked = tool_call(text, index, call, self.call_ids)
            except ArgumentsNotObject as problem:
                checked = problem.call
                problems.append(str(problem))
            if native_id is not None:
                checked.id = native_id
            calls.append(checked)
        return calls, problems


def single_token_id(tokenizer: "PreTrainedTokenizerBase", token: str) -> int | None:
    """The id of `token` when the vocabulary holds it as one token, else None (without
    building the whole vocabulary, which takes a while for large ones)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
        return None
    return token_id


def named_call(call: object, index: int) -> object:
    """`call` when it names its function: a `WrittenCall` with a name, or an object with a
    non-empty string "name" (its name stripped); MalformedCall otherwise."""
    if isinstance(call, WrittenCall):
        if not call.name.strip():
            raise MalformedCall(index, f"missing a function name, got {quoted(call.arguments)}")
        return WrittenCall(call.name.strip(), call.arguments)
    if not isinstance(call, dict):
        raise MalformedCall(index, f"expected an object with \"name\" and \"arguments\", got "
                                   f"{type(call).__name__} {quoted(repr(call))}")
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        raise MalformedCall(index, f"missing a function name (a non-empty string under \"name\"), got "
                                   f"{quoted(json.dumps(call, ensure_ascii=False, default=repr))}")
    return {**call, "name": name.strip()}


def tool_call(text: str, index: int, call: object, call_ids: CallIds = OPENAI_CALL_IDS) -> ToolCall:
    """Call `index` of the answer `text` as the model wrote it, checked: a `WrittenCall`, or a
    dict with a non-empty string "name" and an object under "arguments" (or Llama's
    "parameters"; a string holding a JSON object, and a missing key or an empty string, read
    as no arguments, are accepted too); its id in the style `call_ids`. ArgumentsNotObject
    where the call is named but its arguments are not a JSON object (the call, arguments as
    written, on the exception), MalformedCall where it names no function."""
    call = named_call(call, index)
    if isinstance(call, WrittenCall):
        name, arguments = call.name, call.arguments.strip()
    else:
        name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
    call_id = call_ids.make(text, index)
    try:
        arguments_text = _object_text(arguments)
    except ValueError as problem:
        # As written: a WrittenCall's text; a JSON value as JSON (a string as a JSON string, as vLLM passes it on).
        written = arguments if isinstance(call, WrittenCall) else json.dumps(arguments, ensure_ascii=False,
                                                                             default=repr)
        raise ArgumentsNotObject(index, str(problem), ToolCall(id=call_id, function=FunctionCall(name, written))) \
            from None
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments_text))


def _object_text(arguments: object) -> str:
    """The arguments, a JSON object (or a string holding one; blank: none), as JSON text
    written one way; ValueError saying why they are not one."""
    if isinstance(arguments, str):
        if not arguments.strip():
            return "{}"
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"(not valid JSON: {error.msg} at char {error.pos}): {quoted(arguments.strip())}") \
                from None
        except RecursionError:
            raise ValueError(f"(nested too deeply to read): {quoted(arguments.strip())}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"(got {type(arguments).__name__}): "
                         f"{quoted(json.dumps(arguments, ensure_ascii=False, default=repr))}")
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"(it holds a value JSON cannot: {error}): {quoted(repr(arguments))}") from None
