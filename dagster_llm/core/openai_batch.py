"""OpenAI Batch API request tables, free of Dagster: the lines of a batch file as table rows
(`custom_id`, `url`, `body`), checked as `engine.entrypoints.openai.protocol` checks a file's lines; the
chat and completion rows of every partition of a run in one engine call, then the
embedding rows in another; and each partition's output table, one row per input row in
input order, built from the response bodies `python -m engine.run_batch` writes.

A bad row never raises: it becomes an error row with OpenAI's error code and a message
naming the row, the field and the fix, and the other rows run.
"""

import base64
import json
import math
import numbers
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa

from dagster_llm.core.checks import CheckOutcome
from dagster_llm.core.engine_surface import (
    CHAT_URL, DUPLICATE_CUSTOM_ID, INVALID_JSON, INVALID_LINE, UNSUPPORTED_URL, BadLine, BatchLine, LineError,
    first_set, invalid_unicode_problem, line_task, nesting_problem, parse_line, run_lines, too_deep_problem,
)
from dagster_llm.core.generation import digest
from dagster_llm.core.partition_run import (
    CommittedPartition, OpenPartition, PartitionCounts, PartitionRows, PartitionRun, PendingRow,
)
from dagster_llm.core.prompts import missing_cell
from dagster_llm.core.schema import TOOL_CALLS_TYPE

if TYPE_CHECKING:
    from dagster_llm.core.engine_surface import LLM

# The request table's columns: `url` and `method` may be left out (every row POSTs to CHAT_URL);
# `line` (the row's line number in its file, which read_openai_batch_file adds) is used in messages.
REQUIRED_COLUMNS = ("custom_id", "body")
DEFAULT_URL = CHAT_URL

COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "custom_id": (pa.string(), "The row's custom_id, from the request table (null where it is not a non-empty "
                               "string)."),
    "url": (pa.string(), "The endpoint the row asked for: /v1/chat/completions, /v1/completions or /v1/embeddings "
                         "(as given; null where it was not a string)."),
    "status_code": (pa.int32(), "200 for a row that ran; null for an error row."),
    "response": (pa.string(), "The OpenAI response body as JSON text, as `python -m engine.run_batch` writes it in "
                              "its output line's response.body; null for an error row."),
    "error_code": (pa.string(), "OpenAI's error code of a row that did not run: invalid_json, invalid_line, "
                                "duplicate_custom_id, unsupported_url, invalid_request or unsupported_field; null "
                                "for a row that ran."),
    "error_message": (pa.string(), "Why the row did not run: where it is (line N of its file, or row N of the table "
                                   "counted from 0, and its custom_id), the field, the reason and the fix."),
    "content": (pa.string(), "The first choice's message content (chat) or text (completion); null for embedding "
                             "and error rows, and for a chat answer that only calls tools."),
    "reasoning": (pa.string(), "The first choice's reasoning (the message's `reasoning`, or the "
                               "`reasoning_content` of earlier versions and other tools), with the engine's "
                               "reasoning parser on a reasoning model; null otherwise."),
    "tool_calls": (TOOL_CALLS_TYPE, "The first choice's tool calls: each call's id, function name and arguments (a "
                                    "JSON object's text), in order; null where it made none."),
    "finish_reason": (pa.string(), "The first choice's finish_reason: 'stop', 'length' or 'tool_calls'."),
    "prompt_tokens": (pa.int32(), "usage.prompt_tokens: tokens of every prompt (or input) of the row."),
    "completion_tokens": (pa.int32(), "usage.completion_tokens: tokens generated over every choice; null for "
                                      "embedding rows."),
    "embedding": (pa.list_(pa.float32()), "The first input's vector as float32, whatever the encoding_format (every "
                                          "input's is in response); null for other rows."),
    "model": (pa.string(), "The model that answered, as the response reports it (the resource's model_id); null for "
                           "an error row."),
}
OUTPUT_SCHEMA = pa.schema([pa.field(name, kind) for name, (kind, _) in COLUMNS.items()])

ERROR_CHECK = "no_error_rows"
ERROR_CHECK_DESCRIPTION = ("Rows that did not run (error_code set): malformed rows, bodies the engine refuses, "
                           "embedding rows without an embedding resource. Fails above max_error_fraction of the "
                           "rows; the first errors are in its metadata.")
FIRST_ERRORS = 5

NO_EMBEDDER = ("url: /v1/embeddings rows need an embedding model, and this asset has none: pass "
               "embedding_resource_key= to build_openai_batch_asset and give that resource LLMResource("
               "runner='pooling') or an embedding model")
_FIX = {"generate": "give it a generative model", "embed": "give it runner='pooling' or an embedding model"}


class RequestTableError(ValueError):
    """A request table that cannot be read as a whole (a missing column)."""


def read_openai_batch_file(path_or_url: str) -> pd.DataFrame:
    """The lines of an OpenAI batch input file (JSONL) as a request table: `custom_id`,
    `method`, `url`, `body` (the request body's JSON text, which a Parquet file stores
    whatever its fields) and `line` (the line number, which error messages cite). A local
    path or an fsspec URL (`s3://bucket/requests.jsonl`, with the filesystem's package).

    Blank lines are skipped; a line that is not a JSON object keeps its text in `body` and
    becomes an error row downstream, as in `run_batch`.

    Raises:
        OSError: the file cannot be read; the message names it.
    """
    import fsspec

    try:
        with fsspec.open(path_or_url, "rb") as stream:
            raw_lines = stream.read().splitlines()
    except (OSError, ValueError, ImportError) as exc:  # ImportError: the URL's filesystem is not installed
        raise OSError(f"OpenAI batch file {path_or_url}: cannot be read ({type(exc).__name__}: {exc})") from exc
    rows = [_file_row(raw, number) for number, raw in enumerate(raw_lines, 1) if raw.strip()]
    texts = {name: pd.Series([row[name] for row in rows], dtype=object)  # None stays None, not NaN
             for name in ("custom_id", "method", "url", "body")}
    return pd.DataFrame({**texts, "line": pd.Series([row["line"] for row in rows], dtype="int64")})


def _file_row(raw: bytes, number: int) -> dict[str, Any]:
    """One line as a table row that Parquet stores (valid UTF-8 in every cell). Envelope
    values other than a string of valid Unicode stay visible as their JSON text, escaped (a
    custom_id is dropped instead: as text it would pass); the body is its JSON text, escaped
    where it holds a lone surrogate. A line that is not a JSON object, or nested past
    MAX_DEPTH, keeps its text as the body, which the row's check then refuses."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError included; RecursionError: nested too deeply
        data = None
    if not isinstance(data, dict) or nesting_problem(data) is not None:
        return {"custom_id": None, "method": None, "url": None, "body": raw.decode("utf-8", "replace"),
                "line": number}

    def text(name: str) -> str | None:
        value = data.get(name)
        return value if value is None or _storable(value) else json.dumps(value)

    custom_id, body = data.get("custom_id"), data.get("body")
    body_text = None if body is None else json.dumps(body, ensure_ascii=False)
    return {"custom_id": custom_id if _storable(custom_id) else None, "method": text("method"), "url": text("url"),
            "body": body_text if body_text is None or _storable(body_text) else json.dumps(body), "line": number}


def _storable(value: Any) -> bool:
    """Whether `value` is text a Parquet string column holds as it is (valid Unicode)."""
    return isinstance(value, str) and invalid_unicode_problem(value) is None


@dataclass(frozen=True)
class TableRow:
    """One row of a request table, checked: its position in the partition, where messages
    say it is ("line 7" of its file, or "row 3" of the table), its custom_id (None where it
    is not a non-empty string) and url as given, and the line to run or why it does not run."""

    position: int
    where: str
    custom_id: str | None
    url: str | None
    line: BatchLine | None
    error: LineError | None

    def message(self, error: LineError) -> str:
        """An error's message with the row in front: "line 7 (custom_id 'q1'): field: reason and fix"."""
        named = f" (custom_id {self.custom_id!r})" if self.custom_id else ""
        return f"{self.where}{named}: {error.message}"


def table_rows(frame: pd.DataFrame, where: str = "") -> list[TableRow]:
    """Every row of a partition's request table, checked as `run_batch` checks a file's
    lines (`engine.entrypoints.openai.protocol.parse_line`): custom_id, method, url and body; a body given
    as text must be JSON. A custom_id seen in an earlier row makes the row an error (the
    first one runs).

    Raises:
        RequestTableError: the table lacks the custom_id or body column.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise RequestTableError(f"the request table {where}has no column {missing[0]!r} (it has "
                                f"{list(frame.columns)}): give it a batch file's custom_id, url and body (each "
                                "line's request body, or its JSON text); read_openai_batch_file makes one")
    rows: list[TableRow] = []
    first: dict[str, TableRow] = {}
    for position, record in enumerate(frame.to_dict("records")):
        row = _checked_row(position, record, has_url="url" in frame.columns)
        if row.custom_id is not None and row.custom_id in first:
            row = replace(row, line=None, error=LineError(
                DUPLICATE_CUSTOM_ID, f"custom_id: {row.custom_id!r} is also the id of {first[row.custom_id].where}: "
                                     "give each row its own id"))
        elif row.custom_id is not None:
            first[row.custom_id] = row
        rows.append(row)
    return rows


def _checked_row(position: int, record: dict[str, Any], has_url: bool) -> TableRow:
    """One row: its body's JSON text parsed, then its envelope checked by `parse_line`
    (custom_id, method, url, body); a missing cell (None, NaN, pandas' NA) is None."""
    cells = {name: None if missing_cell(value) else value for name, value in record.items()}
    line_number = cells.get("line")
    numbered = (isinstance(line_number, numbers.Real) and not isinstance(line_number, bool)
                and math.isfinite(line_number))
    where = f"line {int(line_number)}" if numbered else f"row {position}"
    method = cells.get("method")
    url = cells["url"] if has_url else DEFAULT_URL
    body, body_error = _body(cells["body"])
    envelope = {"custom_id": cells["custom_id"], "url": url, "body": {} if body_error else body,
                **({"method": method} if method is not None else {})}
    text, cell_error = _envelope_text(envelope)
    body_error = body_error or cell_error
    parsed = parse_line(text, position + 1)
    row = TableRow(position, where, parsed.custom_id, url if isinstance(url, str) else None, None, None)
    if body_error is not None:  # first: a line that is not JSON at all (read_openai_batch_file) says so
        return replace(row, error=body_error)
    if isinstance(parsed, BadLine):
        return replace(row, error=parsed.error)
    return replace(row, line=parsed)


def _envelope_text(envelope: dict[str, Any]) -> tuple[str, LineError | None]:
    """The row's envelope as the JSON line `parse_line` reads; where a cell is no JSON value
    (a key that is not text, a cycle, nesting past Python's recursion), the envelope with
    its text cells only and an empty body, and the error naming that cell."""
    try:
        return json.dumps(envelope, default=_plain, ensure_ascii=False), None
    except (TypeError, ValueError, RecursionError):
        pass
    error = None
    for name, value in envelope.items():
        try:
            json.dumps(value, default=_plain)
        except (TypeError, ValueError, RecursionError) as exc:
            error = LineError(INVALID_LINE, f"{name}: cannot be written as JSON ({type(exc).__name__}: {exc}): give "
                                            "it as JSON values (objects with text keys, lists, text, numbers)")
            break
    text_cells = {name: value if isinstance(value, str) else None for name, value in envelope.items()}
    return json.dumps({**text_cells, "body": {}}, ensure_ascii=False), error


def _body(value: Any) -> tuple[Any, LineError | None]:
    """A body cell as the request body: a dict as it is, text parsed as JSON; nested no
    deeper than engine.entrypoints.openai.protocol.MAX_DEPTH."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            reason = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
            return None, LineError(INVALID_JSON, f"body: is not JSON ({reason}): give the request body as an object, "
                                                 "or its JSON text")
        except RecursionError:  # nested past Python's parser, so past MAX_DEPTH
            return None, LineError(INVALID_JSON, too_deep_problem("body"))
    if (problem := nesting_problem({"body": value})) is not None:
        return None, LineError(INVALID_JSON, problem)
    return value, None


def _plain(value: Any) -> Any:
    """What a body read back from Parquet may hold besides JSON types: numpy arrays and scalars."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


# ---------------------------------------------------------------------------------------------
# Response bodies -> the table's columns


def response_columns(body: dict[str, Any]) -> dict[str, Any]:
    """The convenience columns of a response body (chat.completion, text_completion or an
    embeddings list): the first choice's content, reasoning, tool calls and finish reason,
    the usage, the first input's vector, the model."""
    usage = body.get("usage") or {}
    columns: dict[str, Any] = {"prompt_tokens": usage.get("prompt_tokens"),
                               "completion_tokens": usage.get("completion_tokens"), "model": body.get("model")}
    if body.get("object") == "list":
        vector = body["data"][0]["embedding"] if body.get("data") else None
        columns["embedding"] = _decoded(vector) if isinstance(vector, str) else vector
        return columns
    first = body["choices"][0] if body.get("choices") else {}
    message = first.get("message") or {}
    calls = message.get("tool_calls") or None
    columns.update(
        content=message.get("content") if "message" in first else first.get("text"),
        reasoning=first_set(message, "reasoning", "reasoning_content"), finish_reason=first.get("finish_reason"),
        tool_calls=calls and [{"id": c.get("id"), "name": c["function"].get("name"),
                               "arguments": c["function"].get("arguments")} for c in calls])
    return columns


def _decoded(text: str) -> list[float]:
    """A base64 embedding (little-endian float32) as floats."""
    data = base64.b64decode(text)
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def response_record(row: TableRow, body: dict[str, Any]) -> dict[str, Any]:
    """The output row of a row that ran."""
    return {"custom_id": row.custom_id, "url": row.url, "status_code": 200,
            "response": json.dumps(body, ensure_ascii=False), **response_columns(body)}


def error_record(row: TableRow, error: LineError) -> dict[str, Any]:
    """The output row of a row that did not run."""
    return {"custom_id": row.custom_id, "url": row.url, "error_code": error.code, "error_message": row.message(error)}


def evaluate_errors(table: pa.Table, max_error_fraction: float) -> CheckOutcome:
    """The error-rows check of one partition's output table: passes while the share of
    error rows is at most `max_error_fraction`; its metadata holds the first errors."""
    rows = table.num_rows
    failed = table.filter(table["error_code"].is_valid()) if rows else table
    fraction = failed.num_rows / rows if rows else 0.0
    first = [{"custom_id": r["custom_id"], "code": r["error_code"], "message": r["error_message"]}
             for r in failed.slice(0, FIRST_ERRORS).to_pylist()]
    return CheckOutcome(fraction <= max_error_fraction, {
        "error_rows": failed.num_rows, "rows": rows, "error_fraction": round(fraction, 4),
        "max_error_fraction": max_error_fraction, "first_errors": first})


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Engine:
    """A model a run loads only when some row needs it: the name responses report, who
    gives it (for messages: "the resource 'llm'"), how to load it, and how to free it
    (before the other model loads, as run_batch does: one GPU need not hold both)."""

    name: str
    source: str
    load: Callable[[], "LLM"]
    release: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class BatchEngines:
    """The run's models: one for chat and completion rows, one for embedding rows (None:
    those rows get `no_embedder` as their error)."""

    generator: Engine
    embedder: Engine | None = None
    no_embedder: str = NO_EMBEDDER


@dataclass(frozen=True)
class RequestPartition(PartitionRows[TableRow]):
    """One partition's checked rows, and its storage (None: the caller stores the table)."""


@dataclass
class BatchStats(PartitionCounts):
    """What one partition's table holds: rows that ran, error rows by OpenAI's error code,
    and the tokens the rows that ran generated."""

    ok_rows: int = 0
    error_codes: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0


@dataclass
class BatchResult(CommittedPartition[BatchStats]):
    """A committed partition: its output table (data version in the schema metadata) and stats."""


class OpenAIBatchRun(PartitionRun[RequestPartition, BatchStats]):
    """Runs the request rows of several partitions: the chat and completion rows of all of
    them in one engine call, then (the generating model freed) the embedding rows in
    another, as `engine.entrypoints.openai.runner` runs a batch file's lines; each
    partition commits as soon as its last row is done (`PartitionRun`). `check_alive` runs
    before every commit and may raise to stop."""

    result_type = BatchResult

    def __init__(self, engines: BatchEngines, code_version: str, log: Callable[[str], None],
                 check_alive: Callable[[], None] = lambda: None) -> None:
        super().__init__(check_alive)
        self.engines = engines
        self.code_version = code_version
        self.log = log
        self.models: dict[str, str] = {}  # task -> "name@digest of its output settings" of the models loaded
        # task -> the loaded model's output settings (`LLM.output_settings`: its parsers' names among them)
        self.output_settings: dict[str, dict[str, Any]] = {}

    def run(self, partitions: Sequence[RequestPartition]) -> Iterator[BatchResult]:
        """Yields each partition's result as it commits; those with nothing to run first."""
        parts = self._open(partitions)
        todo = self._todo(parts)
        generate = [pending for pending in todo if line_task(pending.row.line) == "generate"]
        embed = [pending for pending in todo if line_task(pending.row.line) == "embed"]
        self.log(f"{len(generate)} chat and completion rows and {len(embed)} embedding rows to run for "
                 f"{len(parts)} partition(s)")
        yield from self._ready(parts)
        if generate:
            yield from self._run_task("generate", self.engines.generator, generate)
            if embed:
                self.engines.generator.release()
        if embed and self.engines.embedder is None:
            yield from self._refuse(embed, LineError(UNSUPPORTED_URL, self.engines.no_embedder))
        elif embed:
            yield from self._run_task("embed", self.engines.embedder, embed)

    def _run_task(self, task: str, engine: Engine, todo: list[PendingRow[TableRow]]) -> Iterator[BatchResult]:
        """The rows of one task on its model (`run_lines`: each body's error, each refused
        prompt's, then the others in one engine call)."""
        llm = engine.load()
        self.output_settings[task] = llm.output_settings
        self.models[task] = f"{engine.name}@{digest(self.output_settings[task])}"
        if llm.task != task:
            yield from self._refuse(todo, LineError(UNSUPPORTED_URL, f"url: {engine.source} loads {engine.name!r}, "
                                                                     f"which does not {task} ({llm.task}): {_FIX[task]}"))
            return
        for result in run_lines(llm, [pending.row.line for pending in todo], engine.name, use_tqdm=False):
            part, row = todo[result.index].part, todo[result.index].row
            record = response_record(row, result.body) if result.error is None else error_record(row, result.error)
            yield from self._finish(part, row.position, record)

    def _refuse(self, todo: list[PendingRow[TableRow]], error: LineError) -> Iterator[BatchResult]:
        """Every row of `todo` gets `error`."""
        for pending in todo:
            yield from self._finish(pending.part, pending.row.position, error_record(pending.row, error))

    def _commit(self, part: OpenPartition) -> BatchResult:
        """Commits with the data version of the models its rows ran on, known only now."""
        part.data_version = self._data_version(part.rows)
        return super()._commit(part)

    def _missing_record(self, part: OpenPartition, row: TableRow) -> dict[str, Any]:
        return error_record(row, row.error)

    def _table(self, part: OpenPartition, records: list[dict[str, Any]]) -> pa.Table:
        return pa.Table.from_pylist(records, schema=OUTPUT_SCHEMA)

    def _stats(self, part: OpenPartition, records: list[dict[str, Any]]) -> BatchStats:
        ran = [r for r in records if r.get("status_code") == 200]
        return BatchStats(rows=len(records), ok_rows=len(ran), error_rows=len(records) - len(ran),
                          error_codes=dict(Counter(r["error_code"] for r in records if r.get("error_code"))),
                          prompt_tokens=sum(r["prompt_tokens"] or 0 for r in ran),
                          completion_tokens=sum(r["completion_tokens"] or 0 for r in ran),
                          elapsed_s=self._elapsed_s())

    def _data_version(self, rows: list[TableRow]) -> str:
        """Digest of the rows as they were read (each line, or each bad row's error), the
        code version, and the models the rows ran on (their files and output settings)."""
        tasks = {line_task(row.line) for row in rows if row.line is not None}
        return digest({"code_version": self.code_version,
                       "models": {task: self.models.get(task, "none") for task in sorted(tasks)},
                       "rows": [[row.line.custom_id, row.line.url, row.line.body] if row.line is not None
                                else [row.custom_id, row.error.code, row.error.message] for row in rows]})[:24]
