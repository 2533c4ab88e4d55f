"""`build_generation_asset`: a prompt table in, a generation table out, per partition.

The asset body is glue: run config and resources in, `dagster_llm.generation` does the
work, and each committed partition becomes a materialization with its checks.
"""

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import pyarrow as pa

import engine
from dagster_llm import checks
from dagster_llm.generation import GenerationRun, PartitionInput, PartitionResult, RunOptions, digest
from dagster_llm.partitions import PartitionChoice, output_choice
from dagster_llm.prompts import PromptTableError, TableSpec, check_columns, read_rows, to_dataframe
from dagster_llm.resource import LLMResource
from dagster_llm.sampling import GenerationRunConfig, SamplingConfig
from dagster_llm.schema import column_descriptions, generation_schema, output_columns
from dagster_llm.storage import ParquetIOManager
from dagster_llm.store import PartitionFiles, PartitionLockedError
from dagster_llm.structured import OutputSpecError, StructuredOutput
from dagster_llm.watch import LaunchingProcessDied, ParentWatch


@dataclass(frozen=True)
class _Definition:
    """What the factory resolved once, at definition time."""

    name: str
    asset_key: dg.AssetKey
    upstream_key: dg.AssetKey
    spec: TableSpec
    sampling: PartitionChoice[SamplingConfig]
    adapter: PartitionChoice[str | None]
    output: PartitionChoice[StructuredOutput | None]
    structured: bool  # some partition has a structured output: the asset has the parse_rate check
    lora_requests: Mapping[str, engine.LoRARequest]
    resource_key: str
    io_manager_key: str
    thresholds: checks.CheckThresholds
    code_version: str
    progress_interval_s: float
    shard_rows: int
    partitioned: bool


def build_generation_asset(
    name: str,
    upstream: str | dg.AssetKey | dg.AssetsDefinition,
    *,
    prompt_column: str = "prompt",
    id_column: str = "id",
    chat: bool = False,
    sampling: SamplingConfig | None = None,
    sampling_by_partition: Mapping[str, SamplingConfig] | None = None,
    adapters: Mapping[str, str | Path] | None = None,
    adapter: str | None = None,
    adapter_by_partition: Mapping[str, str | None] | None = None,
    adapter_column: str = "adapter",
    output_schema: Mapping[str, Any] | type | None = None,
    choices: Sequence[str] | None = None,
    output_schema_by_partition: Mapping[str, Mapping[str, Any] | type | None] | None = None,
    choices_by_partition: Mapping[str, Sequence[str] | None] | None = None,
    duplicate_ids: str = "error",
    partitions_def: dg.PartitionsDefinition | None = None,
    resource_key: str = "llm",
    io_manager_key: str = "io_manager",
    pool: str | None = "llm",
    max_partitions_per_run: int | None = None,
    thresholds: checks.CheckThresholds = checks.CheckThresholds(),
    key_prefix: str | list[str] | None = None,
    group_name: str | None = None,
    code_version: str = "1",
    description: str | None = None,
    progress_interval_s: float = 5.0,
    shard_rows: int = 64,
) -> dg.AssetsDefinition:
    """Builds an asset that runs the LLM over an upstream prompt table.

    The upstream asset gives a pandas DataFrame or pyarrow Table per partition (a
    `{partition_key: table}` dict for a range) with an id column and a prompt column:
    text, or chat messages ([{"role", "content"}, ...]) rendered with the model's chat
    template (`chat=True` also wraps plain text as one user message). Optional columns
    named like `SamplingConfig` fields override the partition's sampling for their row.

    The generation table goes through the IO manager (`ParquetIOManager`: one Parquet file
    per partition), so downstream assets take it as an input. With that IO manager, rows
    are saved in shards as they finish, each partition of a range commits (file,
    materialization, checks) as soon as its rows are done, and a rerun after a crash
    generates only the rows that are missing (`resumed_rows` in the metadata). A
    partition's data version digests its rows (id, prompt, effective sampling, adapter
    and its fingerprint), the model weights and the code version.

    A row that cannot run (null or bad prompt, bad override, unknown or broken adapter,
    repeated id, too long) gets its `error` and the others run. The asset carries four
    checks per partition (error rows, empty generations, truncation rate, unique ids),
    claims a slot of `pool`, and holds a lock per partition so that two runs never write
    one partition at once.

    Structured outputs: with `output_schema` (a pydantic model class or a JSON schema
    dict) the engine constrains every completion to compact JSON of that schema, and the
    table gains one typed column per top-level field, named as the field (see
    `dagster_llm.structured` for the types), after `error`; `generated_text` keeps the raw
    JSON. With `choices` each completion is one of the labels, in a `choice` column. A row
    whose output does not parse or validate (for instance cut off by max_tokens) keeps its
    text and gets an `error`; a fifth check, `parse_rate`, reports the share that parsed.

    Args:
        name: The asset's name.
        upstream: The prompt table asset (its partitions_def is reused when it has one).
        prompt_column: Column with the prompt text or chat messages.
        id_column: Column that identifies a row; copied to the output.
        chat: Render plain-text prompts with the chat template as one user message.
        sampling: Sampling of partitions that `sampling_by_partition` does not name.
        sampling_by_partition: Partition key or glob pattern (e.g. "2024-*", "creative|*")
            to its sampling; exact keys win over patterns, earlier patterns over later.
        adapters: LoRA adapter name -> PEFT adapter folder.
        adapter: The adapter of partitions that `adapter_by_partition` does not name
            (None: the base model).
        adapter_by_partition: Partition key or glob pattern to an adapter name (or None
            for the base model), matched like `sampling_by_partition`.
        adapter_column: Optional prompt-table column naming a row's adapter; empty or
            null cells keep the partition's.
        output_schema: What every completion must be: a pydantic model class or a JSON
            schema whose top level is an object; a field named like a column of the
            generation table is a definition error.
        choices: Labels of a classification: every completion is exactly one of them.
        output_schema_by_partition: Partition key or glob pattern to its output schema
            (None: free text), matched like `sampling_by_partition`. The asset's declared
            column schema shows the default's columns; each materialization, its own.
        choices_by_partition: Partition key or glob pattern to its choices (None: free
            text); a partition named here and in `output_schema_by_partition` is a
            definition error.
        duplicate_ids: "error" (a repeated id is an error row and fails the unique_ids
            check) or "keep" (every copy is generated).
        partitions_def: The asset's partitions (default: the upstream asset's).
        resource_key: Key of the `LLMResource`.
        io_manager_key: Key of the IO manager of the generation table.
        pool: Concurrency pool of the step; None claims no pool.
        max_partitions_per_run: None (default) runs a whole backfill as one run
            (`BackfillPolicy.single_run()`, which `dagster asset materialize
            --partition-range` needs); N splits daemon and UI backfills into runs of at
            most N partitions each.
        thresholds: Highest acceptable error, empty and truncation rates; lowest
            acceptable parse rate of a structured output.
        key_prefix: Prefix of the asset key.
        group_name: Dagster asset group.
        code_version: Your version of the prompt logic; the sampling settings are added
            to it, so changing them marks the asset stale.
        description: Asset description.
        progress_interval_s: Seconds between progress lines in the event log.
        shard_rows: Finished rows per shard (a shard is also written every 30 s).

    Examples:
        .. code-block:: python

            import dagster as dg
            import pandas as pd
            from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset

            days = dg.DailyPartitionsDefinition(start_date="2024-06-01")

            @dg.asset(partitions_def=days, backfill_policy=dg.BackfillPolicy.single_run())
            def questions(context: dg.AssetExecutionContext) -> pd.DataFrame: ...

            answers = build_generation_asset(
                "answers", upstream=questions, chat=True,
                sampling=SamplingConfig(temperature=0, max_tokens=64),
            )

            @dg.asset(partitions_def=days)
            def answer_lengths(answers: pd.DataFrame) -> pd.DataFrame:
                return answers.assign(chars=answers["generated_text"].str.len())

            defs = dg.Definitions(
                assets=[questions, answers, answer_lengths],
                resources={"llm": LLMResource(), "io_manager": ParquetIOManager()},
            )
    """
    upstream_key = upstream.key if isinstance(upstream, dg.AssetsDefinition) else dg.AssetKey.from_coercible(upstream)
    if partitions_def is None and isinstance(upstream, dg.AssetsDefinition):
        partitions_def = upstream.partitions_def
    if duplicate_ids not in ("error", "keep"):
        raise dg.DagsterInvalidDefinitionError(f"{name}: duplicate_ids must be 'error' or 'keep', got {duplicate_ids!r}")
    prefix = [key_prefix] if isinstance(key_prefix, str) else list(key_prefix or [])
    asset_key = dg.AssetKey([*prefix, name])
    default_sampling = sampling or SamplingConfig()
    adapters = {adapter_name: str(path) for adapter_name, path in (adapters or {}).items()}
    undeclared = sorted({a for a in [adapter, *(adapter_by_partition or {}).values()] if a is not None} - set(adapters))
    if undeclared:
        raise dg.DagsterInvalidDefinitionError(
            f"{name}: adapter(s) {undeclared} are not declared; add them to adapters={{name: folder}}"
        )
    spec = TableSpec(id_column, prompt_column, chat, adapter_column, tuple(adapters), duplicate_ids)
    output = output_choice(name, output_schema, choices, output_schema_by_partition, choices_by_partition,
                           partitions_def)
    settings_hash = digest({
        "sampling": default_sampling.model_dump(),
        "by_partition": {k: v.model_dump() for k, v in (sampling_by_partition or {}).items()},
        "spec": [id_column, prompt_column, chat, adapter_column, duplicate_ids],
        "adapter": adapter, "adapter_by_partition": dict(adapter_by_partition or {}),
        "output": _describe(output.default),
        "output_by_partition": {k: _describe(v) for k, v in output.by_partition.items()},
    })
    definition = _Definition(
        name=name, asset_key=asset_key, upstream_key=upstream_key, spec=spec,
        sampling=PartitionChoice(default_sampling, sampling_by_partition, partitions_def, name, "sampling_by_partition"),
        adapter=PartitionChoice(adapter, adapter_by_partition, partitions_def, name, "adapter_by_partition"),
        output=output, structured=any(o is not None for o in [output.default, *output.by_partition.values()]),
        # Ids by sorted name: stable across runs and processes.
        lora_requests={a: engine.LoRARequest(a, i + 1, path) for i, (a, path) in enumerate(sorted(adapters.items()))},
        resource_key=resource_key, io_manager_key=io_manager_key,
        thresholds=dataclasses.replace(thresholds, allow_duplicate_ids=duplicate_ids == "keep"),
        code_version=f"{code_version}+{settings_hash[:12]}", progress_interval_s=progress_interval_s,
        shard_rows=shard_rows, partitioned=partitions_def is not None,
    )

    @dg.multi_asset(
        name=name if not prefix else "__".join([*prefix, name]),
        outs={asset_key.to_python_identifier(): dg.AssetOut(
            key=asset_key, code_version=definition.code_version, group_name=group_name,
            description=description or f"LLM completions of {upstream_key.to_user_string()}.{prompt_column}",
            kinds={"parquet"}, is_required=False, io_manager_key=io_manager_key,
            metadata={"dagster/column_schema": _column_schema(output.default)},
        )},
        ins={"prompts": dg.AssetIn(key=upstream_key)},
        check_specs=checks.check_specs(asset_key, partitions_def, definition.structured),
        can_subset=True,
        partitions_def=partitions_def,
        backfill_policy=None if partitions_def is None
        else dg.BackfillPolicy.single_run() if max_partitions_per_run is None
        else dg.BackfillPolicy.multi_run(max_partitions_per_run),
        pool=pool,
        required_resource_keys={resource_key, io_manager_key},
    )
    def _generate(context: dg.AssetExecutionContext, config: GenerationRunConfig, prompts: object):
        yield from _GenerationStep(definition, context, config).execute(prompts)

    return _generate


class _GenerationStep:
    """One execution of a generation asset: checks, locks, the run, and its events."""

    def __init__(self, definition: _Definition, context: dg.AssetExecutionContext,
                 config: GenerationRunConfig) -> None:
        self.d = definition
        self.context = context
        self.config = config
        self.resource: LLMResource = getattr(context.resources, definition.resource_key)
        io_manager = getattr(context.resources, definition.io_manager_key)
        self.store = io_manager if isinstance(io_manager, ParquetIOManager) else None
        self.keys = list(context.partition_keys) if definition.partitioned else [None]
        self.output_metadata: dict[str, object] = {}

    def execute(self, prompts: object) -> Iterator[object]:
        sampling = self._sampling()
        frames = self._frames(prompts)
        if self.d.lora_requests and not self.resource.enable_lora:
            raise dg.Failure(f"{self.d.name} declares LoRA adapters ({', '.join(sorted(self.d.lora_requests))}), but "
                             f"the resource {self.d.resource_key!r} has enable_lora=False: set "
                             "LLMResource(enable_lora=True, max_loras=..., max_lora_rank=...)")
        files = {key: self.store.partition_files(self.d.asset_key, key) if self.store else None for key in self.keys}
        with self._locks(files):
            llm = self.resource.get_llm()
            tokenizer = llm.get_tokenizer()
            parts = [self._input(key, frames[key], sampling[key], files[key], tokenizer) for key in self.keys]
            run = GenerationRun(llm, self.d.lora_requests, self._options(), self.context.log.info, ParentWatch().check)
            results = {}
            try:
                for result in run.generate(parts):
                    results[result.key] = result
                    yield from self._committed(result, sampling[result.key])
            except LaunchingProcessDied as exc:
                raise dg.Failure(str(exc)) from None
            except OutputSpecError as exc:
                raise dg.Failure(f"{self.d.name}: {exc}") from None
        yield from self._output(results)
        if len(self.keys) > 1:
            yield from self._check_outputs()

    def _input(self, key: str | None, frame: pd.DataFrame, sampling: SamplingConfig, files: PartitionFiles | None,
               tokenizer: object) -> PartitionInput:
        """One partition's rows with its adapter and structured output."""
        output = self.d.output.for_partition(key)
        rows = read_rows(frame, key, sampling, self.d.adapter.for_partition(key), self.d.spec, tokenizer, output)
        return PartitionInput(key, rows, files, output)

    def _sampling(self) -> dict[str | None, SamplingConfig]:
        """Each partition's sampling with the run's overrides; every bad field at once."""
        try:
            return {key: self.config.sampling.apply(self.d.sampling.for_partition(key), self.context.op_def.name)
                    for key in self.keys}
        except ValueError as exc:
            raise dg.Failure(f"{self.d.name}: invalid run config, nothing was run: {exc}. Fix the value in the "
                             "Launchpad (or --config-json) and launch again.") from None

    def _frames(self, prompts: object) -> dict[str | None, pd.DataFrame]:
        given = prompts if isinstance(prompts, dict) and len(self.keys) > 1 else {self.keys[0]: prompts}
        frames = {}
        try:
            for key in self.keys:
                where = f"of partition {key!r}" if key is not None else ""
                frames[key] = to_dataframe(given[key], self.d.upstream_key.to_user_string(), where)
                check_columns(frames[key], self.d.spec, where)
        except PromptTableError as exc:
            raise dg.Failure(f"{self.d.name}: {exc}") from None
        return frames

    @contextlib.contextmanager
    def _locks(self, files: dict[str | None, PartitionFiles | None]) -> Iterator[None]:
        owner = f"run {self.context.run.run_id} of {self.d.asset_key.to_user_string()}"
        with contextlib.ExitStack() as stack:
            try:
                for key, partition_files in files.items():
                    if partition_files is not None:
                        stack.enter_context(partition_files.lock(owner))
            except PartitionLockedError as exc:
                raise dg.Failure(f"{self.d.name}: partition {exc}") from None
            yield

    def _options(self) -> RunOptions:
        return RunOptions(model_id=self.resource.model_id, code_version=self.d.code_version,
                          resume=self.config.resume, shard_rows=self.d.shard_rows,
                          progress_interval_s=self.d.progress_interval_s)

    def _committed(self, result: PartitionResult, sampling: SamplingConfig) -> Iterator[object]:
        """A range's partition is recorded as it commits; a single partition with the output."""
        metadata = self._metadata(result, sampling)
        output = self.d.output.for_partition(result.key)
        outcomes = checks.evaluate(result.table, self.d.thresholds,
                                   structured=(output is not None) if self.d.structured else None)
        if len(self.keys) == 1:
            self.output_metadata = metadata
            for check_name, outcome in outcomes.items():
                yield dg.AssetCheckResult(asset_key=self.d.asset_key, check_name=check_name, passed=outcome.passed,
                                          metadata=outcome.metadata)
            return
        self.context.add_asset_metadata(metadata, partition_key=result.key)  # for the output, if it is yielded
        if self.store is not None:
            self.context.log_event(dg.AssetMaterialization(
                self.d.asset_key, partition=result.key, metadata=metadata,
                tags={"dagster/data_version": result.data_version, "dagster/code_version": self.d.code_version}))
        for check_name, outcome in outcomes.items():
            self.context.log_event(dg.AssetCheckEvaluation(
                asset_key=self.d.asset_key, check_name=check_name, passed=outcome.passed, partition=result.key,
                metadata=outcome.metadata))

    def _output(self, results: dict[str | None, PartitionResult]) -> Iterator[object]:
        """The table (or dict of tables) for the IO manager and downstream steps."""
        name = self.d.asset_key.to_python_identifier()
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
            else:
                return
        yield output

    def _check_outputs(self) -> Iterator[dg.Output]:
        """The checks' op outputs, once each: a range's evaluations were logged per partition
        as they committed, and without these Dagster reports the checks as not yielded."""
        layer = self.context.job_def.asset_layer
        for check_key in sorted(self.context.selected_asset_check_keys, key=lambda k: k.name):
            yield dg.Output(None, output_name=layer.get_op_output_name(check_key))

    def _consumed_in_run(self) -> bool:
        layer = self.context.job_def.asset_layer
        children = layer.asset_graph.get(self.d.asset_key).child_keys
        return bool(children & set(layer.executable_asset_keys))

    def _metadata(self, result: PartitionResult, sampling: SamplingConfig) -> dict[str, object]:
        stats, table = result.stats, result.table
        llm = self.resource.get_llm()
        output = self.d.output.for_partition(result.key)
        return {
            **_table_metadata(table, self.d.upstream_key, self.d.spec, output),
            "path": dg.MetadataValue.path(str(self.store.path_for(self.d.asset_key, result.key).resolve()))
            if self.store else "(stored by the IO manager)",
            "model_id": self.resource.model_id,
            "model_fingerprint": llm.model_fingerprint,
            "engine_version": engine.__version__,
            "partitions_in_run": len(self.keys),
            "elapsed_s": stats.elapsed_s,
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "generated_rows": stats.generated_rows,
            "generated_tokens": stats.generated_tokens,
            "resumed_rows": stats.resumed_rows,
            "error_rows": stats.error_rows,
            "finish_reasons": dg.MetadataValue.json(stats.finish_reasons),
            "adapter": self.d.adapter.for_partition(result.key) or "none",
            "adapter_fingerprints": dg.MetadataValue.json(stats.adapter_fingerprints),
            "sampling_config": dg.MetadataValue.json(sampling.model_dump()),
            **({"structured_output": dg.MetadataValue.json(output.describe())} if output is not None else {}),
            "data_version": result.data_version,
            "upstream_data_version": _upstream_data_version(self.context, self.d.upstream_key, result.key) or "unknown",
        }


def _describe(output: StructuredOutput | None) -> dict[str, Any] | None:
    return output.describe() if output is not None else None


def _column_schema(output: StructuredOutput | None) -> dg.TableSchema:
    """The generation table's columns (with a structured output's typed columns) and their descriptions."""
    descriptions = column_descriptions(output)
    return dg.TableSchema(columns=[
        dg.TableColumn(f.name, str(f.type), description=descriptions[f.name]) for f in generation_schema(output)
    ])


def _table_metadata(table: pa.Table, upstream_key: dg.AssetKey, spec: TableSpec,
                    output: StructuredOutput | None) -> dict[str, object]:
    def from_column(column: str) -> list[dg.TableColumnDep]:
        return [dg.TableColumnDep(asset_key=upstream_key, column_name=column)]

    lineage = dg.TableColumnLineage(deps_by_column={
        "generated_text": from_column(spec.prompt_column),
        "prompt": from_column(spec.prompt_column),
        "id": from_column(spec.id_column),
        # Every output field is generated from the prompt.
        **{column.name: from_column(spec.prompt_column) for column in output_columns(output)},
    })
    return {
        "dagster/row_count": table.num_rows,
        "dagster/column_schema": _column_schema(output),
        "dagster/column_lineage": lineage,
        "preview": dg.MetadataValue.md(preview_markdown(table)),
    }


PREVIEW_ROWS = 10


def preview_markdown(table: pa.Table, rows: int = PREVIEW_ROWS) -> str:
    """The first rows as a Markdown table that the UI wraps: id, the prompt's head and tail
    (templated prompts differ at the end), the completion (or the row's error) and the
    finish reason."""
    if not table.num_rows:
        return "(no rows)"
    first = table.slice(0, rows).to_pylist()
    lines = ["| id | prompt | generated text | finish |", "|---|---|---|---|"]
    for row in first:
        text = row["generated_text"] if row["error"] is None else f"error: {row['error']}"
        # A word joiner after each hyphen: the browser would otherwise wrap ids like T-1001 there.
        row_id = _cell(row["id"]).replace("-", "-\u2060")
        cells = [_cell(_ends(row["prompt"], 40)), _cell(_ends(text, 300)), _cell(row["finish_reason"])]
        lines.append("| " + " | ".join([row_id, *cells]) + " |")
    more = table.num_rows - len(first)
    return "\n".join(lines) + (f"\n\n{more} more row{'s' if more > 1 else ''} in the table." if more > 0 else "")


def _ends(text: object, keep: int) -> str:
    """Text no longer than about 2 * keep characters: its head and tail around an ellipsis."""
    text = "" if text is None else str(text)
    return text if len(text) <= 2 * keep + 3 else f"{text[:keep]} … {text[-keep:]}"


def _cell(value: object) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return " ".join(("" if value is None else str(value)).split()).replace("|", "\\|")


def _upstream_data_version(context: dg.AssetExecutionContext, key: dg.AssetKey, partition: str | None) -> str | None:
    """The data version of the upstream partition this run reads, as its own page shows it.

    Dagster's tag `dagster/input_data_version/<upstream>` differs on purpose: it is the
    sha256 of the data versions of all the upstream partitions a step read, concatenated.
    """
    record = context.instance.get_latest_data_version_record(key, partition_key=partition)
    if record is None:
        return None
    event = record.event_log_entry.asset_materialization or record.event_log_entry.asset_observation
    return (event.tags or {}).get("dagster/data_version") if event else None
