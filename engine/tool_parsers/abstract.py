"""The contract of a tool-call parser: a completion's answer in, OpenAI-shaped calls out.

Each format (one module per format) finds the calls the model wrote and hands them over as
the objects the model meant, `{"name": ..., "arguments": {...}}`; this module checks them
the same way for every format (a name, arguments that are a JSON object), normalises the
arguments to JSON text written one way for every format, and gives each call an id derived
from the text, so that the same output gives the same ids (reproducible tables), in the
format's id style (`CallIds`: OpenAI's `call_...` by default, Mistral's 9 alphanumerics).

A call that does not parse never raises out of `ToolParser.parse`: the result keeps the text
as the model wrote it (markers written back in), has no calls, and says in `error` which
call is wrong and how.
"""

import hashlib
import json
import re
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.outputs import FunctionCall, ToolCall
from engine.tool_parsers.request_tools import Tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How much of a wrong piece of text an error message quotes.
_QUOTED_CHARS = 80
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCallResult:
    """What a parser found in an answer: `content`, the text the model wrote besides the
    calls (their markup removed); `tool_calls`, None when there are none; `error`, why a
    call does not parse (then `tool_calls` is None and `content` is the text as the model wrote
    it, its markers written back in)."""

    content: str
    tool_calls: list[ToolCall] | None
    error: str | None


@dataclass(frozen=True)
class FoundCalls:
    """A format's reading of an answer before the checks: the text besides the calls and
    each call as the model wrote it (a JSON value or a dict built from the markup)."""

    content: str
    calls: list[object]
    ids: list[str] | None = None  # the format's own call ids, one per call (None: derived from the text)


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


def skip_space(text: str, pos: int) -> int:
    """The position of the first non-whitespace character of `text` at or after `pos`."""
    return _SPACE.match(text, pos).end()


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
            calls = [tool_call(text, index, call, self.call_ids) for index, call in enumerate(found.calls, 1)]
            for call, native_id in zip(calls, found.ids or ()):
                call.id = native_id
        except MalformedCall as error:
            return ToolCallResult(marked, None, str(error))
        except RecursionError:  # JSON nested deeper than Python's recursion limit (a model stuck repeating "[")
            return ToolCallResult(marked, None, "tool calls: nested too deeply to read")
        return ToolCallResult(found.content, calls or None, None)


def single_token_id(tokenizer: "PreTrainedTokenizerBase", token: str) -> int | None:
    """The id of `token` when the vocabulary holds it as one token, else None (without
    building the whole vocabulary, which takes a while for large ones)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
        return None
    return token_id


def tool_call(text: str, index: int, call: object, call_ids: CallIds = OPENAI_CALL_IDS) -> ToolCall:
    """Call `index` of the answer `text` as the model wrote it, checked: a dict with a
    non-empty string "name" and an object under "arguments" (or Llama's "parameters"; a
    string holding a JSON object, and a missing key or an empty string, read as no arguments,
    are accepted too); its id in the style `call_ids`."""
    if not isinstance(call, dict):
        raise MalformedCall(index, f"expected an object with \"name\" and \"arguments\", got "
                                   f"{type(call).__name__} {quoted(repr(call))}")
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        raise MalformedCall(index, f"missing a function name (a non-empty string under \"name\"), got "
                                   f"{quoted(json.dumps(call, ensure_ascii=False, default=repr))}")
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json_value(arguments, index, "the arguments string") if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise MalformedCall(index, f"arguments are not a JSON object: got {type(arguments).__name__} "
                                   f"{quoted(repr(arguments))}")
    try:
        arguments_text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise MalformedCall(index, f"arguments are not JSON ({error}): {quoted(repr(arguments))}") from None
    return ToolCall(id=call_ids.make(text, index), function=FunctionCall(name=name.strip(), arguments=arguments_text))
