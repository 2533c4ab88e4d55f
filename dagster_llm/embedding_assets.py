"""`build_embedding_asset`: a text table in, an embedding table out, per partition.

The asset body is glue: run config and resources in, `dagster_llm.core.embedding` does
the work and writes through the IO manager's table store, and each committed partition
becomes a materialization with its checks.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pyarrow as pa
from pydantic import Field

from dagster_llm.core.embedding import (
    CHECKS, COLUMNS, EmbeddingOptions, EmbeddingResult, EmbeddingRun, TextPartition, evaluate_embeddings, text_rows,
)
from dagster_llm.core.generation import digest
from dagster_llm.core.watch import ParentWatch
from dagster_llm.embedding_spec import EmbeddingSpec
from dagster_llm.metadata import upstream_data_version
from dagster_llm.resource import LLMResource
from dagster_llm.steps import PartitionedStep, table_asset


class EmbeddingRunConfig(dg.Config):
    """Run config of an embedding asset."""

    resume: bool = Field(
        default=True,
        description="Reuse rows already embedded for a partition's current data version (committed or in shards "
                    "of an interrupted run); false embeds every row again.")


def build_embedding_asset(name: str, upstream: str | dg.AssetKey | dg.AssetsDefinition, *,
                          partitions_def: dg.PartitionsDefinition | None = None,
                          **options: Any) -> dg.AssetsDefinition:
    """Builds an asset that embeds a text column of an upstream table, per partition.

    The upstream asset gives a pandas DataFrame or pyarrow Table per partition (a
    `{partition_key: table}` dict for a range) with an id column and a text column. The
    embedding table (`id`, `embedding` as a fixed-size list of float32, `model`,
    `prompt_tokens`, `error`) goes through the IO manager, one Parquet file per partition,
    so downstream assets take it as an input. With `ParquetIOManager`, rows are saved in
    shards as they are embedded and a rerun after a crash embeds only what is missing;
    each partition of a range commits as soon as its rows are done. A partition's data
    version digests its ids and texts, the model weights and the settings. A row that
    cannot run (null id or text, repeated id, too long) gets its `error`; the others run.
    Checks per partition: no error rows, no empty or non-finite vector, the model's
    dimension, unique ids.

    The resource (`resource_key`, default "embedder") must load a pooling model: an
    embedding or sentence-transformers checkpoint, or a causal LM with `runner="pooling"`.

    Args:
        name: The asset's name.
        upstream: The text table asset (its partitions_def is reused when it has one).
        partitions_def: The asset's partitions (default: the upstream asset's).
        **options: `EmbeddingSpec`'s fields (text_column, id_column, normalize, resource_key, ...).

    Raises:
        DagsterInvalidDefinitionError: an unknown option or a bad value, naming each.
    """
    if partitions_def is None and isinstance(upstream, dg.AssetsDefinition):
        partitions_def = upstream.partitions_def
    return embedding_asset(EmbeddingSpec.from_options(name, upstream, options), partitions_def)


def embedding_asset(spec: EmbeddingSpec, partitions_def: dg.PartitionsDefinition | None) -> dg.AssetsDefinition:
    """The asset of a spec."""
    code_version = f"{spec.code_version}+{digest(spec.model_dump(exclude={'description', 'group_name', 'pool'}))[:12]}"

    @table_asset(spec, partitions_def, code_version=code_version,
                 default_description=f"Embeddings of {spec.upstream}.{spec.text_column}",
                 column_schema=_column_schema(), input_name="texts", checks=CHECKS, resource_keys=[spec.resource_key])
    def _embed(context: dg.AssetExecutionContext, config: EmbeddingRunConfig, texts: object):
        yield from _EmbeddingStep(spec, context, config, code_version, partitions_def is not None).execute(texts)

    return _embed


class _EmbeddingStep(PartitionedStep):
    """One execution of an embedding asset: locks, the run, and its events."""

    def __init__(self, spec: EmbeddingSpec, context: dg.AssetExecutionContext, config: EmbeddingRunConfig,
                 code_version: str, partitioned: bool) -> None:
        super().__init__(context, spec.name, spec.asset_key, spec.io_manager_key, partitioned, code_version)
        self.spec = spec
        self.config = config
        self.resource: LLMResource = getattr(context.resources, spec.resource_key)

    def execute(self, texts: object) -> Iterator[object]:
        frames = self.frames(texts, self.spec.upstream, {"id_column": self.spec.id_column,
                                                          "text_column": self.spec.text_column},
                             "text table", "embedding")
        with self.locks():
            llm = self.resource.get_llm()
            if llm.task != "embed":
                raise dg.Failure(f"{self.spec.name}: the resource {self.spec.resource_key!r} loads a model that does "
                                 "not embed; give it an embedding model, or runner='pooling' for a causal LM")
            options = EmbeddingOptions(model_id=self.resource.model_id, code_version=self.code_version,
                                       normalize=self.spec.normalize, resume=self.config.resume,
                                       shard_rows=self.spec.shard_rows)
            run = EmbeddingRun(llm, options, self.context.log.info, ParentWatch().check)
            parts = [TextPartition(key, text_rows(frames[key][self.spec.id_column].tolist(),
                                                  frames[key][self.spec.text_column].tolist()),
                                   self.store.partition(self.asset_key.path, key) if self.store else None)
                     for key in self.keys]
            yield from self.record(run.embed(parts), self._committed)
        yield from self.outputs()

    def _committed(self, result: EmbeddingResult) -> Iterator[object]:
        """The partition's metadata and check outcomes, recorded (`PartitionedStep.committed`)."""
        llm = self.resource.get_llm()
        return self.committed(result, self._metadata(result, llm.model_fingerprint, llm.output_settings),
                              evaluate_embeddings(result.table, llm.hidden_size))

    def _metadata(self, result: EmbeddingResult, fingerprint: str, output_settings: dict) -> dict[str, object]:
        stats = result.stats
        location = self.store.partition(self.asset_key.path, result.key).location if self.store else None
        lineage = dg.TableColumnLineage(deps_by_column={
            "embedding": [dg.TableColumnDep(asset_key=self.spec.upstream_key, column_name=self.spec.text_column)],
            "id": [dg.TableColumnDep(asset_key=self.spec.upstream_key, column_name=self.spec.id_column)],
        })
        metadata: dict[str, object] = {
            "dagster/row_count": stats.rows, "dagster/column_schema": _column_schema(),
            "dagster/column_lineage": lineage, "error_rows": stats.error_rows, "resumed_rows": stats.resumed_rows,
            "embedded_rows": stats.embedded_rows, "prompt_tokens": stats.prompt_tokens,
            "dimension": stats.dimension, "model": self.resource.model_id, "model_fingerprint": fingerprint,
            "engine_output_settings": dg.MetadataValue.json(output_settings),
            "elapsed_s": stats.elapsed_s, "data_version": result.data_version,
            "preview": dg.MetadataValue.md(_preview(result.table)),
        }
        upstream = upstream_data_version(self.context, self.spec.upstream_key, result.key)
        if upstream is not None:
            metadata["upstream_data_version"] = upstream
        if location is not None:
            metadata["path"] = dg.MetadataValue.path(location)
        return metadata


def _column_schema() -> dg.TableSchema:
    """The embedding table's columns (the vector's width is the model's, known once it loads)."""
    types = {"id": "string", "embedding": "fixed_size_list<float32>", "model": "string", "prompt_tokens": "int32",
             "error": "string"}
    return dg.TableSchema(columns=[dg.TableColumn(name, types[name], description=text)
                                   for name, text in COLUMNS.items()])


def _preview(table: pa.Table, rows: int = 5) -> str:
    """The first rows as a Markdown table, each vector cut to its first three values."""
    frame = table.slice(0, rows).to_pandas()
    frame["embedding"] = [None if v is None else "[" + ", ".join(f"{x:.3f}" for x in v[:3]) + ", ...]"
                          for v in frame["embedding"]]
    return frame.to_markdown(index=False)
