"""Parquet storage: atomic per-partition files and an IO manager for prompt tables."""

import os
import tempfile
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


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


def partition_file(root: Path, asset_key: dg.AssetKey, partition_key: str | None) -> Path:
    """`root/<asset key path>/<partition>.parquet`; multi-dimensional keys become
    Hive-style folders (`dim=value/...`), an unpartitioned asset is `data.parquet`."""
    folder = root.joinpath(*asset_key.path)
    if partition_key is None:
        return folder / "data.parquet"
    if isinstance(partition_key, dg.MultiPartitionKey):
        parts = [f"{dim}={value}" for dim, value in sorted(partition_key.keys_by_dimension.items())]
        return folder.joinpath(*parts[:-1]) / f"{parts[-1]}.parquet"
    return folder / f"{partition_key}.parquet"


class ParquetIOManager(dg.ConfigurableIOManager):
    """Stores pandas DataFrames or pyarrow Tables as Parquet, one file per partition.

    A run over several partitions (a single-run backfill) returns and receives a dict
    {partition_key: DataFrame}; a run over one partition, the table itself.
    """

    base_path: str = "output/tables"

    def _path(self, context: dg.OutputContext | dg.InputContext, key: str | None) -> Path:
        return partition_file(Path(self.base_path), context.asset_key, key)

    def handle_output(self, context: dg.OutputContext, obj: pd.DataFrame | pa.Table | dict) -> None:
        """Stores one table, or a {partition_key: table} dict when the run spans partitions."""
        keys = context.asset_partition_keys if context.has_asset_partitions else [None]
        if len(keys) > 1 and not isinstance(obj, dict):
            raise dg.DagsterInvariantViolationError(
                f"{context.asset_key.to_user_string()}: a run over {len(keys)} partitions must return a "
                "{partition_key: table} dict, one table per partition"
            )
        tables = obj if isinstance(obj, dict) else {keys[0]: obj}
        rows = 0
        for key in keys:
            table = tables[key]
            table = table if isinstance(table, pa.Table) else pa.Table.from_pandas(table, preserve_index=False)
            write_parquet_atomically(table, self._path(context, key))
            rows += table.num_rows
        context.add_output_metadata({"path": dg.MetadataValue.path(str(self._path(context, keys[0]).parent)),
                                     "dagster/row_count": rows})

    def load_input(self, context: dg.InputContext) -> pd.DataFrame | dict[str, pd.DataFrame]:
        if not context.has_asset_partitions:
            return pd.read_parquet(self._path(context, None))
        keys = context.asset_partition_keys
        frames = {key: pd.read_parquet(self._path(context, key)) for key in keys}
        return frames[keys[0]] if len(keys) == 1 else frames
