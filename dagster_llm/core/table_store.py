"""Where generation tables live, on a local disk or an object store (any fsspec URL:
`s3://`, `gs://`, `az://`, `file://`, or a plain path): one storage interface for the
committed tables, the shards of rows finished by a run that has not committed yet, and the
lock that keeps a second writer out. `ParquetIOManager` owns a `TableStore`; a generation
run writes through the same one, so there is one writer of the table.

    <root>/<asset>/<partition>.parquet            the committed table
    <root>/<asset>/.<partition>.shards/<version>/  shards of finished rows, by data version
    <root>/<asset>/.<partition>.lock               the writer lock on a local disk (flock)
    <root>/<asset>/.<partition>.lease/             the writer lease on an object store
    <root>/<asset>/.row_index/<partition>.parquet  the committed table's reusable rows by digest


Every file is written beside its key and then moved into place (a rename on a disk, a
server-side copy on a store, whose objects appear whole or not at all), so readers only
ever see whole tables. Between the upload and the move the writer confirms its lease, so a
run whose lease was taken over never publishes. Shards of another data version than the
current one are deleted, never mixed in.

The row index lists, for each committed row whose result is reproducible (greedy, seeded or
beam search), its row digest (`GenerationRun` computes it: the prompt, the sampling used,
the adapter, the output, the images, the model's files, the engine's output settings, the code version)
and its position. A later run of the asset reuses a committed row of any partition whose
digest matches instead of generating it again. The index carries the data version of the
table it indexes; an index whose table was since replaced is ignored.
"""

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from upath import UPath

from dagster_llm.core.leases import EXCLUSIVE_CREATE_PROTOCOLS, FileLock, HeldLock, StoreLease, StoreWithoutLeaseError

# Parquet schema metadata key holding the data version a table was generated for.
DATA_VERSION_KEY = b"dagster_llm.data_version"
# Column of shard rows: the row's position in its partition's prompt table.
POSITION_COLUMN = "_position"
# Folder of an asset's row index, and the index's columns.
ROW_INDEX_FOLDER = ".row_index"
ROW_DIGEST_COLUMN = "row_digest"
# How long a lease on an object store outlives its last renewal (a killed writer's partition
# is free again after this).
DEFAULT_LEASE_TTL_S = 60.0


class TableMissingError(LookupError):
    """A table that was never committed was asked for."""


def storage_path(location: str | PathLike[str], storage_options: Mapping[str, Any] | None = None) -> UPath:
    """`location` (a path or an fsspec URL) as a path on its file system; `storage_options`
    go to the file system (e.g. `endpoint_url` for an S3-compatible server). Credentials come
    from each store's own conventions: AWS's environment and profiles, Google's application
    default credentials, Azure's environment."""
    return UPath(location, **(storage_options or {}))


def is_local(fs: AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def write_parquet_atomically(table: pa.Table, path: Path | UPath,
                             before_publish: Callable[[], None] = lambda: None) -> None:
    """Writes `table` beside `path`, calls `before_publish`, then moves it into place, so
    that readers never see half a file (and nothing is published if `before_publish` raises)."""
    path = UPath(path)
    fs = path.fs
    if is_local(fs):
        fs.makedirs(path.parent.path, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp.path, filesystem=fs)
        before_publish()
        fs.mv(tmp.path, path.path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.rm_file(tmp.path)
        raise


def _listing(fs: AbstractFileSystem, folder: str) -> list[str]:
    """The entries of `folder` as they are now (not a cached listing); none if it is missing."""
    fs.invalidate_cache(folder)
    try:
        return sorted(fs.ls(folder, detail=False))
    except FileNotFoundError:
        return []


def partition_file(root: Path | UPath, asset_path: Sequence[str], partition_key: str | None) -> Path | UPath:
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


def data_version_of(path: Path | UPath) -> str | None:
    """The data version stored in a Parquet file's schema, or None (no file, no version)."""
    path = UPath(path)
    path.fs.invalidate_cache(path.path)  # another process may have written it since
    try:
        schema = pq.read_schema(path.path, filesystem=path.fs)
    except FileNotFoundError:
        return None
    value = (schema.metadata or {}).get(DATA_VERSION_KEY)
    return value.decode() if value else None


class PartitionFiles:
    """The committed table, the shards and the writer lock of one partition, on a local disk
    or an object store. While `lock` is held, every write first confirms it."""

    def __init__(self, path: Path | UPath, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 asset_root: Path | UPath | None = None) -> None:
        self.path = UPath(path)
        self.fs = self.path.fs
        self.shard_root = self.path.with_name(f".{self.path.stem}.shards")
        self.row_index = RowIndex(UPath(asset_root) if asset_root is not None else self.path.parent)
        self.index_path = self.row_index.index_path(self.path)
        self.lease_ttl_s = lease_ttl_s
        self._held: HeldLock | None = None

    @property
    def location(self) -> str:
        """Where the committed table is, as a user would look for it."""
        return str(self.path.resolve()) if is_local(self.fs) else str(self.path)

    @property
    def committed_version(self) -> str | None:
        """The committed table's data version, None where nothing was committed."""
        return data_version_of(self.path)

    def read(self) -> pa.Table:
        """The committed table.

        Raises:
            TableMissingError: nothing was committed.
        """
        self.fs.invalidate_cache(self.path.path)  # another process may have written it since
        try:
            return pq.read_table(self.path.path, filesystem=self.fs)
        except FileNotFoundError:
            raise TableMissingError(self.location) from None

    def write(self, table: pa.Table) -> None:
        """Commits `table`, unless the committed table already holds its data version."""
        version = data_version_in(table)
        if version is None or data_version_of(self.path) != version:
            write_parquet_atomically(table, self.path, self._confirm)

    def finished_rows(self, version: str) -> pa.Table | None:
        """Rows already generated for `version`, with their positions (`POSITION_COLUMN`):
        the committed table when it was generated for this version, else this version's
        shards. Shards of other versions are deleted."""
        if data_version_of(self.path) == version:
            table = self.read()
            return table.append_column(POSITION_COLUMN, pa.array(range(table.num_rows), pa.int32()))
        for stale in _listing(self.fs, self.shard_root.path):
            if UPath(stale).name != version:
                self.fs.rm(stale, recursive=True)
        shards = [name for name in _listing(self.fs, (self.shard_root / version).path)
                  if UPath(name).name.startswith("shard-")]
        if not shards:
            return None
        return pa.concat_tables([pq.read_table(shard, filesystem=self.fs) for shard in shards])

    def finished_records(self, version: str, positions: set[int]) -> dict[int, dict]:
        """The rows already finished for `version` (`finished_rows`) at `positions`, by
        position (the first where a position was saved twice), without the position column."""
        finished = self.finished_rows(version)
        records: dict[int, dict] = {}
        for record in finished.to_pylist() if finished is not None else []:
            position = record.pop(POSITION_COLUMN)
            if position in positions:
                records.setdefault(position, record)
        return records

    def append_shard(self, version: str, rows: pa.Table) -> None:
        """Persists finished rows (with their positions) of `version`."""
        name = f"shard-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        write_parquet_atomically(rows, self.shard_root / version / name, self._confirm)

    def commit(self, table: pa.Table, version: str, row_digests: Mapping[int, str] | None = None) -> None:
        """Replaces the committed table atomically, then its row index (`row_digests`: the
        digest of each reusable row by position; none: the table offers no row), and drops
        the shards it absorbs."""
        write_parquet_atomically(with_data_version(table, version), self.path, self._confirm)
        if row_digests:
            positions = sorted(row_digests)
            index = pa.table({ROW_DIGEST_COLUMN: pa.array([row_digests[p] for p in positions], pa.string()),
                              POSITION_COLUMN: pa.array(positions, pa.int32())})
            write_parquet_atomically(with_data_version(index, version), self.index_path, self._confirm)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.index_path.path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.shard_root.path, recursive=True)

    def writer_lock(self) -> FileLock | StoreLease:
        """The partition's writer lock: an flock on a local disk, a lease on an object store.

        Raises:
            StoreWithoutLeaseError: the store cannot create an object only if it is absent.
        """
        name = self.path.stem
        if is_local(self.fs):
            return FileLock(Path(self.path.with_name(f".{name}.lock").path), name)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if protocol not in EXCLUSIVE_CREATE_PROTOCOLS:
            raise StoreWithoutLeaseError(f"{self.path}: {protocol}:// offers no create-if-absent write, which the lease that "
                             "keeps one writer per partition needs; keep the tables on a local disk or on "
                             f"{', '.join(sorted(p + '://' for p in EXCLUSIVE_CREATE_PROTOCOLS))}")
        return StoreLease(self.fs, self.path.with_name(f".{name}.lease").path, name, self.lease_ttl_s)

    @contextlib.contextmanager
    def lock(self, owner: str) -> Iterator[HeldLock]:
        """Holds the partition's writer lock while the block runs.

        Raises:
            PartitionLockedError: another writer holds it; the message names it.
        """
        with self.writer_lock().hold(owner) as held:
            self._held = held
            try:
                yield held
            finally:
                self._held = None

    def _confirm(self) -> None:
        if self._held is not None:
            self._held.confirm()


class RowIndex:
    """The reusable committed rows of one asset (every partition under `asset_root`), found
    by row digest."""

    def __init__(self, asset_root: Path | UPath) -> None:
        self.asset_root = UPath(asset_root)
        self.fs = self.asset_root.fs
        self.folder = self.asset_root / ROW_INDEX_FOLDER

    def index_path(self, table_path: Path | UPath) -> UPath:
        """Where the index of the table at `table_path` (under `asset_root`) lives."""
        relative = UPath(table_path).path[len(self.asset_root.path):].lstrip("/")
        return self.folder / relative

    def find(self, digests: set[str], first: Sequence[UPath] = ()) -> dict[str, dict[str, Any]]:
        """The committed rows whose digest is in `digests`, by digest; the indexes at `first`
        (those of the partitions being generated) are read before the others. Each index is
        read whole but only its matches are kept; a table is read only where its index
        matches, and only if it still holds the data version its index was written for."""
        found: dict[str, dict[str, Any]] = {}
        remaining = set(digests)
        for index_path in self._indexes(first):
            if not remaining:
                break
            hits = self._hits(index_path, remaining)
            found.update(hits)
            remaining -= hits.keys()
        return found

    def _indexes(self, first: Sequence[UPath]) -> list[str]:
        self.fs.invalidate_cache(self.folder.path)
        try:
            every = sorted(self.fs.find(self.folder.path))
        except FileNotFoundError:
            return []
        every = [path for path in every if path.endswith(".parquet") and not UPath(path).name.startswith(".")]
        listed = set(every)
        ahead = [path.path for path in first if path.path in listed]
        return ahead + [path for path in every if path not in ahead]

    def _hits(self, index_path: str, wanted: set[str]) -> dict[str, dict[str, Any]]:
        """The rows of one index's table whose digest is wanted."""
        try:
            index = pq.read_table(index_path, filesystem=self.fs)
        except FileNotFoundError:  # replaced since the listing
            return {}
        hits = index.filter(pc.is_in(index[ROW_DIGEST_COLUMN], value_set=pa.array(sorted(wanted), pa.string())))
        if not hits.num_rows:
            return {}
        table_path = self.asset_root / index_path[len(self.folder.path):].lstrip("/")
        self.fs.invalidate_cache(table_path.path)
        try:
            table = pq.read_table(table_path.path, filesystem=self.fs)
        except FileNotFoundError:
            return {}
        if data_version_in(table) != data_version_in(index):
            return {}
        rows = table.take(hits[POSITION_COLUMN]).to_pylist()
        return dict(zip(hits[ROW_DIGEST_COLUMN].to_pylist(), rows))


class TableStore:
    """The tables of every asset under one root (a folder or an object-store prefix): a
    partition's files by asset key path (e.g. `["support", "answers"]`) and partition key
    (None: an unpartitioned asset)."""

    def __init__(self, root: Path | UPath, lease_ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        self.root = UPath(root)
        self.lease_ttl_s = lease_ttl_s
        self._partitions: dict[str, PartitionFiles] = {}

    def partition(self, asset_path: Sequence[str], partition_key: str | None) -> PartitionFiles:
        """The partition's files; one object per partition, so that writes through it confirm
        the lock `locks` took."""
        path = partition_file(self.root, asset_path, partition_key)
        asset_root = self.root.joinpath(*getattr(asset_path, "path", asset_path))
        return self._partitions.setdefault(str(path), PartitionFiles(path, self.lease_ttl_s, asset_root))

    @contextlib.contextmanager
    def locks(self, asset_path: Sequence[str], partition_keys: Sequence[str | None], owner: str
              ) -> Iterator[list[HeldLock]]:
        """Holds the writer locks of several partitions of one asset.

        Raises:
            PartitionLockedError: one of them is held by another writer.
        """
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(self.partition(asset_path, key).lock(owner)) for key in partition_keys]
