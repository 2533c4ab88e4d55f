"""`build_openai_batch_asset`: a table of OpenAI Batch API requests in (a batch file's
lines as rows), a table of their responses out, per partition.

The asset body is glue: resources in, `dagster_llm.core.openai_batch` checks the rows, runs
them and writes through the IO manager's table store, and each committed partition becomes
a materialization with its error-rows check.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pyarrow as pa
from pydantic import ConfigDict, Field, model_validator

from dagster_llm.core.generation import digest
from dagster_llm.core.openai_batch import (
    COLUMNS, ERROR_CHECK, ERROR_CHECK_DESCRIPTION, OUTPUT_SCHEMA, BatchEngines, BatchResult, Engine, OpenAIBatchRun,
    RequestPartition, RequestTableError, evaluate_errors, table_rows,
)
from dagster_llm.core.watch import ParentWatch
from dagster_llm.metadata import upstream_data_version
from dagster_llm.resource import LLMResource
from dagster_llm.spec import AssetKeys
from dagster_llm.steps import PartitionedStep, table_asset

PREVIEW_ROWS = 10


class OpenAIBatchSpec(AssetKeys):
    """An OpenAI batch asset: an upstream table of batch requests in, one response row per request out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The asset's name.")
    upstream: str = Field(description="Asset key of the request table, e.g. 'requests' or 'raw/requests' (the factory "
                                      "also takes an AssetKey or the upstream AssetsDefinition).")
    resource_key: str = Field(default="llm", description="The LLMResource of the chat and completion rows.")
    embedding_resource_key: str | None = Field(
        default=None, description="The LLMResource of the /v1/embeddings rows: LLMResource(runner='pooling') or an "
                                  "embedding model (None: those rows are errors that say to set it).")
    max_error_fraction: float = Field(default=0.0, ge=0, le=1, description="Error rows above this share of a "
                                                                           "partition's rows fail its no_error_rows "
                                                                           "check.")
    io_manager_key: str = Field(default="io_manager", description="The IO manager of the output table.")
    key_prefix: list[str] = Field(default_factory=list, description="Prefix of the asset key.")
    group_name: str | None = Field(default=None, description="Asset group.")
    description: str | None = Field(default=None, description="Asset description.")
    code_version: str = Field(default="1", description="Your version of the asset; the settings that change the "
                                                       "table are added to it, so changing them marks it stale.")
    pool: str | None = Field(default="llm", description="Dagster concurrency pool the step claims a slot of.")

    @model_validator(mode="after")
    def _two_resources(self) -> "OpenAIBatchSpec":
        if self.embedding_resource_key == self.resource_key:
            raise ValueError(f"embedding_resource_key: {self.resource_key!r} is also resource_key, and one resource "
                             "loads one model: give the embedding rows their own LLMResource(runner='pooling')")
        return self

    def settings_digest(self) -> str:
        """Digest of what changes the table: the code version, whether embedding rows run,
        and the table's columns (the models enter each partition's data version)."""
        return digest({"code_version": self.code_version, "embeds": self.embedding_resource_key is not None,
                       "columns": str(OUTPUT_SCHEMA)})


def build_openai_batch_asset(name: str, upstream: str | dg.AssetKey | dg.AssetsDefinition, *,
                             partitions_def: dg.PartitionsDefinition | None = None,
                             **options: Any) -> dg.AssetsDefinition:
    """Builds an asset that runs an upstream table of OpenAI Batch API requests, per partition,
    as `python -m engine.run_batch` runs a batch file.

    The upstream asset gives a pandas DataFrame or pyarrow Table per partition (a
    `{partition_key: table}` dict for a range): one row per line of a batch file, with
    `custom_id`, `body` (the request body: a dict, or its JSON text), and optionally `url`
    (default "/v1/chat/completions") and `method`; `read_openai_batch_file(path)` reads a
    JSONL file into one. Every row is checked first; a bad one becomes an error row
    (`error_code` and `error_message`, OpenAI's codes) and the others run: the chat and
    completion rows of the run's partitions in one engine call on `resource_key`, then the
    embedding rows on `embedding_resource_key`.

    The output table (one row per request, in input order: `custom_id`, `url`,
    `status_code`, `response` (the response body's JSON text, as run_batch writes it),
    `error_code`, `error_message`, and the first choice's `content`, `reasoning`,
    `tool_calls` and `finish_reason`, the usage, the first `embedding`, the `model`) goes
    through the IO manager; with `ParquetIOManager` each partition of a range commits as
    soon as its rows are done. A partition's data version digests its requests, the models'
    weights and the code version. The `no_error_rows` check fails when more than
    `max_error_fraction` of a partition's rows are errors.

    Args:
        name: The asset's name.
        upstream: The request table asset (its partitions_def is reused when it has one).
        partitions_def: The asset's partitions (default: the upstream asset's).
        **options: `OpenAIBatchSpec`'s fields (resource_key, embedding_resource_key,
            max_error_fraction, io_manager_key, key_prefix, group_name, description,
            code_version, pool).

    Raises:
        DagsterInvalidDefinitionError: an unknown option or a bad value, naming each.
    """
    if partitions_def is None and isinstance(upstream, dg.AssetsDefinition):
        partitions_def = upstream.partitions_def
    spec = OpenAIBatchSpec.from_options(name, upstream, options)
    return openai_batch_asset(spec, partitions_def)


def openai_batch_asset(spec: OpenAIBatchSpec, partitions_def: dg.PartitionsDefinition | None) -> dg.AssetsDefinition:
    """The asset of a spec."""
    code_version = f"{spec.code_version}+{spec.settings_digest()[:12]}"

    @table_asset(spec, partitions_def, code_version=code_version,
                 default_description=f"OpenAI batch responses of the requests in {spec.upstream}",
                 column_schema=column_schema(), input_name="requests", checks={ERROR_CHECK: ERROR_CHECK_DESCRIPTION},
                 resource_keys=[spec.resource_key, *filter(None, [spec.embedding_resource_key])])
    def _run_requests(context: dg.AssetExecutionContext, requests: object):
        yield from _OpenAIBatchStep(spec, context, code_version, partitions_def is not None).execute(requests)

    return _run_requests


class _OpenAIBatchStep(PartitionedStep):
    """One execution of an OpenAI batch asset: locks, the run, and its events."""

    def __init__(self, spec: OpenAIBatchSpec, context: dg.AssetExecutionContext, code_version: str,
                 partitioned: bool) -> None:
        super().__init__(context, spec.name, spec.asset_key, spec.io_manager_key, partitioned, code_version)
        self.spec = spec

    def execute(self, requests: object) -> Iterator[object]:
        frames = self.frames(requests, self.spec.upstream)
        parts = []
        try:
            for key in self.keys:
                where = f"of partition {key!r} " if key is not None else ""
                files = self.store.partition(self.asset_key.path, key) if self.store else None
                parts.append(RequestPartition(key, table_rows(frames[key], where), files))
        except RequestTableError as exc:
            raise dg.Failure(f"{self.spec.name}: {exc}; nothing was run") from None
        with self.locks():
            run = OpenAIBatchRun(self._engines(), self.code_version, self.context.log.info, ParentWatch().check)
            yield from self.record(run.run(parts), lambda result: self.committed(
                result, self._metadata(result, run),
                {ERROR_CHECK: evaluate_errors(result.table, self.spec.max_error_fraction)}))
        yield from self.outputs()

    def _engines(self) -> BatchEngines:
        """The generating resource, and the embedding one where the asset has it."""
        generator = self._engine(self.spec.resource_key)
        embedder = self._engine(self.spec.embedding_resource_key) if self.spec.embedding_resource_key else None
        return BatchEngines(generator, embedder)

    def _engine(self, resource_key: str) -> Engine:
        resource: LLMResource = getattr(self.context.resources, resource_key)
        return Engine(resource.model_id, f"the resource {resource_key!r}", resource.get_llm,
                      release=resource.release)

    def _metadata(self, result: BatchResult, run: OpenAIBatchRun) -> dict[str, object]:
        """A partition's materialization metadata: its rows, tokens and models (with the
        output settings each resolved: its reasoning and tool-call parsers among them)."""
        stats = result.stats
        upstream = self.spec.upstream_key
        lineage = dg.TableColumnLineage(deps_by_column={
            name: [dg.TableColumnDep(asset_key=upstream, column_name=name if name in ("custom_id", "url") else "body")]
            for name in COLUMNS if name not in ("status_code", "error_code", "error_message")})
        metadata: dict[str, object] = {
            "dagster/row_count": stats.rows, "dagster/column_schema": column_schema(),
            "dagster/column_lineage": lineage, "ok_rows": stats.ok_rows, "error_rows": stats.error_rows,
            "error_codes": dg.MetadataValue.json(stats.error_codes), "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "model": self._model_id(self.spec.resource_key),
            "embedding_model": self._model_id(self.spec.embedding_resource_key),
            "models_loaded": dg.MetadataValue.json(run.models),
            "engine_output_settings": dg.MetadataValue.json(run.output_settings), "elapsed_s": stats.elapsed_s,
            "data_version": result.data_version, "preview": dg.MetadataValue.md(preview_markdown(result.table)),
            "upstream_data_version": upstream_data_version(self.context, upstream, result.key) or "unknown",
        }
        if self.store is not None:
            metadata["path"] = dg.MetadataValue.path(self.store.partition(self.asset_key.path, result.key).location)
        return metadata

    def _model_id(self, resource_key: str | None) -> str:
        return getattr(self.context.resources, resource_key).model_id if resource_key else "none"


def column_schema() -> dg.TableSchema:
    """The output table's columns and their descriptions."""
    return dg.TableSchema(columns=[dg.TableColumn(name, str(kind), description=text)
                                   for name, (kind, text) in COLUMNS.items()])


def preview_markdown(table: pa.Table, rows: int = PREVIEW_ROWS) -> str:
    """The first rows as a Markdown table: custom_id, url, the content (or the vector's
    width, or the error) and the finish reason."""
    lines = ["| custom_id | url | content or error | finish |", "|---|---|---|---|"]
    for row in table.slice(0, rows).to_pylist():
        if row["error_code"] is not None:
            text = f"{row['error_code']}: {row['error_message']}"
        elif row["embedding"] is not None:
            text = f"embedding of {len(row['embedding'])} floats"
        else:
            text = row["content"]
        lines.append("| " + " | ".join(_cell(v) for v in (row["custom_id"], row["url"], text,
                                                           row["finish_reason"])) + " |")
    more = table.num_rows - min(rows, table.num_rows)
    return "\n".join(lines) + (f"\n\n{more} more rows in the table." if more else "")


def _cell(value: object, keep: int = 200) -> str:
    """A Markdown table cell: one line, pipes escaped, long text cut."""
    text = " ".join(("" if value is None else str(value)).split()).replace("|", "\\|")
    return text if len(text) <= keep else text[:keep] + " …"
