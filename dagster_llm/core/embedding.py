"""An embedding run, free of Dagster: text rows of one or more partitions in, each
partition's embedding table and stats out as soon as its last row is embedded.

The table has one row per input row, in input order: `id`, `embedding` (a fixed-size list
of float32, null for a row that could not run), `model`, `prompt_tokens` and `error`.
Embedded rows are saved in shards as the run goes; a rerun of a partition with the same
data version (texts, model weights, settings, code) takes them and embeds only the rest.
"""

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from dagster_llm.core.checks import CheckOutcome
from dagster_llm.core.engine_surface import PoolingParams, invalid_unicode_problem
from dagster_llm.core.generation import digest
from dagster_llm.core.prompts import missing_cell, storable_text
from dagster_llm.core.table_store import POSITION_COLUMN, PartitionFiles, with_data_version

if TYPE_CHECKING:
    from dagster_llm.core.engine_surface import LLM

COLUMNS = {
    "id": "The row's id, from the upstream table (as text).",
    "embedding": "The text's vector: a fixed-size list of float32 of the model's width (null when the row "
                 "could not run).",
    "model": "The model id.",
    "prompt_tokens": "Tokens of the text.",
    "error": "Why the row was not embedded; null otherwise.",
}
CHECKS = {
    "no_error_rows": "Every row was embedded (no `error`).",
    "finite_vectors": "No embedding is empty or holds NaN or infinity.",
    "dimension": "Every embedding has the model's dimension.",
    "unique_ids": "Ids are unique within the partition.",
}


@dataclass
class TextRow:
    """One row to embed: its position in the partition, its id and text, or why it cannot run."""

    position: int
    id: Any
    text: str | None
    error: str | None = None


@dataclass(frozen=True)
class EmbeddingOptions:
    """How a run embeds, saves and reports."""

    model_id: str
    code_version: str
    normalize: bool | None = None
    resume: bool = True
    shard_rows: int = 64
    shard_interval_s: float = 30.0


@dataclass(frozen=True)
class TextPartition:
    """One partition to embed, and its storage (None: the caller stores the table)."""

    key: str | None
    rows: list[TextRow]
    files: PartitionFiles | None = None


@dataclass
class EmbeddingStats:
    rows: int = 0
    error_rows: int = 0
    resumed_rows: int = 0
    embedded_rows: int = 0
    prompt_tokens: int = 0
    dimension: int = 0
    elapsed_s: float = 0.0


@dataclass
class EmbeddingResult:
    """A committed partition: its table (data version in the schema metadata) and stats."""

    key: str | None
    table: pa.Table
    data_version: str
    stats: EmbeddingStats


@dataclass
class _Partition:
    key: str | None
    rows: list[TextRow]
    files: PartitionFiles | None
    data_version: str = ""
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    resumed_rows: int = 0
    pending: int = 0
    unsaved: list[int] = field(default_factory=list)
    last_shard: float = field(default_factory=time.monotonic)


def text_rows(ids: Sequence[Any], texts: Sequence[Any]) -> list[TextRow]:
    """The rows of a partition, ids as text; a null id, an empty or non-text value, or a
    repeated id is the row's error (the others run)."""
    rows, seen = [], set()
    for position, (raw_id, text) in enumerate(zip(ids, texts)):
        row_id = None if missing_cell(raw_id) else str(raw_id)
        row = TextRow(position, row_id, text if isinstance(text, str) else None)
        if row_id is None:
            row.error = "id: is null: give every row an id"
        elif (problem := invalid_unicode_problem(row_id, "id")) is not None:
            row.error = problem
            row.id = storable_text(row_id)
        elif row_id in seen:
            row.error = f"id: {row_id!r} repeats an earlier row's: give every row its own id"
        elif not isinstance(text, str) or not text.strip():
            row.error = f"text: is {'empty' if isinstance(text, str) else 'missing'}: drop the row or give it text"
        seen.add(row_id)
        rows.append(row)
    return rows


class EmbeddingRun:
    """Embeds the rows of several partitions in one engine call, committing each partition
    when its rows are done. `check_alive` runs before every write and may raise to stop."""

    def __init__(self, llm: "LLM", options: EmbeddingOptions, log: Callable[[str], None],
                 check_alive: Callable[[], None] = lambda: None) -> None:
        self.llm = llm
        self.options = options
        self.log = log
        self.check_alive = check_alive
        self.schema = embedding_schema(llm.hidden_size)

    def embed(self, partitions: Sequence[TextPartition]) -> Iterator[EmbeddingResult]:
        """Yields each partition's result as it commits; partitions that need no new rows first."""
        started = time.monotonic()
        parts = [_Partition(p.key, p.rows, p.files) for p in partitions]
        self._check_rows([row for part in parts for row in part.rows])
        model = self.llm.output_settings
        for part in parts:
            part.data_version = self._data_version(part, model)
            self._resume(part)
        todo = [row for part in parts for row in part.rows if row.error is None and row.position not in part.records]
        owner = {id(row): part for part in parts for row in part.rows}
        for row in todo:
            owner[id(row)].pending += 1
        self.log(f"embedding {len(todo)} rows for {len(parts)} partition(s) "
                 f"({sum(p.resumed_rows for p in parts)} resumed)")
        for part in parts:
            if part.pending == 0:
                yield self._commit(part, started)
        if not todo:
            return
        finished = self.llm.embed_as_completed([row.text for row in todo], PoolingParams(self.options.normalize),
                                               use_tqdm=False)
        for index, output in finished:
            row = todo[index]
            part = owner[id(row)]
            part.records[row.position] = self._record(row, output.outputs.embedding, len(output.prompt_token_ids))
            part.unsaved.append(row.position)
            part.pending -= 1
            if part.pending == 0:
                yield self._commit(part, started)
            elif self._shard_due(part):
                self._save_shard(part)

    def _check_rows(self, rows: list[TextRow]) -> None:
        """Marks rows the engine cannot take (too long for the context or the cache)."""
        ready = [row for row in rows if row.error is None]
        for row, problem in zip(ready, self.llm.validate_pooling([row.text for row in ready])):
            if problem is not None:
                row.error = problem

    def _data_version(self, part: _Partition, model: dict) -> str:
        """Digest of the code version, the model's files and resolved output settings, and the rows."""
        rows = [(str(r.id), r.text, r.error) for r in part.rows]
        return digest({"code_version": self.options.code_version, "model": model, "rows": rows,
                       "normalize": self.options.normalize, "task": "embed"})[:24]

    def _resume(self, part: _Partition) -> None:
        if part.files is None or not self.options.resume:
            return
        part.records = part.files.finished_records(part.data_version,
                                                   {row.position for row in part.rows if row.error is None})
        part.resumed_rows = len(part.records)

    def _record(self, row: TextRow, embedding: list[float] | None, prompt_tokens: int) -> dict[str, Any]:
        return {"id": row.id, "embedding": embedding, "model": self.options.model_id,
                "prompt_tokens": prompt_tokens, "error": row.error}

    def _shard_due(self, part: _Partition) -> bool:
        return part.files is not None and (len(part.unsaved) >= self.options.shard_rows
                                           or time.monotonic() - part.last_shard >= self.options.shard_interval_s)

    def _save_shard(self, part: _Partition) -> None:
        self.check_alive()
        positions = sorted(part.unsaved)
        table = self._table([part.records[p] for p in positions])
        part.files.append_shard(part.data_version, table.append_column(POSITION_COLUMN,
                                                                       pa.array(positions, pa.int32())))
        part.unsaved.clear()
        part.last_shard = time.monotonic()

    def _table(self, records: list[dict[str, Any]]) -> pa.Table:
        return pa.Table.from_pylist(records, schema=self.schema)

    def _commit(self, part: _Partition, started: float) -> EmbeddingResult:
        self.check_alive()
        records = [part.records.get(row.position) or self._record(row, None, 0) for row in part.rows]
        table = with_data_version(self._table(records), part.data_version)
        if part.files is not None:
            part.files.commit(table, part.data_version)
        embedded = [r for r in records if r["embedding"] is not None]
        stats = EmbeddingStats(rows=len(records), error_rows=sum(r["error"] is not None for r in records),
                               resumed_rows=part.resumed_rows, embedded_rows=len(embedded) - part.resumed_rows,
                               prompt_tokens=sum(r["prompt_tokens"] for r in embedded),
                               dimension=self.llm.hidden_size, elapsed_s=round(time.monotonic() - started, 3))
        return EmbeddingResult(part.key, table, part.data_version, stats)


def embedding_schema(dimension: int) -> pa.Schema:
    """The embedding table's columns; `embedding` a fixed-size list of `dimension` float32,
    `id` the upstream id as text (as in the generation tables)."""
    return pa.schema([
        pa.field("id", pa.string()),
        pa.field("embedding", pa.list_(pa.float32(), dimension)),
        pa.field("model", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("error", pa.string()),
    ])


def evaluate_embeddings(table: pa.Table, dimension: int) -> dict[str, CheckOutcome]:
    """The embedding checks (`CHECKS`) of one partition's table."""
    error_rows = table.num_rows - table.column("error").null_count
    vectors = [v for v in table.column("embedding").to_pylist() if v is not None]
    bad = sum(1 for v in vectors if not v or not all(math.isfinite(x) for x in v))
    wrong = sum(1 for v in vectors if len(v) != dimension)
    ids = table.column("id").to_pylist()
    repeated = len(ids) - len(set(ids))
    return {
        "no_error_rows": CheckOutcome(error_rows == 0, {"error_rows": error_rows}),
        "finite_vectors": CheckOutcome(bad == 0, {"bad_vectors": bad}),
        "dimension": CheckOutcome(wrong == 0, {"dimension": dimension, "wrong_dimension": wrong}),
        "unique_ids": CheckOutcome(repeated == 0, {"repeated_ids": repeated}),
    }
