"""OpenAI Batch API files run offline, as vLLM's `run_batch.py` runs them: a file read into its
lines (`read_batch_file`), the lines an earlier run already wrote (`finished_lines`, for resume), and
a whole file run on the engine (`run_batch_file`, what `python -m engine.run_batch` runs), writing each
output line as it comes (`ResultWriter`).

What a line is lives in `engine.entrypoints.openai.protocol`, how its body becomes engine inputs and
its outputs a response body in `engine.entrypoints.openai.serving`, and how the lines of one task run
on a loaded model in `engine.entrypoints.openai.runner`, which the Dagster asset's run of request
tables shares. Importing this module loads
neither torch nor the model code: the engine (`engine.entrypoints.llm`) is imported where a file is run.
"""

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from engine.entrypoints.openai.protocol import (
    DUPLICATE_CUSTOM_ID, UNSUPPORTED_URL, BadLine, BatchLine, LineError, error_line, jsonl_line, parse_lines,
    response_line,
)
from engine.entrypoints.openai.runner import line_task, run_lines
from engine.model_loader.embedded_model import EMBEDDED_MODEL_NAME

if TYPE_CHECKING:
    from engine.entrypoints.llm import LLM

logger = logging.getLogger(__name__)


class BatchRunError(Exception):
    """A run that cannot start or go on: an input or output file that cannot be used, a
    model or engine setting the engine refuses. The message names the file or setting and the fix."""


def read_batch_file(path_or_url: str) -> list[BatchLine | BadLine]:
    """The lines of an input file: a local path or an fsspec URL (s3://..., gs://...).

    Raises:
        BatchRunError: the file cannot be read.
    """
    import fsspec

    try:
        with fsspec.open(path_or_url, "rb") as stream:
            return parse_lines(stream.read().splitlines())
    except (OSError, ValueError, ImportError) as exc:  # ImportError: the URL's filesystem is not installed
        raise BatchRunError(f"input file {path_or_url}: cannot be read ({type(exc).__name__}: {exc})") from exc


# ---------------------------------------------------------------------------------------------
# Resume and the run of a whole file


@dataclass(frozen=True)
class FinishedLines:
    """What an earlier run already wrote: the custom_ids with an output line (a duplicate's
    error aside, which does not stand for its id's first line) and the input line numbers
    of its error lines."""

    custom_ids: frozenset[str] = frozenset()
    line_numbers: frozenset[int] = frozenset()

    def covers(self, line: BatchLine | BadLine) -> bool:
        """Whether the line has its output line already."""
        if line.number in self.line_numbers:
            return True
        duplicate = isinstance(line, BadLine) and line.error.code == DUPLICATE_CUSTOM_ID
        return not duplicate and line.custom_id in self.custom_ids


def finished_lines(path: Path) -> FinishedLines:
    """The lines an existing output file holds; a torn last line (a run stopped while
    writing it) is cut off the file, so that the line runs again.

    Raises:
        BatchRunError: a complete line of the file is not an output line.
    """
    if not path.exists():
        return FinishedLines()
    try:
        data = path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            with path.open("r+b") as stream:
                stream.truncate(len(whole))
    except OSError as exc:
        raise BatchRunError(f"output file {path}: cannot be read and appended to ({exc})") from exc
    if len(whole) < len(data):
        logger.warning("%s: dropped a torn last line (%d bytes); its request runs again", path, len(data) - len(whole))
    ids, numbers = set(), set()
    for i, raw in enumerate(whole.splitlines(), 1):
        try:
            record = json.loads(raw)
            error = record["error"] or {}
        except (ValueError, TypeError, KeyError) as exc:
            raise BatchRunError(f"output file {path} line {i} is not an output line of a batch run ({exc!r:.80}): "
                                "give another output file, or move this one away") from exc
        if isinstance(error.get("line"), int):
            numbers.add(error["line"])
        if isinstance(record.get("custom_id"), str) and error.get("code") != DUPLICATE_CUSTOM_ID:
            ids.add(record["custom_id"])
    return FinishedLines(frozenset(ids), frozenset(numbers))


@dataclass
class BatchSummary:
    """How a run went: lines written with a response, with an error, and skipped because
    an earlier run wrote them."""

    ok: int = 0
    errors: int = 0
    skipped: int = 0

    def __str__(self) -> str:
        return f"{self.ok} lines ok, {self.errors} errors, {self.skipped} skipped (already in the output file)"


class ResultWriter:
    """Writes output lines as they come, each in one write and flushed, so that a run that
    stops leaves whole lines (and at most a torn last one); counts them in `summary`."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.summary = BatchSummary()

    def response(self, custom_id: str, body: dict[str, Any]) -> None:
        self._write(response_line(custom_id, body))
        self.summary.ok += 1

    def error(self, number: int, custom_id: str | None, error: LineError) -> None:
        self._write(error_line(number, custom_id, error))
        self.summary.errors += 1

    def _write(self, record: dict[str, Any]) -> None:
        self.stream.write(jsonl_line(record))
        self.stream.flush()


@dataclass(frozen=True)
class BatchRun:
    """The engine side of a run: the model to generate with (None: the embedded
    SmolLM2-135M-Instruct), the one to embed with (None: the same, loaded with
    runner="pooling"), and the `LLM` settings of both."""

    model: str | None = None
    embedding_model: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The name responses report as their `model`: --model as given."""
        return self.model or EMBEDDED_MODEL_NAME

    @property
    def embedding_model_name(self) -> str:
        return self.embedding_model or self.model_name

    def load(self, task: str) -> "LLM":
        """The engine of a task's lines: `model` to generate, `embedding_model` (else `model`)
        loaded with runner="pooling" to embed.

        Raises:
            BatchRunError: the engine refuses the model or a setting.
        """
        if task == "generate":
            return _load(self.model, self.settings)
        return _load(self.embedding_model or self.model, {**self.settings, "runner": "pooling"})


def run_batch_file(input_file: str, output_file: str, run: BatchRun = BatchRun()) -> BatchSummary:
    """Runs an OpenAI batch input file into an output file ("-": standard output).

    Lines already in an existing output file are skipped and new ones appended (resume).
    Bad lines get their error line before any model loads; then the chat and completion
    lines run in one batch on `run.model`, and the embedding lines on a pooling engine.

    Raises:
        BatchRunError: an input or output file, model or setting that cannot be used.
    """
    lines = read_batch_file(input_file)
    finished = FinishedLines() if output_file == "-" else finished_lines(Path(output_file))
    try:
        stream = sys.stdout if output_file == "-" else open(output_file, "a", encoding="utf-8")
    except OSError as exc:
        raise BatchRunError(f"output file {output_file}: cannot be written ({exc})") from exc
    try:
        writer = ResultWriter(stream)
        pending = []
        for line in lines:
            if finished.covers(line):
                writer.summary.skipped += 1
            elif isinstance(line, BadLine):
                writer.error(line.number, line.custom_id, line.error)
            else:
                pending.append(line)
        for task, name in (("generate", run.model_name), ("embed", run.embedding_model_name)):
            lines_of_task = [line for line in pending if line_task(line) == task]
            if lines_of_task:
                with run.load(task) as llm:
                    _run_task(llm, task, lines_of_task, writer, name)
    finally:
        if stream is not sys.stdout:
            stream.close()
    return writer.summary


def _load(model: str | None, settings: dict[str, Any]) -> "LLM":
    from engine.entrypoints.llm import LLM

    try:
        return LLM(model, **settings)
    except (ValueError, TypeError) as exc:  # ModelLoadError and invalid settings included
        raise BatchRunError(f"the engine cannot load model {model or EMBEDDED_MODEL_NAME!r}: {exc}") from exc


# What a model that does not do a task is told, by task.
_WRONG_MODEL = {"generate": "does not generate text ({task}): run these lines with a generative --model",
                "embed": "does not embed ({task}): give an embedding model with --embedding-model"}


def _run_task(llm: "LLM", task: str, lines: list[BatchLine], writer: ResultWriter, model: str) -> None:
    """The lines of one task ("generate": chat and completions, "embed"), in one batch on
    `llm`; each line's output line is written as soon as it is done."""
    if llm.task != task:
        error = LineError(UNSUPPORTED_URL, f"url: the model {model!r} {_WRONG_MODEL[task].format(task=llm.task)}")
        for line in lines:
            writer.error(line.number, line.custom_id, error)
        return
    _note_other_models(lines, model)
    for result in run_lines(llm, lines, model):
        line = lines[result.index]
        if result.error is not None:
            writer.error(line.number, line.custom_id, result.error)
        else:
            writer.response(line.custom_id, result.body)


def _note_other_models(lines: list[BatchLine], model: str) -> None:
    """Logs the body `model` names that differ from the loaded model's: they run on it anyway."""
    named = sorted({line.body["model"] for line in lines
                    if isinstance(line.body.get("model"), str) and line.body["model"] != model})
    if named:
        logger.warning("body.model names %s; every line runs on %r (body.model is not checked)",
                       ", ".join(map(repr, named)), model)
