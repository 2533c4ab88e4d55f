"""Where generation tables live: one storage interface for the committed tables, the shards
of rows finished by a run that has not committed yet, and the lock that keeps a second
writer out. `ParquetIOManager` owns a `TableStore`; a generation run writes through the
same one, so there is one writer of the table.

    <root>/<asset>/<partition>.parquet            the committed table (atomic rename)
    <root>/<asset>/.<partition>.shards/<version>/  shards of finished rows, by data version
    <root>/<asset>/.<partition>.lock               held (flock) by the process generating it

Readers only ever open the committed table, so they never see a partial one. Shards of
another data version than the current one are deleted, never mixed in.
"""

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# Parquet schema metadata key holding the data version a table was generated for.
DATA_VERSION_KEY = b"dagster_llm.data_version"
# Column of shard rows: the row's position in its partition's prompt table.
POSITION_COLUMN = "_position"


class PartitionLockedError(RuntimeError):
    """Another process is generating the same partition."""


class TableMissingError(LookupError):
    """A table that was never committed was asked for."""


def write_parquet_atomically(table: pa.Table, path: Path) -> None:
    """Writes beside the target and renames, so that readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def partition_file(root: Path, asset_path: Sequence[str], partition_key: str | None) -> Path:
    """`root/<asset key path>/<partition>.parquet`; multi-dimensional keys (with
    `keys_by_dimension`, as Dagster's) become Hive-style folders (`dim=value/...`), an
    unpartitioned asset is `data.parquet`. `asset_path` may also be an asset key (its `path`)."""
    folder = root.joinpath(*getattr(asset_path, "path", asset_path))
    if partition_key is None:
        return folder / "data.parquet"
    dimensions = getattr(partition_key, "keys_by_dimension", None)
    if dimensions:
        parts = [f"{dim}={value}" for dim, value in sorted(dimensions.items())]
        return folder.joinpath(*parts[:-1]) / f"{parts[-1]}.parquet"
    return folder / f"{partition_key}.parquet"


def with_data_version(table: pa.Table, version: str) -> pa.Table:
    """The table with `version` in its schema metadata."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}), DATA_VERSION_KEY: version.encode()})


def data_version_in(table: pa.Table) -> str | None:
    """The data version a table carries in its schema metadata, or None."""
    value = (table.schema.metadata or {}).get(DATA_VERSION_KEY)
    return value.decode() if value else None


def data_version_of(path: Path) -> str | None:
    """The data version stored in a Parquet file's schema, or None (no file, no version)."""
    if not path.exists():
        return None
    value = (pq.read_schema(path).metadata or {}).get(DATA_VERSION_KEY)
    return value.decode() if value else None


class PartitionFiles:
    """The committed table, the shards and the lock of one partition, on a local disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shard_root = path.parent / f".{path.stem}.shards"
        self.lock_path = path.parent / f".{path.stem}.lock"

    @property
    def location(self) -> str:
        """Where the committed table is, as a user would look for it."""
        return str(self.path.resolve())

    def read(self) -> pa.Table:
        """The committed table.

        Raises:
            TableMissingError: nothing was committed.
        """
        if not self.path.exists():
            raise TableMissingError(self.location)
        return pq.read_table(self.path)

    def write(self, table: pa.Table) -> None:
        """Commits `table`, unless the committed table already holds its data version."""
        version = data_version_in(table)
        if version is None or data_version_of(self.path) != version:
            write_parquet_atomically(table, self.path)

    def finished_rows(self, version: str) -> pa.Table | None:
        """Rows already generated for `version`, with their positions (`POSITION_COLUMN`):
        the committed table when it was generated for this version, else this version's
        shards. Shards of other versions are deleted."""
        if data_version_of(self.path) == version:
            table = pq.read_table(self.path)
            return table.append_column(POSITION_COLUMN, pa.array(range(table.num_rows), pa.int32()))
        if self.shard_root.exists():
            for stale in self.shard_root.iterdir():
                if stale.name != version:
                    shutil.rmtree(stale, ignore_errors=True)
        shards = sorted((self.shard_root / version).glob("shard-*.parquet")) if self.shard_root.exists() else []
        if not shards:
            return None
        return pa.concat_tables([pq.read_table(shard) for shard in shards])

    def append_shard(self, version: str, rows: pa.Table) -> None:
        """Persists finished rows (with their positions) of `version`."""
        folder = self.shard_root / version
        folder.mkdir(parents=True, exist_ok=True)
        write_parquet_atomically(rows, folder / f"shard-{time.time_ns():020d}.parquet")

    def commit(self, table: pa.Table, version: str) -> None:
        """Replaces the committed table atomically and drops the shards it absorbs."""
        write_parquet_atomically(with_data_version(table, version), self.path)
        shutil.rmtree(self.shard_root, ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, owner: str) -> Iterator[None]:
        """Holds the partition's writer lock (released when the process dies, too).

        Raises:
            PartitionLockedError: another process holds it; the message names it.
        """
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                raise PartitionLockedError(
                    f"{self.path.stem} is being generated by {holder}; two runs never write one partition "
                    "at once: wait for that run to finish (or cancel it), then materialize again"
                ) from None
            handle.truncate(0)
            handle.write(f"{owner} (pid {os.getpid()})")
            handle.flush()
            try:
                yield
            finally:
                handle.truncate(0)
                fcntl.flock(handle, fcntl.LOCK_UN)


class TableStore:
    """The tables of every asset under one root folder: a partition's files by asset key path
    (e.g. `["support", "answers"]`) and partition key (None: an unpartitioned asset)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def partition(self, asset_path: Sequence[str], partition_key: str | None) -> PartitionFiles:
        return PartitionFiles(partition_file(self.root, asset_path, partition_key))

    @contextlib.contextmanager
    def locks(self, asset_path: Sequence[str], partition_keys: Sequence[str | None], owner: str) -> Iterator[None]:
        """Holds the writer locks of several partitions of one asset.

        Raises:
            PartitionLockedError: one of them is held by another process.
        """
        with contextlib.ExitStack() as stack:
            for key in partition_keys:
                stack.enter_context(self.partition(asset_path, key).lock(owner))
            yield
