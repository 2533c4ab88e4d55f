"""What a generation asset shows in Dagster: its column schema and lineage, a preview of
the first rows, and each partition's materialization metadata."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
import pyarrow as pa

import engine
from dagster_llm.core.generation import PartitionResult
from dagster_llm.core.schema import ToolArguments, column_descriptions, generation_schema, output_columns, tool_columns
from dagster_llm.core.structured import StructuredOutput
from dagster_llm.spec import GenerationSpec


@dataclass(frozen=True)
class PartitionFacts:
    """What a partition's metadata says beside its result: the asset, where the table is
    (None: another IO manager stores it), the model, and the partition's own settings
    (`sampling_used`: the values its rows were generated with, the model's defaults included;
    `tool`: the argument columns of the asset's one declared tool)."""

    spec: GenerationSpec
    output: StructuredOutput | None
    tool: ToolArguments | None
    location: str | None
    model_id: str
    model_fingerprint: str
    output_settings: dict[str, Any]
    partitions_in_run: int
    adapter: str | None
    sampling_used: dict[str, Any]
    upstream_data_version: str | None


def column_schema(output: StructuredOutput | None, media: Sequence[str] = (),
                  tool: ToolArguments | None = None) -> dg.TableSchema:
    """The generation table's columns (with a structured output's typed columns, the digests
    of each modality the prompts have a column of, and the tool's argument columns) and their
    descriptions."""
    descriptions = column_descriptions(output, tool)
    return dg.TableSchema(columns=[
        dg.TableColumn(f.name, str(f.type), description=descriptions[f.name])
        for f in generation_schema(output, media, tool)
    ])


def table_metadata(table: pa.Table, spec: GenerationSpec, output: StructuredOutput | None,
                   tool: ToolArguments | None) -> dict[str, object]:
    """Row count, column schema, column lineage (every generated column comes from the
    prompt, and from the images and clips where there are some) and the preview."""
    def from_columns(*columns: str) -> list[dg.TableColumnDep]:
        return [dg.TableColumnDep(asset_key=spec.upstream_key, column_name=column) for column in columns]

    generated = [spec.prompt_column, *spec.media_columns.values()]
    typed = (*output_columns(output), *tool_columns(tool))
    derived = ["reasoning", "tool_calls", *(column.name for column in typed)]
    lineage = dg.TableColumnLineage(deps_by_column={
        "generated_text": from_columns(*generated),
        "prompt": from_columns(spec.prompt_column),
        "id": from_columns(spec.id_column),
        **{f"{modality}_digests": from_columns(column) for modality, column in spec.media_columns.items()},
        **{name: from_columns(*generated) for name in derived},
    })
    return {
        "dagster/row_count": table.num_rows,
        "dagster/column_schema": column_schema(output, tuple(spec.media_columns), tool),
        "dagster/column_lineage": lineage,
        "preview": dg.MetadataValue.md(preview_markdown(table)),
    }


def partition_metadata(result: PartitionResult, run: PartitionFacts) -> dict[str, object]:
    """One partition's materialization metadata: its table, what the run did for it, and
    the settings it was generated with."""
    stats = result.stats
    output = run.output
    return {
        **table_metadata(result.table, run.spec, output, run.tool),
        "path": dg.MetadataValue.path(run.location) if run.location else "(stored by the IO manager)",
        "model_id": run.model_id,
        "model_fingerprint": run.model_fingerprint,
        "engine_output_settings": dg.MetadataValue.json(run.output_settings),
        "engine_version": engine.__version__,
        "partitions_in_run": run.partitions_in_run,
        "elapsed_s": stats.elapsed_s,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "reasoning_tokens": stats.reasoning_tokens,
        "tool_call_rows": stats.tool_call_rows,
        "generated_rows": stats.generated_rows,
        "generated_tokens": stats.generated_tokens,
        "resumed_rows": stats.resumed_rows,
        "reused_rows": stats.reused_rows,
        "error_rows": stats.error_rows,
        "finish_reasons": dg.MetadataValue.json(stats.finish_reasons),
        **({"speculative_decoding": dg.MetadataValue.json(stats.speculation)} if stats.speculation else {}),
        "adapter": run.adapter or "none",
        "adapter_fingerprints": dg.MetadataValue.json(stats.adapter_fingerprints),
        "sampling_config": dg.MetadataValue.json(run.sampling_used),
        **({"structured_output": dg.MetadataValue.json(output.describe())} if output is not None else {}),
        "data_version": result.data_version,
        "upstream_data_version": run.upstream_data_version or "unknown",
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


def upstream_data_version(context: dg.AssetExecutionContext, key: dg.AssetKey, partition: str | None) -> str | None:
    """The data version of the upstream partition this run reads, as its own page shows it.

    Dagster's tag `dagster/input_data_version/<upstream>` differs on purpose: it is the
    sha256 of the data versions of all the upstream partitions a step read, concatenated.
    """
    record = context.instance.get_latest_data_version_record(key, partition_key=partition)
    if record is None:
        return None
    event = record.event_log_entry.asset_materialization or record.event_log_entry.asset_observation
    return (event.tags or {}).get("dagster/data_version") if event else None
