"""What every table-writing asset (generation, embedding, OpenAI batch) does the same way: its
definition (`table_asset`: one Parquet table out of one upstream table, checks per partition),
and its step, which holds its partitions' writer locks, records each partition of a range as it
commits (materialization and checks), and hands the tables to the IO manager and the downstream
steps of the run."""

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import dagster as dg
import pandas as pd

from dagster_llm.core.checks import CheckOutcome
from dagster_llm.core.generation import digest
from dagster_llm.core.leases import LeaseLostError, PartitionLockedError, StoreWithoutLeaseError
from dagster_llm.core.partition_run import CommittedPartition
from dagster_llm.core.prompts import PromptTableError, to_dataframe
from dagster_llm.core.table_store import TableStore
from dagster_llm.core.watch import LaunchingProcessDied
from dagster_llm.io_manager import ParquetIOManager


def table_asset(spec: Any, partitions_def: dg.PartitionsDefinition | None, *, code_version: str,
                default_description: str, column_schema: dg.TableSchema, input_name: str,
                checks: Mapping[str, str], resource_keys: Iterable[str],
                backfill_policy: dg.BackfillPolicy | None = None, op_tags: Mapping[str, Any] | None = None
                ) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
    """The decorator of a spec's asset body: an optional Parquet table `spec.asset_key` out,
    through `spec.io_manager_key`, of the upstream table `spec.upstream_key` (the body's
    `input_name` argument), with `checks` (name: description) per partition, in the spec's
    pool and group, needing the
    `resource_keys` (its LLMResources) and the IO manager. A backfill of a partitioned asset
    is one run unless `backfill_policy` says otherwise."""
    key = spec.asset_key
    if backfill_policy is None and partitions_def is not None:
        backfill_policy = dg.BackfillPolicy.single_run()
    return dg.multi_asset(
        name="__".join(key.path),
        outs={key.to_python_identifier(): dg.AssetOut(
            key=key, code_version=code_version, group_name=spec.group_name, kinds={"parquet"}, is_required=False,
            description=spec.description or default_description, io_manager_key=spec.io_manager_key,
            metadata={"dagster/column_schema": column_schema},
        )},
        ins={input_name: dg.AssetIn(key=spec.upstream_key)},
        check_specs=[dg.AssetCheckSpec(name, asset=key, description=description, partitions_def=partitions_def)
                     for name, description in checks.items()],
        can_subset=True,
        partitions_def=partitions_def,
        backfill_policy=backfill_policy,
        pool=spec.pool,
        op_tags=op_tags,
        required_resource_keys={*resource_keys, spec.io_manager_key},
    )


class PartitionedStep:
    """One execution of an asset that writes a table per partition through the table store.

    `name` names the asset in messages; `asset_key` is its key; `io_manager_key` the IO
    manager whose table store it writes through (None: the IO manager is another and
    stores the tables itself)."""

    def __init__(self, context: dg.AssetExecutionContext, name: str, asset_key: dg.AssetKey,
                 io_manager_key: str, partitioned: bool, code_version: str) -> None:
        self.context = context
        self.name = name
        self.asset_key = asset_key
        self.code_version = code_version
        io_manager = getattr(context.resources, io_manager_key)
        self.store: TableStore | None = io_manager.table_store() if isinstance(io_manager, ParquetIOManager) else None
        self.keys: list[str | None] = list(context.partition_keys) if partitioned else [None]
        self.output_metadata: dict[str, object] = {}
        self.results: dict[str | None, CommittedPartition] = {}

    @contextlib.contextmanager
    def locks(self) -> Iterator[None]:
        """Holds the writer locks of the run's partitions in the table store."""
        if self.store is None:
            yield
            return
        owner = f"run {self.context.run.run_id} of {self.asset_key.to_user_string()}"
        try:
            with self.store.locks(self.asset_key.path, self.keys, owner) as held:
                now = time.time()
                for key, lock in zip(self.keys, held):
                    if lock.taken_over is not None:
                        self.context.log.warning(f"partition {key}: took over the lease of "
                                                 f"{lock.taken_over.describe(now)}; its saved rows are resumed")
                yield
        except PartitionLockedError as exc:
            raise dg.Failure(f"{self.name}: partition {exc}") from None
        except StoreWithoutLeaseError as exc:
            raise dg.Failure(f"{self.name}: {exc}; nothing was run") from None

    def frames(self, value: object, upstream: str, columns: Mapping[str, str] | None = None, table: str = "table",
               asset: str = "") -> dict[str | None, pd.DataFrame]:
        """Each partition's table from the upstream's `value` (a `{partition_key: table}` dict
        for a range), holding `columns` (the asset's argument naming each: {"id_column": "id"});
        a missing column names the `table`, the arguments and the `asset` kind.

        Raises:
            dg.Failure: a value that is not a table, or a missing column; nothing was run.
        """
        given = value if isinstance(value, dict) and len(self.keys) > 1 else {self.keys[0]: value}
        frames = {}
        try:
            for key in self.keys:
                where = f"of partition {key!r}" if key is not None else ""
                frame = to_dataframe(given[key], upstream, where)
                missing = [c for c in (columns or {}).values() if c not in frame.columns]
                if missing:
                    arguments = " / ".join(f"{argument}=" for argument in columns)
                    raise PromptTableError(f"the {table} {where} has no column {missing[0]!r} (it has "
                                           f"{list(frame.columns)}); rename it upstream or pass {arguments} to the "
                                           f"{asset} asset")
                frames[key] = frame
        except PromptTableError as exc:
            raise dg.Failure(f"{self.name}: {exc}; nothing was run") from None
        return frames

    def record(self, results: Iterable[CommittedPartition],
               recorded: Callable[[CommittedPartition], Iterator[object]]) -> Iterator[object]:
        """Each partition's events (`recorded`: its metadata and checks, through `committed`) as
        the run commits it, its result kept for `outputs`; a run stopped because the launching
        process died or a partition's lease was lost fails the step, saying why."""
        try:
            for result in results:
                self.results[result.key] = result
                yield from recorded(result)
        except (LaunchingProcessDied, LeaseLostError) as exc:
            raise dg.Failure(str(exc)) from None

    def committed(self, result: CommittedPartition, metadata: dict[str, object],
                  outcomes: Mapping[str, CheckOutcome]) -> Iterator[object]:
        """A range's partition is recorded as it commits; a single partition with the output."""
        key = self.asset_key
        if len(self.keys) == 1:
            self.output_metadata = metadata
            for check_name, outcome in outcomes.items():
                yield dg.AssetCheckResult(asset_key=key, check_name=check_name, passed=outcome.passed,
                                          metadata=outcome.metadata)
            return
        self.context.add_asset_metadata(metadata, partition_key=result.key)  # for the output, if it is yielded
        if self.store is not None:
            self.context.log_event(dg.AssetMaterialization(
                key, partition=result.key, metadata=metadata,
                tags={"dagster/data_version": result.data_version, "dagster/code_version": self.code_version}))
        for check_name, outcome in outcomes.items():
            self.context.log_event(dg.AssetCheckEvaluation(
                asset_key=key, check_name=check_name, passed=outcome.passed, partition=result.key,
                metadata=outcome.metadata))

    def outputs(self) -> Iterator[object]:
        """The table (or dict of tables) of the recorded results for the IO manager and
        downstream steps, then the checks' op outputs of a range."""
        name, results = self.asset_key.to_python_identifier(), self.results
        output = None
        # Output(data_version=) is beta in Dagster 1.13; its warning would repeat in every run's log.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dg.BetaWarning)
            if len(self.keys) == 1:
                result = results[self.keys[0]]
                output = dg.Output(result.table, output_name=name, metadata=self.output_metadata,
                                   data_version=dg.DataVersion(result.data_version))
            elif self.store is None or self._consumed_in_run():
                # With our IO manager each partition was recorded as it committed, and the files
                # are not rewritten: this output only feeds the downstream steps of this run.
                versions = {key: r.data_version for key, r in results.items()}
                output = dg.Output({key: r.table for key, r in results.items()}, output_name=name,
                                   data_version=dg.DataVersion(digest(versions)[:24]))
        if output is not None:
            yield output
        if len(self.keys) > 1:
            yield from self._check_outputs()

    def _check_outputs(self) -> Iterator[dg.Output]:
        """The checks' op outputs, once each: a range's evaluations were logged per partition
        as they committed, and without these Dagster reports the checks as not yielded."""
        layer = self.context.job_def.asset_layer
        for check_key in sorted(self.context.selected_asset_check_keys, key=lambda k: k.name):
            yield dg.Output(None, output_name=layer.get_op_output_name(check_key))

    def _consumed_in_run(self) -> bool:
        layer = self.context.job_def.asset_layer
        children = layer.asset_graph.get(self.asset_key).child_keys
        return bool(children & set(layer.executable_asset_keys))
