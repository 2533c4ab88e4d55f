"""What every run of the core does with its partitions, written once: a run (`GenerationRun`,
`EmbeddingRun`, `OpenAIBatchRun`) takes the rows of several partitions into one engine call
and commits each partition as soon as its last row is done, so that a long range shows its
first partitions early.

A partition's life: it opens with its data version (the digest of everything its table
depends on); the rows already done for that version are taken back (resume: its committed
table, or the shards of an interrupted run); each row that finishes is recorded, and saved
in a shard when one is due (`Shards`: every so many rows or seconds); once no row is left it
commits (its table in input order, with its data version, to its files) and the run yields
its `CommittedPartition`. A row with an error never runs: its record is made at the commit.

A row whose result is reproducible may carry a row digest (what its result depends on); a
run that gives them (`row_digests`) takes, for each row still to run, a committed row of the
asset with the same digest (any partition, any data version: `_reuse`), and offers its own
rows for reuse when it commits.

A run specialises what its rows, records, tables and stats are (`_missing_record`, `_table`,
`_stats`, `result_type`).
"""

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import pyarrow as pa

from dagster_llm.core.table_store import POSITION_COLUMN, PartitionFiles, with_data_version


class Row(Protocol):
    """A row of a partition: its position in the partition's table, and why it does not run
    (None: it runs)."""

    position: int
    error: Any


RowT = TypeVar("RowT", bound=Row)
StatsT = TypeVar("StatsT", bound="PartitionCounts")
SourceT = TypeVar("SourceT", bound="PartitionRows")


@dataclass(frozen=True)
class PartitionRows(Generic[RowT]):
    """One partition to run: its key, its rows in input order, and its storage (None: nothing
    is saved until the caller stores the table)."""

    key: str | None
    rows: list[RowT]
    files: PartitionFiles | None = None


@dataclass
class PartitionCounts:
    """What every committed partition's table holds: its rows, those with an error, the
    prompt tokens of the rows that ran, and the seconds from the run's start to the commit."""

    rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    elapsed_s: float = 0.0


@dataclass
class CommittedPartition(Generic[StatsT]):
    """A committed partition: its table (data version in the schema metadata) and stats."""

    key: str | None
    table: pa.Table
    data_version: str
    stats: StatsT


@dataclass
class OpenPartition(Generic[SourceT]):
    """A partition while a run fills it: its records by position (resumed, reused or run),
    the rows still running (`pending`), and those not yet saved in a shard (`unsaved`)."""

    source: SourceT
    data_version: str = ""
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    resumed_rows: int = 0
    row_digests: dict[int, str] = field(default_factory=dict)
    reused_rows: int = 0
    pending: int = 0
    unsaved: list[int] = field(default_factory=list)
    last_shard: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> str | None:
        return self.source.key

    @property
    def rows(self) -> list[Any]:
        return self.source.rows

    @property
    def files(self) -> PartitionFiles | None:
        return self.source.files


@dataclass(frozen=True)
class PendingRow(Generic[RowT]):
    """A row to run, and the partition it finishes."""

    part: OpenPartition
    row: RowT


@dataclass(frozen=True)
class Shards:
    """When a partition's finished rows are saved: every `rows` rows, or `interval_s` seconds."""

    rows: int = 64
    interval_s: float = 30.0


class PartitionRun(ABC, Generic[SourceT, StatsT]):
    """The life cycle of a run's partitions (see the module). `check_alive` runs before every
    write and may raise to stop the run, after which nothing more is written; `shards` None:
    finished rows are saved only when their partition commits; `resume` False: every row
    runs again."""

    partition_type: ClassVar[type[OpenPartition]] = OpenPartition
    result_type: ClassVar[type[CommittedPartition]]

    def __init__(self, check_alive: Callable[[], None], shards: Shards | None = None, resume: bool = False) -> None:
        self.check_alive = check_alive
        self.shards = shards
        self.resume = resume
        self.started = time.monotonic()

    def _open(self, partitions: Sequence[SourceT]) -> list[OpenPartition]:
        """Starts the run's clock; each partition open, nothing recorded yet."""
        self.started = time.monotonic()
        return [self.partition_type(source) for source in partitions]

    def _resume(self, part: OpenPartition) -> None:
        """Takes the rows already done for the partition's data version (its committed
        table, or the shards of an interrupted run)."""
        if part.files is None or not self.resume:
            return
        part.records = part.files.finished_records(part.data_version,
                                                   {row.position for row in part.rows if row.error is None})
        part.resumed_rows = len(part.records)

    def _reuse(self, parts: Sequence[OpenPartition]) -> None:
        """Takes, for each row still to run, a committed row of the asset (any partition, any
        data version) with the same row digest, under the row's own id (`_reused_record`)."""
        stored = [part for part in parts if part.files is not None]
        wanted: dict[str, list[tuple[OpenPartition, Any]]] = {}
        for part in stored:
            for row in part.rows:
                if row.position in part.row_digests and row.position not in part.records:
                    wanted.setdefault(part.row_digests[row.position], []).append((part, row))
        if not wanted:
            return
        found = stored[0].files.row_index.find(set(wanted), [part.files.index_path for part in stored])
        for row_digest, record in found.items():
            for part, row in wanted[row_digest]:
                part.records[row.position] = self._reused_record(part, row, record)
                part.reused_rows += 1
                part.unsaved.append(row.position)

    def _reused_record(self, part: OpenPartition, row: Any, record: dict[str, Any]) -> dict[str, Any]:
        """A committed row of the same digest as the record of `row` (its own id and model)."""
        return record

    def _todo(self, parts: Sequence[OpenPartition]) -> list[PendingRow]:
        """The rows left to run: neither an error nor recorded; each partition counts its own."""
        todo = [PendingRow(part, row) for part in parts for row in part.rows
                if row.error is None and row.position not in part.records]
        for pending in todo:
            pending.part.pending += 1
        return todo

    def _ready(self, parts: Sequence[OpenPartition]) -> Iterator[CommittedPartition[StatsT]]:
        """Commits the partitions with no row left to run."""
        for part in parts:
            if part.pending == 0:
                yield self._commit(part)

    def _finish(self, part: OpenPartition, position: int, record: dict[str, Any]
                ) -> Iterator[CommittedPartition[StatsT]]:
        """Records a finished row; commits its partition when it was the last, or saves a
        shard when one is due."""
        part.records[position] = record
        part.unsaved.append(position)
        part.pending -= 1
        if part.pending == 0:
            yield self._commit(part)
        elif self._shard_due(part):
            self._save_shard(part)

    def _shard_due(self, part: OpenPartition) -> bool:
        return part.files is not None and self.shards is not None and (
            len(part.unsaved) >= self.shards.rows or time.monotonic() - part.last_shard >= self.shards.interval_s)

    def _save_shard(self, part: OpenPartition) -> None:
        self.check_alive()
        positions = sorted(part.unsaved)
        table = self._table(part, [part.records[p] for p in positions])
        part.files.append_shard(part.data_version, table.append_column(POSITION_COLUMN,
                                                                       pa.array(positions, pa.int32())))
        part.unsaved.clear()
        part.last_shard = time.monotonic()

    def _commit(self, part: OpenPartition) -> CommittedPartition[StatsT]:
        """The partition's table in input order, committed to its files."""
        self.check_alive()
        records = [part.records.get(row.position) or self._missing_record(part, row) for row in part.rows]
        table = with_data_version(self._table(part, records), part.data_version)
        if part.files is not None:
            part.files.commit(table, part.data_version, self._reusable_rows(part))
        return self.result_type(part.key, table, part.data_version, self._stats(part, records))

    def _elapsed_s(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def _reusable_rows(self, part: OpenPartition) -> Mapping[int, str]:
        """The digest of each reusable row of the committed table, by position."""
        return {p: d for p, d in part.row_digests.items() if p in part.records}

    @abstractmethod
    def _missing_record(self, part: OpenPartition, row: Any) -> dict[str, Any]:
        """The record of a row that did not run (its error)."""

    @abstractmethod
    def _table(self, part: OpenPartition, records: list[dict[str, Any]]) -> pa.Table:
        """The table of `records` (a whole partition's, or a shard's)."""

    @abstractmethod
    def _stats(self, part: OpenPartition, records: list[dict[str, Any]]) -> StatsT:
        """The committed partition's stats, from its records in input order."""
