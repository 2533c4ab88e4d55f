"""An embedding run, free of Dagster: text rows of one or more partitions in, each
partition's embedding table and stats out as soon as its last row is embedded.

The table has one row per input row, in input order: `id`, `embedding` (a fixed-size list
of float32, null for a row that could not run), `model`, `prompt_tokens` and `error`.
Embedded rows are saved in shards as the run goes; a rerun of a partition with the same
data version (texts, model weights, settings, code) takes them and embeds only the rest.
"""

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from dagster_llm.core.checks import CheckOutcome
from dagster_llm.core.engine_surface import PoolingParams, invalid_unicode_problem
from dagster_llm.core.generation import digest
from dagster_llm.core.partition_run import (
    CommittedPartition, OpenPartition, PartitionCounts, PartitionRows, PartitionRun, Shards,
)
from dagster_llm.core.prompts import missing_cell, storable_text

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
class TextPartition(PartitionRows[TextRow]):
    """One partition to embed, and its storage (None: the caller stores the table)."""


@dataclass
class EmbeddingStats(PartitionCounts):
    """What one partition's table holds and what this run did for it: rows resumed (embedded
    for its data version by an earlier run) and embedded, and the vectors' width."""

    resumed_rows: int = 0
    embedded_rows: int = 0
    dimension: int = 0


@dataclass
class EmbeddingResult(CommittedPartition[EmbeddingStats]):
    """A committed partition: its table (data version in the schema metadata) and stats."""


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


class EmbeddingRun(PartitionRun[TextPartition, EmbeddingStats]):
    """Embeds the rows of several partitions in one engine call, committing each partition
    when its rows are done (`PartitionRun`). `check_alive` runs before every write and may
    raise to stop."""

    result_type = EmbeddingResult

    def __init__(self, llm: "LLM", options: EmbeddingOptions, log: Callable[[str], None],
                 check_alive: Callable[[], None] = lambda: None) -> None:
        super().__init__(check_alive, Shards(options.shard_rows, options.shard_interval_s), options.resume)
        self.llm = llm
        self.options = options
        self.log = log
        self.schema = embedding_schema(llm.hidden_size)

    def embed(self, partitions: Sequence[TextPartition]) -> Iterator[EmbeddingResult]:
        """Yields each partition's result as it commits; partitions that need no new rows first."""
        parts = self._open(partitions)
        self._check_rows([row for part in parts for row in part.rows])
        model = self.llm.output_settings
        for part in parts:
            part.data_version = self._data_version(part, model)
            self._resume(part)
        todo = self._todo(parts)
        self.log(f"embedding {len(todo)} rows for {len(parts)} partition(s) "
                 f"({sum(p.resumed_rows for p in parts)} resumed)")
        yield from self._ready(parts)
        if not todo:
            return
        finished = self.llm.embed_as_completed([pending.row.text for pending in todo],
                                               PoolingParams(self.options.normalize), use_tqdm=False)
        for index, output in finished:
            part, row = todo[index].part, todo[index].row
            yield from self._finish(part, row.position,
                                    self._record(row, output.outputs.embedding, len(output.prompt_token_ids)))

    def _check_rows(self, rows: list[TextRow]) -> None:
        """Marks rows the engine cannot take (too long for the context or the cache)."""
        ready = [row for row in rows if row.error is None]
        for row, problem in zip(ready, self.llm.validate_pooling([row.text for row in ready])):
            if problem is not None:
                row.error = problem

    def _data_version(self, part: OpenPartition, model: dict) -> str:
        """Digest of the code version, the model's files and resolved output settings, and the rows."""
        rows = [(str(r.id), r.text, r.error) for r in part.rows]
        return digest({"code_version": self.options.code_version, "model": model, "rows": rows,
                       "normalize": self.options.normalize, "task": "embed"})[:24]

    def _record(self, row: TextRow, embedding: list[float] | None, prompt_tokens: int) -> dict[str, Any]:
        return {"id": row.id, "embedding": embedding, "model": self.options.model_id,
                "prompt_tokens": prompt_tokens, "error": row.error}

    def _missing_record(self, part: OpenPartition, row: TextRow) -> dict[str, Any]:
        return self._record(row, None, 0)

    def _table(self, part: OpenPartition, records: list[dict[str, Any]]) -> pa.Table:
        return pa.Table.from_pylist(records, schema=self.schema)

    def _stats(self, part: OpenPartition, records: list[dict[str, Any]]) -> EmbeddingStats:
        embedded = [r for r in records if r["embedding"] is not None]
        return EmbeddingStats(rows=len(records), error_rows=sum(r["error"] is not None for r in records),
                              resumed_rows=part.resumed_rows, embedded_rows=len(embedded) - part.resumed_rows,
                              prompt_tokens=sum(r["prompt_tokens"] for r in embedded),
                              dimension=self.llm.hidden_size, elapsed_s=self._elapsed_s())


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
