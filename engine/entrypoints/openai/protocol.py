"""The OpenAI Batch API file format, as vLLM's `vllm/entrypoints/openai/protocol.py` holds its API's
request and response types: what an input line is (`BatchLine`, or the `BadLine` that does not run,
with its `LineError`), how a line is read and checked as an envelope (`parse_line`, `parse_lines`,
`nesting_problem`), the engine inputs a body becomes (`GenerationRequest`, `EmbeddingRequest`), and
the output lines written back (`response_line`, `error_line`, `jsonl_line`).

The bodies themselves are turned into engine inputs and back in `engine.entrypoints.openai.serving`;
a whole file is run by `engine.entrypoints.openai.batch`. Importing this module loads neither torch
nor the model code.
"""

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.chat_utils import invalid_unicode_problem
from engine.entrypoints.tool_choice import ToolChoice
from engine.sampling_params import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)

# The body field that holds a url's prompts (one per element of a list), which the engine calls "prompt".
PROMPT_FIELDS = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt", EMBEDDINGS_URL: "input"}

# The `error.code` of an output line that did not run.
INVALID_JSON = "invalid_json"  # the line is not a JSON object (or not UTF-8)
INVALID_LINE = "invalid_line"  # custom_id, method or body missing or of the wrong type
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"  # an earlier line has the same custom_id
UNSUPPORTED_URL = "unsupported_url"  # a url other than URLS, or one the loaded model cannot serve
INVALID_REQUEST = "invalid_request"  # the body: an unknown field, a bad value, a prompt the engine refuses
UNSUPPORTED_FIELD = "unsupported_field"  # a documented field this runner cannot honour

# The deepest nesting of lists and objects a line may have: far more than a request body needs (a JSON schema
# included), far less than where Python's recursion (json, repr) gives out.
MAX_DEPTH = 100


@dataclass(frozen=True)
class LineError:
    """Why a line or a body does not run: an `error.code` and the message, "field: reason
    and fix" (the runner adds "line N: " in front). A lone surrogate the message quotes from
    the line is escaped: the message is written to a UTF-8 file or a Parquet table."""

    code: str
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", self.message.encode("utf-8", "backslashreplace").decode("utf-8"))


@dataclass(frozen=True)
class BatchLine:
    """An input line whose envelope is well formed: its 1-based number in the file, its
    custom_id, url (one of URLS) and request body."""

    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    """An input line that does not run, found before any model loads; `custom_id` is None
    when the line has no usable one."""

    number: int
    custom_id: str | None
    error: LineError


@dataclass
class GenerationRequest:
    """A chat or completion body as engine inputs: its prompts (one for a chat, one or more
    for a completion), the SamplingParams they share, their scheduling priority and the
    chat's tool choice (a forced one's grammar is in the SamplingParams)."""

    url: str
    prompts: list[dict[str, Any]]
    sampling_params: SamplingParams
    priority: int = 0
    tool_choice: ToolChoice = ToolChoice()


@dataclass
class EmbeddingRequest:
    """An embeddings body as engine inputs: one prompt per input (a string or
    {"prompt_token_ids": [...]}) and how the vectors are written ("float" or "base64")."""

    prompts: list[str | dict[str, Any]]
    encoding_format: str = "float"


def shown_value(value: Any) -> str:
    """A body value as an error message quotes it: its JSON, cut at 80 characters."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def field_label(name: Any) -> str:
    """A field's name as a message names it: as it is when it is a plain name, else as its
    JSON string ("", a name with spaces, a colon or control characters stays readable)."""
    return name if isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else shown_value(name)


# ---------------------------------------------------------------------------------------------
# Input lines


def parse_line(text: str, number: int) -> BatchLine | BadLine:
    """One input line, {"custom_id", "method": "POST", "url", "body"}, checked as an envelope
    (the body is checked when its model is loaded)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(number, None, LineError(
            INVALID_JSON, f"is not JSON ({exc.msg} at column {exc.colno}): write one JSON object per line"))
    except RecursionError:  # nested deeper than Python's parser goes
        return BadLine(number, None, LineError(INVALID_JSON, too_deep_problem()))
    if (problem := nesting_problem(data)) is not None:  # before anything recurses into it (repr, json.dumps)
        named = data.get("custom_id") if isinstance(data, dict) else None
        custom_id = named if isinstance(named, str) and named and invalid_unicode_problem(named) is None else None
        return BadLine(number, custom_id, LineError(INVALID_JSON if problem.startswith("is ") else INVALID_LINE,
                                                    problem))
    if not isinstance(data, dict):
        return BadLine(number, None, LineError(
            INVALID_JSON, f"expected a JSON object {{custom_id, method, url, body}}, got {type(data).__name__}"))
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(number, None, LineError(
            INVALID_LINE, f"custom_id: expected a non-empty string, got {custom_id!r:.80}: give each line a unique id"))
    if (problem := invalid_unicode_problem(custom_id, "custom_id")) is not None:  # it could not be written back
        return BadLine(number, None, LineError(INVALID_LINE, problem))
    url, method, body = data.get("url"), data.get("method", "POST"), data.get("body")
    if method != "POST":
        return BadLine(number, custom_id, LineError(INVALID_LINE, f"method: must be 'POST', got {method!r:.80}"))
    if url not in URLS:
        return BadLine(number, custom_id, LineError(
            UNSUPPORTED_URL, f"url: {url!r:.80} is not supported: use one of {', '.join(URLS)}"))
    if not isinstance(body, dict):
        return BadLine(number, custom_id, LineError(
            INVALID_LINE, f"body: expected the request as a JSON object, got {type(body).__name__}"))
    return BatchLine(number, custom_id, url, body)


def too_deep_problem(where: str = "") -> str:
    """The problem of a value nested past MAX_DEPTH, under the field `where` ("": the line)."""
    subject = f"{where}: is" if where else "is"
    return f"{subject} nested more than {MAX_DEPTH} levels deep: flatten it (a request body needs a few levels)"


def nesting_problem(value: Any) -> str | None:
    """Why a decoded line is nested too deeply to handle (over MAX_DEPTH levels of lists
    and objects, where Python's own recursion in repr and json gives out), naming the field
    it is under ("body.stop: ...", "is nested ..." for the line itself), or None."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            return too_deep_problem(path)
        if isinstance(item, dict):  # the path names the first two levels under the line's object
            stack.extend((child, depth + 1, f"{path}.{field_label(key)}".lstrip(".") if depth < 2 else path)
                         for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, depth + 1, f"{path}[{i}]" if path and depth < 2 else path)
                         for i, child in enumerate(item))
    return None


def parse_lines(raw_lines: Iterable[bytes]) -> list[BatchLine | BadLine]:
    """Every non-blank line of an input file, numbered from 1; a custom_id seen on an earlier
    line makes the later line a `BadLine` (its first line still runs)."""
    parsed: list[BatchLine | BadLine] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            line = parse_line(raw.decode("utf-8"), number)
        except UnicodeDecodeError as exc:
            line = BadLine(number, None, LineError(INVALID_JSON, f"is not UTF-8 text ({exc}): fix its encoding"))
        if line.custom_id is not None and line.custom_id in first_line:
            line = BadLine(number, line.custom_id, LineError(
                DUPLICATE_CUSTOM_ID, f"custom_id: {line.custom_id!r} is also the id of line "
                                     f"{first_line[line.custom_id]}: give each line its own id"))
        elif line.custom_id is not None:
            first_line[line.custom_id] = number
        parsed.append(line)
    return parsed


# ---------------------------------------------------------------------------------------------
# Output lines


def response_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """An output line of a request that ran."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}, "error": None}


def error_line(number: int, custom_id: str | None, error: LineError) -> dict[str, Any]:
    """An output line of a line that did not run; `error.line` is its input line number
    (as in OpenAI's batch errors), which resume reads."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": error.code, "message": f"line {number}: {error.message}", "line": number}}


def jsonl_line(record: dict[str, Any]) -> str:
    """A record as one JSONL line: Unicode as it is, but the characters that Python's
    str.splitlines() also ends a line at (U+0085, U+2028, U+2029; JSON escapes the control
    ones) written as escapes, so that a reader splitting the text finds whole records."""
    return json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"


_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\u0085\u2028\u2029"}
