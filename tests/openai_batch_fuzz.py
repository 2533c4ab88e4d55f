"""Hostile OpenAI batch input files for the property-based tests of the batch boundary
(`engine.entrypoints.openai.batch`'s line and body checks, `python -m engine.run_batch`, the Dagster
request table): random JSON lines, and lines built to be almost valid (the right envelope
with wrong types, missing or extra fields, a wrong url, a repeated custom_id, a body that is
not an object, huge numbers, NaN, lone surrogates, any Unicode), lines nested too deeply, torn
lines, bytes that are not UTF-8 and blank lines, with well-formed lines among them whose answers
must come.

A drawn `BatchFile` holds the file's bytes and where its good lines are; `check_line_error`
is the property every error of a line must have, whichever layer gives it."""

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from engine.entrypoints.openai.protocol import (
    CHAT_URL, COMPLETIONS_URL, DUPLICATE_CUSTOM_ID, EMBEDDINGS_URL, INVALID_JSON, INVALID_LINE, INVALID_REQUEST,
    MAX_DEPTH, UNSUPPORTED_FIELD, UNSUPPORTED_URL, URLS, LineError,
)
from engine.entrypoints.openai.serving import IGNORED_FIELDS, KNOWN_FIELDS, NO_OP_FIELDS

CODES = {INVALID_JSON, INVALID_LINE, DUPLICATE_CUSTOM_ID, UNSUPPORTED_URL, INVALID_REQUEST, UNSUPPORTED_FIELD}
# The place an error names first: a field (a path such as messages[0].content or prompt[1], several joined
# by ", ", or a JSON string where a name is no identifier), or, for a line that is no JSON object, the line itself.
_NAME = r'(?:[A-Za-z_]\w*|"(?:[^"\\]|\\.)*")'
_FIELD = rf"{_NAME}(?:\.{_NAME}|\[\d+\])*"
NAMED = re.compile(rf"^{_FIELD}(?:, {_FIELD})*: \S")
LINE_ITSELF = ("is not JSON (", "is not UTF-8 text (", "expected a JSON object", "is nested more than")
# A place a message names before its reason: a field path, "message 0", "prompt[1]".
_PLACE = re.compile(r"^[A-Za-z_][\w.\[\] ]{0,40}$")


def mostly(usual: st.SearchStrategy, other: st.SearchStrategy, every: int = 4) -> st.SearchStrategy:
    """`usual`, but one draw in `every` from `other` (Hypothesis' `a | b` draws each half the time)."""
    return st.integers(1, every).flatmap(lambda i: usual if i > 1 else other)


# Any character, now and then a lone surrogate (JSON's "\ud800" escape reads back as one).
TEXT = st.text(mostly(st.characters(), st.characters(categories=["Cs"]), every=200), max_size=12)
# Text a good line carries: valid Unicode, not blank (a completion of "" is refused).
GOOD_TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=24).filter(str.strip)
NUMBERS = (st.integers(-3, 20) | st.integers() | st.integers(-(10 ** 40), 10 ** 40) | st.floats()
           | st.sampled_from([0.0, -0.0, 1e308, 1e-320, 2 ** 63, -(2 ** 63) - 1]))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(TEXT, inner, max_size=4), max_leaves=10)

_MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant", "tool", "developer"]), TEXT | JSON_VALUES),
     "content": mostly(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text") | TEXT, "text": TEXT | SCALARS}),
                                      max_size=3) | JSON_VALUES)},
    optional={"name": TEXT, "tool_calls": JSON_VALUES, "tool_call_id": TEXT})
_PROMPTS = (TEXT | st.lists(TEXT, max_size=3) | st.lists(st.integers(-2, 400), max_size=5)
            | st.lists(st.lists(st.integers(-2, 400), max_size=4), max_size=3))
_TOOL = st.fixed_dictionaries({"type": st.just("function") | TEXT, "function": st.fixed_dictionaries(
    {"name": TEXT}, optional={"parameters": JSON_VALUES, "description": TEXT}) | JSON_VALUES})
_KINDS = st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"]) | TEXT
# Values near what each field takes (right shape, wrong type, out of range); any field may also get any value.
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "messages": st.lists(_MESSAGE, max_size=3),
    "prompt": _PROMPTS, "input": _PROMPTS,
    "stop": TEXT | st.lists(TEXT, max_size=3),
    "logit_bias": st.dictionaries(TEXT | st.integers(-5, 400).map(str), NUMBERS, max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, 400) | NUMBERS, max_size=3),
    "allowed_token_ids": st.lists(st.integers(-2, 400), max_size=3),
    "bad_words": st.lists(TEXT, max_size=3),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"]) | TEXT},
                                             optional={"json_schema": JSON_VALUES}),
    "structured_outputs": st.dictionaries(_KINDS, JSON_VALUES, max_size=2),
    "guided_json": JSON_VALUES, "guided_choice": st.lists(TEXT, max_size=3),
    "tools": st.lists(_TOOL, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON_VALUES,
    "chat_template_kwargs": st.dictionaries(TEXT, SCALARS, max_size=2),
    "encoding_format": st.sampled_from(["float", "base64", "int8"]),
    **{name: st.sampled_from([*field.values, None]) for name, field in NO_OP_FIELDS.items()},
}


def field_values(name: str) -> st.SearchStrategy:
    """What a drawn body puts under `name`: mostly a value near its own (a number or a flag
    for the fields that have none here), else any JSON value."""
    return mostly(PLAUSIBLE.get(name, NUMBERS | st.booleans()), JSON_VALUES)


@st.composite
def bodies(draw: st.DrawFn, url: str) -> dict[str, Any]:
    """A request body for `url`: usually its prompt field and some of its own fields (at
    values near theirs or any), sometimes another url's field or one no API has."""
    own = sorted(KNOWN_FIELDS[url] | IGNORED_FIELDS | {n for n, f in NO_OP_FIELDS.items() if url in f.urls})
    body = {}
    if draw(st.integers(0, 9)):
        prompt_field = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt", EMBEDDINGS_URL: "input"}[url]
        body[prompt_field] = draw(field_values(prompt_field))
    for name in draw(st.lists(st.sampled_from(own), max_size=4, unique=True)):
        body[name] = draw(field_values(name))
    if not draw(st.integers(0, 5)):
        name = draw(st.sampled_from(sorted(set().union(*KNOWN_FIELDS.values(), NO_OP_FIELDS))) | TEXT)
        body[name] = draw(field_values(name) if isinstance(name, str) else JSON_VALUES)
    return body


@st.composite
def almost_valid_lines(draw: st.DrawFn, ids: list[str]) -> Any:
    """A well-formed envelope around a drawn body (its own url's fields mostly, any value
    anywhere), half the time with its envelope broken too: a custom_id missing, of the
    wrong type or repeating one of `ids`, another method, a wrong url, no body, a body
    that is not an object, an extra field."""
    url = draw(st.sampled_from(URLS))
    line: dict[str, Any] = {"custom_id": draw(st.sampled_from(ids) | st.text(min_size=1, max_size=8)),
                            "method": "POST", "url": url, "body": draw(bodies(url))}
    if draw(st.booleans()):
        del line["method"]
    for part in draw(st.lists(st.sampled_from(["custom_id", "method", "url", "body", "extra"]), max_size=2)):
        if part == "extra":
            line[draw(TEXT)] = draw(JSON_VALUES)
        elif not draw(st.integers(0, 3)):
            line.pop(part, None)
        else:
            line[part] = draw(_BROKEN[part])
    return line


# What a broken envelope holds instead of each part.
_BROKEN = {"custom_id": TEXT | JSON_VALUES, "method": st.sampled_from(["GET", "post"]) | JSON_VALUES,
           "url": st.sampled_from(["/v1/moderations", "v1/completions", "/V1/EMBEDDINGS", ""]) | JSON_VALUES,
           "body": JSON_VALUES}


@st.composite
def deep_lines(draw: st.DrawFn) -> bytes:
    """Lists or objects nested just within MAX_DEPTH, just past it, or past where Python's
    JSON parser gives out: as the whole line, or under a field of an otherwise good line."""
    depth = draw(st.sampled_from([MAX_DEPTH - 2, MAX_DEPTH + 1, 990, 5000]))
    value = draw(st.sampled_from(["[" * depth + "]" * depth, '{"a": ' * depth + "1" + "}" * depth]))
    if draw(st.booleans()):
        return value.encode()
    url, name = draw(st.sampled_from(URLS)), draw(st.sampled_from(["stop", "metadata", "input", "messages"]))
    return (f'{{"custom_id": {json.dumps(draw(st.text(min_size=1, max_size=4)))}, "url": "{url}", '
            f'"body": {{"{name}": {value}}}}}').encode()


@st.composite
def good_lines(draw: st.DrawFn, custom_id: str) -> dict[str, Any]:
    """A line every layer must answer: a short greedy chat or completion, or an embedding,
    maybe with fields taken at their no-op values and ignored ones."""
    url, text = draw(st.sampled_from(URLS)), draw(GOOD_TEXT)
    body: dict[str, Any] = {
        CHAT_URL: {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0},
        COMPLETIONS_URL: {"prompt": text, "max_tokens": 2, "temperature": 0},
        EMBEDDINGS_URL: {"input": text}}[url]
    for name in draw(st.lists(st.sampled_from(sorted(NO_OP_FIELDS)), max_size=2, unique=True)):
        if url in NO_OP_FIELDS[name].urls:
            body[name] = draw(st.sampled_from([*NO_OP_FIELDS[name].values, None]))
    for name in draw(st.lists(st.sampled_from(sorted(IGNORED_FIELDS)), max_size=2, unique=True)):
        body[name] = draw(JSON_VALUES)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@st.composite
def encoded(draw: st.DrawFn, value: Any) -> bytes:
    """A JSON value as one line of bytes: escaped or raw Unicode (a lone surrogate raw is
    not UTF-8), sometimes padded, cut short (a torn line) or with a byte UTF-8 never has."""
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    data = text.encode("utf-8", "surrogatepass")
    form = draw(st.sampled_from(["whole"] * 6 + ["padded", "torn", "bad byte"]))
    if form == "padded":
        return b" \t" + data + b"  "
    if form == "torn":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if form == "bad byte":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + data[at:]
    return data


@dataclass
class BatchFile:
    """A drawn input file: its bytes, and the custom_id of each good line by its line
    number (1-based, as the runner counts them)."""

    data: bytes
    good: dict[int, str] = field(default_factory=dict)

    @property
    def lines(self) -> list[bytes]:
        """The file's lines, as `read_batch_file` splits them."""
        return self.data.splitlines()

    @property
    def numbers(self) -> list[int]:
        """The numbers of the lines that are not blank: each has one output line."""
        return [n for n, raw in enumerate(self.lines, 1) if raw.strip()]


@st.composite
def batch_files(draw: st.DrawFn, max_lines: int = 8) -> BatchFile:
    """A file of good lines among random JSON lines, almost valid ones, raw bytes and blank
    lines, joined by "\\n" or "\\r\\n"."""
    count = draw(st.integers(1, max_lines))
    ids = [f"good-{i}" for i in range(count)] + ["a", "b"]
    lines, good = [], {}
    for i in range(count):
        kind = draw(st.sampled_from(["good", "good", "almost", "almost", "almost", "almost", "json", "bytes",
                                     "blank", "deep"]))
        if kind == "good":
            line = draw(good_lines(f"good-{i}"))
            try:
                lines.append(json.dumps(line, ensure_ascii=draw(st.booleans())).encode())
            except UnicodeEncodeError:  # a lone surrogate in an ignored field: written as its escape
                lines.append(json.dumps(line).encode())
            good[len(lines)] = f"good-{i}"
        elif kind == "almost":
            lines.append(draw(encoded(draw(almost_valid_lines(ids)))))
        elif kind == "json":
            lines.append(draw(encoded(draw(JSON_VALUES))))
        elif kind == "deep":
            lines.append(draw(deep_lines()))
        elif kind == "bytes":
            lines.append(draw(st.binary(max_size=40)).replace(b"\n", b"").replace(b"\r", b""))
        else:
            lines.append(draw(st.sampled_from([b"", b"   ", b"\t"])))
    return BatchFile(draw(st.sampled_from([b"\n", b"\r\n"])).join(lines) + b"\n", good)


def named_twice(message: str) -> str | None:
    """The field a "field: reason" message names twice in a row in the places it names
    first ("messages: messages: ...", "guided_json: json: ...", "prompt[1]: prompt: ..."),
    or None."""
    parts = message.split(": ")
    places = list(itertools.takewhile(_PLACE.match, parts))
    return next((b for a, b in zip(places, places[1:]) if b in re.split(r"[\s\[\]._]+", a)), None)


def check_line_error(where: str, error: LineError, message: str) -> None:
    """What every error of a line must be: a known code, the `message` as written (the
    layer's `where` in front, "line 7"), valid UTF-8 (it goes to a UTF-8 file or Parquet),
    one line, naming the field first (or the line itself, for a line that is not a JSON
    object), never the same field twice in a row."""
    assert error.code in CODES, error
    assert message.startswith(where) and "\n" not in message, (where, message)
    message.encode("utf-8")
    assert NAMED.match(error.message) or (error.code == INVALID_JSON and error.message.startswith(LINE_ITSELF)), error
    assert named_twice(error.message) is None, error
