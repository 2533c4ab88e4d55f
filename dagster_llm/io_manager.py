"""`ParquetIOManager`: tables as Parquet files, one per partition, for any asset. It owns
the `TableStore` through which the generation assets also commit partitions and shards as
rows finish: one writer of the generation table.

The class docstring is what the Dagster UI shows, so it is plain prose; the example
lives here:

    import dagster as dg
    import pandas as pd
    from dagster_llm import LLMResource, ParquetIOManager, build_generation_asset

    answers = build_generation_asset("answers", upstream="questions", chat=True)

    @dg.asset
    def answer_lengths(answers: pd.DataFrame) -> pd.DataFrame:
        return answers.assign(chars=answers["generated_text"].str.len())

    defs = dg.Definitions(
        assets=[answers, answer_lengths],
        resources={"llm": LLMResource(), "io_manager": ParquetIOManager(base_path="data")},
    )
"""

import os
from typing import Any

import dagster as dg
import pandas as pd
import pyarrow as pa
from pydantic import Field
from upath import UPath

from dagster_llm.core.table_store import DEFAULT_LEASE_TTL_S, TableMissingError, TableStore, storage_path
from dagster_llm.partitions import upstream_partition

Table = pd.DataFrame | pa.Table


class ParquetIOManager(dg.ConfigurableIOManager):
    """Stores pandas DataFrames or pyarrow Tables as Parquet, one file per partition
    (base_path/asset key/partition.parquet, published whole), in a folder or on an object
    store (s3://, gs://, az://). A run over several partitions hands over and receives a
    {partition_key: table} dict; the row shards of one partition load as one table. Inputs
    load as DataFrames, or as pyarrow Tables where annotated pa.Table. A generation table is
    not rewritten when its file already holds its data version.
    """

    base_path: str | None = Field(
        default=None,
        description="Where the tables live: a folder, or an object-store URL such as s3://bucket/prefix, "
        "gs://bucket/prefix or az://container/prefix (default: $DAGSTER_LLM_OUTPUT_DIR/tables, or output/tables).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the store's fsspec file system, e.g. {\"endpoint_url\": \"http://minio:9000\"} for an "
        "S3-compatible server. Credentials come from the store's own conventions (as dagster-aws and "
        "dagster-gcp read them): AWS_* variables, profiles or the pod's role; Google's application default "
        "credentials; AZURE_STORAGE_* variables.",
    )
    lease_ttl_s: float = Field(
        default=DEFAULT_LEASE_TTL_S,
        description="On an object store, how long a partition's writer lease outlives its last renewal: a run "
        "killed mid-partition leaves its partition to the next run after this (renewed every third of it).",
    )

    @property
    def root(self) -> UPath:
        default = os.path.join(os.environ.get("DAGSTER_LLM_OUTPUT_DIR", "output"), "tables")
        return storage_path(self.base_path or default, self.storage_options)

    def table_store(self) -> TableStore:
        """The tables, shards and locks under `root`: what generation runs write through."""
        return TableStore(self.root, self.lease_ttl_s)

    def handle_output(self, context: dg.OutputContext, obj: Table | dict[str, Table] | None) -> None:
        """Stores one table, or a {partition_key: table} dict when the run spans partitions."""
        if obj is None:
            return
        keys = context.asset_partition_keys if context.has_asset_partitions else [None]
        if len(keys) > 1 and not isinstance(obj, dict):
            raise dg.DagsterInvariantViolationError(
                f"{context.asset_key.to_user_string()}: a run over {len(keys)} partitions must return a "
                "{partition_key: table} dict, one table per partition"
            )
        tables = obj if isinstance(obj, dict) else {keys[0]: obj}
        store = self.table_store()
        for key in keys:
            table = tables[key]
            table = table if isinstance(table, pa.Table) else pa.Table.from_pandas(table, preserve_index=False)
            partition = store.partition(context.asset_key.path, key)
            partition.write(table)
        if len(keys) == 1:
            # One materialization per partition carries these: a range's total would be wrong on each.
            context.add_output_metadata({"path": dg.MetadataValue.path(partition.location),
                                         "dagster/row_count": table.num_rows})

    def load_input(self, context: dg.InputContext) -> Table | dict[str, Table]:
        """One table, or a {partition_key: table} dict when the input spans partitions."""
        arrow = context.dagster_type.typing_type is pa.Table or getattr(
            context.dagster_type.typing_type, "__args__", None) == (str, pa.Table)
        keys = context.asset_partition_keys if context.has_asset_partitions else [None]
        by_source: dict[str | None, list[pa.Table]] = {}
        for key in keys:  # row shards of one upstream partition make one table
            by_source.setdefault(upstream_partition(key), []).append(self._read(context.asset_key, key))
        tables = {source: pa.concat_tables(parts, promote_options="default") for source, parts in by_source.items()}
        if not arrow:
            tables = {source: table.to_pandas() for source, table in tables.items()}
        return next(iter(tables.values())) if len(tables) == 1 else tables

    def _read(self, asset_key: dg.AssetKey, key: str | None) -> pa.Table:
        partition = self.table_store().partition(asset_key.path, key)
        try:
            table = partition.read()
        except TableMissingError:
            which = f"partition {key!r} of " if key is not None else ""
            raise dg.Failure(f"{which}{asset_key.to_user_string()} has no table at {partition.location}: materialize it "
                             "first (or point the IO manager's base_path at where it was written)") from None
        return table
