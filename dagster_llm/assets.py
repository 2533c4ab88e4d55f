"""`build_generation_asset`: a prompt table in, a generation table out, per partition."""

import collections
import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

import engine
from dagster_llm import checks
from engine.lora.adapter import read_adapter_config
from dagster_llm.config import GenerationRunConfig, PartitionChoice, SamplingConfig
from dagster_llm.progress import EventLogProgress
from dagster_llm.prompts import (
    COLUMN_DESCRIPTIONS,
    GENERATION_SCHEMA,
    PromptRow,
    check_columns,
    generation_table,
    render_rows,
    to_dataframe,
)
from dagster_llm.resource import LLMResource
from dagster_llm.storage import partition_file, write_parquet_atomically

DEFAULT_OUTPUT_DIR = "output/generations"


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
    partitions_def: dg.PartitionsDefinition | None = None,
    output_dir: str | Path | None = None,
    resource_key: str = "llm",
    pool: str | None = "llm",
    max_partitions_per_run: int | None = None,
    thresholds: checks.CheckThresholds = checks.CheckThresholds(),
    key_prefix: str | list[str] | None = None,
    group_name: str | None = None,
    code_version: str = "1",
    description: str | None = None,
    progress_interval_s: float = 5.0,
) -> dg.AssetsDefinition:
    """Builds an asset that runs the LLM over an upstream prompt table.

    The upstream asset gives a pandas DataFrame or pyarrow Table per partition with an id
    column and a prompt column: text, or chat messages ([{"role", "content"}, ...])
    rendered with the model's chat template (`chat=True` also wraps plain text as one
    user message). Optional columns named like `SamplingConfig` fields override the
    partition's sampling for their row. The asset writes one Parquet file per partition
    under `output_dir` (atomically) and records lineage metadata per partition. Its data
    version digests the rows read (id, prompt, effective sampling, adapter and its
    fingerprint), the model weights and the code version: unchanged inputs keep it, any
    change moves it. In a single-run backfill one data version covers the run's
    partitions (Dagster records one per run).

    LoRA adapters (PEFT folders) are declared by name in `adapters`; each partition runs
    with `adapter`, or the one `adapter_by_partition` gives it, and a row may name
    another in `adapter_column`. Rows with different adapters run in the same batches
    on one base model (the resource needs `enable_lora=True`).

    A single-run backfill loads the model once and batches every partition's rows
    together. The asset carries three checks per partition (error rows, empty
    generations, truncation rate) and claims a slot of `pool`, so that GPU steps do not
    pile up across runs.

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
        partitions_def: The asset's partitions (default: the upstream asset's).
        output_dir: Root folder of the Parquet files (default `$DAGSTER_LLM_OUTPUT_DIR/generations`
            or `output/generations`).
        resource_key: Key of the `LLMResource`.
        pool: Concurrency pool of the step; None claims no pool.
        max_partitions_per_run: None (default) runs a whole backfill as one run
            (`BackfillPolicy.single_run()`, which `dagster asset materialize
            --partition-range` needs); N splits daemon and UI backfills into runs of at
            most N partitions each (`BackfillPolicy.multi_run(N)`), bounding a run's memory.
        thresholds: Highest acceptable error, empty and truncation rates.
        key_prefix: Prefix of the asset key.
        group_name: Dagster asset group.
        code_version: Your version of the prompt logic; the sampling settings are added
            to it, so changing them marks the asset stale.
        description: Asset description.
        progress_interval_s: Seconds between progress lines in the event log.

    Examples:
        .. code-block:: python

            import dagster as dg
            from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset

            days = dg.DailyPartitionsDefinition(start_date="2024-06-01")

            @dg.asset(partitions_def=days)
            def questions(context) -> pd.DataFrame: ...

            answers = build_generation_asset(
                "answers", upstream=questions, chat=True,
                sampling=SamplingConfig(temperature=0, max_tokens=64),
            )
            defs = dg.Definitions(
                assets=[questions, answers],
                resources={"llm": LLMResource(), "io_manager": ParquetIOManager()},
            )
    """
    upstream_key = upstream.key if isinstance(upstream, dg.AssetsDefinition) else dg.AssetKey.from_coercible(upstream)
    if partitions_def is None and isinstance(upstream, dg.AssetsDefinition):
        partitions_def = upstream.partitions_def
    prefix = [key_prefix] if isinstance(key_prefix, str) else list(key_prefix or [])
    asset_key = dg.AssetKey([*prefix, name])
    default_sampling = sampling or SamplingConfig()
    chooser = PartitionChoice(default_sampling, sampling_by_partition, partitions_def, name, "sampling_by_partition")
    adapters = {adapter_name: str(path) for adapter_name, path in (adapters or {}).items()}
    undeclared = sorted({a for a in [adapter, *(adapter_by_partition or {}).values()] if a is not None} - set(adapters))
    if undeclared:
        raise dg.DagsterInvalidDefinitionError(
            f"{name}: adapter(s) {undeclared} are not declared; add them to adapters={{name: folder}}"
        )
    adapter_chooser = PartitionChoice(adapter, adapter_by_partition, partitions_def, name, "adapter_by_partition")
    # Ids by sorted name: stable across runs and processes.
    lora_requests = {adapter_name: engine.LoRARequest(adapter_name, i + 1, path)
                     for i, (adapter_name, path) in enumerate(sorted(adapters.items()))}
    settings_hash = _digest({
        "sampling": default_sampling.model_dump(),
        "by_partition": {k: v.model_dump() for k, v in (sampling_by_partition or {}).items()},
        "prompt_column": prompt_column, "id_column": id_column, "chat": chat,
        "adapter": adapter, "adapter_by_partition": dict(adapter_by_partition or {}), "adapter_column": adapter_column,
    })
    full_code_version = f"{code_version}+{settings_hash[:12]}"
    schema = dg.TableSchema(columns=[
        dg.TableColumn(f.name, str(f.type), description=COLUMN_DESCRIPTIONS.get(f.name, "Sampling setting used."))
        for f in GENERATION_SCHEMA
    ])
    lineage = dg.TableColumnLineage(deps_by_column={
        "generated_text": [dg.TableColumnDep(asset_key=upstream_key, column_name=prompt_column)],
        "prompt": [dg.TableColumnDep(asset_key=upstream_key, column_name=prompt_column)],
        "id": [dg.TableColumnDep(asset_key=upstream_key, column_name=id_column)],
    })

    @dg.multi_asset(
        name=name if not prefix else "__".join([*prefix, name]),
        specs=[dg.AssetSpec(
            asset_key, deps=[upstream_key], code_version=full_code_version, group_name=group_name,
            description=description or f"LLM completions of {upstream_key.to_user_string()}.{prompt_column}",
            kinds={"parquet"},
        )],
        ins={"prompts": dg.AssetIn(key=upstream_key)},
        check_specs=checks.check_specs(asset_key, partitions_def),
        can_subset=True,
        partitions_def=partitions_def,
        backfill_policy=None if partitions_def is None
        else dg.BackfillPolicy.single_run() if max_partitions_per_run is None
        else dg.BackfillPolicy.multi_run(max_partitions_per_run),
        pool=pool,
        required_resource_keys={resource_key},
    )
    def _generate(context: dg.AssetExecutionContext, config: GenerationRunConfig, prompts: object):
        resource: LLMResource = getattr(context.resources, resource_key)
        keys = list(context.partition_keys) if partitions_def is not None else [None]
        frames = prompts if isinstance(prompts, dict) and len(keys) > 1 else {keys[0]: prompts}
        sampling_of = {key: config.sampling.apply(chooser.for_partition(key)) for key in keys}
        adapter_of = {key: adapter_chooser.for_partition(key) for key in keys}
        tables = {}
        for key in keys:
            where = f"of partition {key!r}" if key is not None else ""
            frame = to_dataframe(frames[key], name, upstream_key.to_user_string())
            check_columns(frame, id_column, prompt_column, name, where)
            tables[key] = frame
        if adapters and not resource.enable_lora:
            raise dg.Failure(f"{name} declares LoRA adapters ({', '.join(sorted(adapters))}), but the resource "
                             f"{resource_key!r} has enable_lora=False: set LLMResource(enable_lora=True, max_loras=..., "
                             f"max_lora_rank=...)")
        for request in lora_requests.values():
            try:
                read_adapter_config(request, resource.max_lora_rank)
            except ValueError as exc:
                raise dg.Failure(f"{name}: {exc}") from exc

        llm = resource.get_llm()
        rows: list[PromptRow] = []
        for key in keys:
            rows += render_rows(tables[key], key, sampling_of[key], id_column=id_column,
                                prompt_column=prompt_column, chat=chat, tokenizer=llm.get_tokenizer(),
                                adapter=adapter_of[key], adapters=list(adapters), adapter_column=adapter_column)
        fingerprints = {}
        for adapter_name in sorted({r.adapter for r in rows if r.adapter is not None and r.error is None}):
            try:
                fingerprints[adapter_name] = llm.add_lora(lora_requests[adapter_name])
            except ValueError as exc:
                raise dg.Failure(f"{name}: {exc}") from exc
        params = [row.sampling.to_sampling_params() for row in rows]
        lora = [lora_requests[r.adapter] if r.adapter in fingerprints else None for r in rows]
        for row, problem in zip(rows, llm.validate([r.rendered for r in rows], params, lora)):
            row.error = row.error or problem
        todo = [i for i, row in enumerate(rows) if row.error is None]
        context.log.info(f"generating {len(todo)} rows ({len(rows) - len(todo)} with errors) "
                         f"for {len(keys)} partition(s) with {resource.model_id}")
        stats = llm.llm_engine.stats
        started = time.perf_counter()
        results = llm.generate([rows[i].rendered for i in todo], [params[i] for i in todo],
                               lora_request=[lora[i] for i in todo],
                               use_tqdm=EventLogProgress(context.log, lambda: stats.num_generated_tokens,
                                                         progress_interval_s))
        elapsed = time.perf_counter() - started
        outputs: list[engine.RequestOutput | None] = [None] * len(rows)
        for i, out in zip(todo, results):
            outputs[i] = out

        fingerprint = llm.model_fingerprint
        root = Path(output_dir or Path(os.environ.get("DAGSTER_LLM_OUTPUT_DIR", "output")) / "generations")
        generated_tokens = sum(len(o.outputs[0].token_ids) for o in results)
        run_metadata = {
            "model_id": resource.model_id,
            "model_fingerprint": fingerprint,
            "engine_version": engine.__version__,
            "elapsed_s": round(elapsed, 3),
            "generated_tokens_per_s": round(generated_tokens / elapsed, 1) if elapsed > 0 else 0.0,
            "partitions_in_run": len(keys),
        }
        versions = {}
        for key in keys:
            part_rows = [(r, o) for r, o in zip(rows, outputs) if r.partition == key]
            table = generation_table([r for r, _ in part_rows], [o for _, o in part_rows], resource.model_id)
            path = partition_file(root, asset_key, key)
            write_parquet_atomically(table, path)
            upstream_version = _upstream_data_version(context, upstream_key, key)
            versions[key] = _digest([(r.id, r.prompt_text, r.sampling.model_dump(), r.adapter,
                                      fingerprints.get(r.adapter)) for r, _ in part_rows])
            used = sorted({r.adapter for r, _ in part_rows if r.adapter in fingerprints})
            metadata = {
                **_table_metadata(table, path, schema, lineage),
                **run_metadata,
                "adapter": adapter_of[key] or "none",
                "adapter_fingerprints": dg.MetadataValue.json({a: fingerprints[a] for a in used}),
                "sampling_config": dg.MetadataValue.json(sampling_of[key].model_dump()),
                "upstream_data_version": upstream_version or "unknown",
            }
            if key is None:
                run_metadata = metadata
            else:
                context.add_asset_metadata(metadata, partition_key=key)
            for check_name, (passed, check_metadata) in checks.evaluate(table, thresholds).items():
                # A one-partition run reports plain results, which Dagster counts as the check
                # outputs; a range needs one evaluation per partition.
                if len(keys) == 1:
                    yield dg.AssetCheckResult(asset_key=asset_key, check_name=check_name, passed=passed,
                                              metadata=check_metadata)
                else:
                    yield dg.AssetCheckEvaluation(asset_key=asset_key, check_name=check_name, passed=passed,
                                                  partition=key, metadata=check_metadata)
        # Over what was read, not the upstream's data version, which an upstream without
        # versioning of its own changes on every materialization even when the rows do not.
        data_version = _digest({"code_version": full_code_version, "model": fingerprint, "partitions": versions})
        yield dg.MaterializeResult(
            asset_key=asset_key,
            metadata={**run_metadata, "data_version_scope": "per run" if len(keys) > 1 else "per partition"},
            data_version=dg.DataVersion(data_version[:24]),
        )

    return _generate


def _table_metadata(table: pa.Table, path: Path, schema: dg.TableSchema, lineage: dg.TableColumnLineage) -> dict:
    ok = table.filter(pc.is_null(table["error"]))
    reasons = collections.Counter(ok["finish_reason"].to_pylist())
    return {
        "dagster/row_count": table.num_rows,
        "dagster/column_schema": schema,
        "dagster/column_lineage": lineage,
        "path": dg.MetadataValue.path(str(path.resolve())),
        "prompt_tokens": int(pc.sum(ok["prompt_tokens"]).as_py() or 0),
        "completion_tokens": int(pc.sum(ok["completion_tokens"]).as_py() or 0),
        "finish_reasons": dg.MetadataValue.json(dict(reasons)),
        "error_rows": table.num_rows - ok.num_rows,
        "preview": dg.MetadataValue.md(
            pd.DataFrame({"id": table["id"].to_pylist()[:5],
                          "generated_text": [(t or "")[:80] for t in table["generated_text"].to_pylist()[:5]]})
            .to_markdown(index=False) if table.num_rows else "(no rows)"
        ),
    }


def _upstream_data_version(context: dg.AssetExecutionContext, key: dg.AssetKey, partition: str | None) -> str | None:
    """The data version of the upstream partition this run reads."""
    record = context.instance.get_latest_data_version_record(key, partition_key=partition)
    if record is None:
        return None
    event = record.event_log_entry.asset_materialization or record.event_log_entry.asset_observation
    return (event.tags or {}).get("dagster/data_version") if event else None


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
