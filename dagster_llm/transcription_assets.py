"""`build_transcription_asset`: a table of audio clips in, a transcript table out, per partition.

The asset body is glue: run config and resources in, `dagster_llm.core.transcription` does
the work and writes through the IO manager's table store, and each committed partition
becomes a materialization with its checks.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pyarrow as pa
from pydantic import Field

from dagster_llm.core.generation import digest
from dagster_llm.core.media import audio_column, read_column
from dagster_llm.core.transcription import (
    CHECKS, COLUMNS, ClipPartition, TranscriptionOptions, TranscriptionResult, TranscriptionRun, clip_rows,
    evaluate_transcripts,
)
from dagster_llm.core.watch import ParentWatch
from dagster_llm.metadata import upstream_data_version
from dagster_llm.resource import LLMResource
from dagster_llm.steps import PartitionedStep, table_asset
from dagster_llm.transcription_spec import TranscriptionSpec

# Settings of the spec that do not change the table.
_OPERATIONAL = {"description", "group_name", "pool", "resource_key", "io_manager_key", "shard_rows", "reuse_rows"}


class TranscriptionRunConfig(dg.Config):
    """Run config of a transcript asset."""

    resume: bool = Field(
        default=True,
        description="Reuse rows already transcribed for a partition's current data version (committed or in shards "
                    "of an interrupted run) and committed rows of the same clip and settings; false transcribes "
                    "every row again.")


def build_transcription_asset(name: str, upstream: str | dg.AssetKey | dg.AssetsDefinition, *,
                              partitions_def: dg.PartitionsDefinition | None = None,
                              **options: Any) -> dg.AssetsDefinition:
    """Builds an asset that transcribes (or translates to English) an audio column of an
    upstream table with a speech-to-text model, per partition.

    The upstream asset gives a pandas DataFrame or pyarrow Table per partition (a
    `{partition_key: table}` dict for a range) with an id column and an audio column (one
    clip per row). Every clip is read and checked before any work; a clip longer than the
    model's window (Whisper's 30 s) is cut into windows at quiet points, as
    `LLM.transcribe` cuts it, and all windows of all rows run in one engine call. The
    transcript table (`id`, `text`, `language`, `duration_s`, `windows`,
    `completion_tokens`, `audio_digest`, `model`, `error`) goes through the IO manager, one
    Parquet file per partition. With `ParquetIOManager`, rows are saved in shards as they
    finish and a rerun after a crash transcribes only what is missing; a row whose clip and
    settings match a committed row of the asset is reused. A partition's data version
    digests its ids and clips' contents, the model's files, the settings and the code
    version. A row that cannot run (null or repeated id, an unreadable, empty or missing
    clip, several clips) gets its `error`; the others run. Checks per partition: no error
    rows, no empty transcript, unique ids.

    Args:
        name: The asset's name.
        upstream: The table of clips (its partitions_def is reused when it has one).
        partitions_def: The asset's partitions (default: the upstream asset's).
        **options: `TranscriptionSpec`'s fields (audio_column, language, task, resource_key, ...).

    Raises:
        DagsterInvalidDefinitionError: an unknown option or a bad value, naming each.
    """
    if partitions_def is None and isinstance(upstream, dg.AssetsDefinition):
        partitions_def = upstream.partitions_def
    return transcription_asset(TranscriptionSpec.from_options(name, upstream, options), partitions_def)


def transcription_asset(spec: TranscriptionSpec, partitions_def: dg.PartitionsDefinition | None
                        ) -> dg.AssetsDefinition:
    """The asset of a spec."""
    code_version = f"{spec.code_version}+{digest(spec.model_dump(exclude=_OPERATIONAL))[:12]}"

    @table_asset(spec, partitions_def, code_version=code_version,
                 default_description=f"Transcripts of {spec.upstream}.{spec.audio_column}",
                 column_schema=_column_schema(), input_name="clips", checks=CHECKS, resource_keys=[spec.resource_key])
    def _transcribe(context: dg.AssetExecutionContext, config: TranscriptionRunConfig, clips: object):
        yield from _TranscriptionStep(spec, context, config, code_version, partitions_def is not None).execute(clips)

    return _transcribe


class _TranscriptionStep(PartitionedStep):
    """One execution of a transcript asset: locks, the run, and its events."""

    def __init__(self, spec: TranscriptionSpec, context: dg.AssetExecutionContext, config: TranscriptionRunConfig,
                 code_version: str, partitioned: bool) -> None:
        super().__init__(context, spec.name, spec.asset_key, spec.io_manager_key, partitioned, code_version)
        self.spec = spec
        self.config = config
        self.resource: LLMResource = getattr(context.resources, spec.resource_key)

    def execute(self, clips: object) -> Iterator[object]:
        frames = self.frames(clips, self.spec.upstream, {"id_column": self.spec.id_column,
                                                          "audio_column": self.spec.audio_column},
                             "table of clips", "transcript")
        with self.locks():
            llm = self.resource.get_llm()
            spec = self.spec
            options = TranscriptionOptions(
                model_id=self.resource.model_id, code_version=self.code_version, language=spec.language,
                task=spec.task, prompt=spec.prompt, max_tokens=spec.max_tokens, resume=self.config.resume,
                reuse_rows=spec.reuse_rows, shard_rows=spec.shard_rows)
            try:
                run = TranscriptionRun(llm, options, self.context.log.info, ParentWatch().check)
            except ValueError as exc:
                raise dg.Failure(f"{spec.name}: {exc}; nothing was run") from None
            column = audio_column(llm.audio_limits)
            parts = [ClipPartition(key, clip_rows(frames[key][spec.id_column].tolist(),
                                                  read_column(frames[key][spec.audio_column].tolist(), column),
                                                  spec.audio_column),
                                   self.store.partition(self.asset_key.path, key) if self.store else None)
                     for key in self.keys]
            yield from self.record(run.transcribe(parts), self._committed)
        yield from self.outputs()

    def _committed(self, result: TranscriptionResult) -> Iterator[object]:
        """The partition's metadata and check outcomes, recorded (`PartitionedStep.committed`)."""
        llm = self.resource.get_llm()
        return self.committed(result, self._metadata(result, llm.model_fingerprint, llm.output_settings),
                              evaluate_transcripts(result.table))

    def _metadata(self, result: TranscriptionResult, fingerprint: str, output_settings: dict) -> dict[str, object]:
        stats = result.stats
        location = self.store.partition(self.asset_key.path, result.key).location if self.store else None
        audio = [dg.TableColumnDep(asset_key=self.spec.upstream_key, column_name=self.spec.audio_column)]
        lineage = dg.TableColumnLineage(deps_by_column={
            **{name: audio for name in ("text", "language", "duration_s", "windows", "audio_digest")},
            "id": [dg.TableColumnDep(asset_key=self.spec.upstream_key, column_name=self.spec.id_column)],
        })
        metadata: dict[str, object] = {
            "dagster/row_count": stats.rows, "dagster/column_schema": _column_schema(),
            "dagster/column_lineage": lineage, "error_rows": stats.error_rows, "resumed_rows": stats.resumed_rows,
            "reused_rows": stats.reused_rows, "transcribed_rows": stats.transcribed_rows, "windows": stats.windows,
            "audio_seconds": stats.audio_seconds, "completion_tokens": stats.completion_tokens,
            "audio_encoder_runs": stats.audio_encoder_runs,
            "model": self.resource.model_id, "model_fingerprint": fingerprint,
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
    return dg.TableSchema(columns=[dg.TableColumn(name, str(kind), description=text)
                                   for name, (text, kind) in COLUMNS.items()])


def _preview(table: pa.Table, rows: int = 5) -> str:
    """The first rows as a Markdown table: id, duration, the transcript's head (or the error)."""
    frame = table.slice(0, rows).select(["id", "duration_s", "text", "error"]).to_pandas()
    frame["text"] = [f"error: {e}" if e is not None else (t if len(t) <= 120 else t[:117] + "...")
                     for t, e in zip(frame["text"], frame["error"])]
    return frame.drop(columns="error").to_markdown(index=False) if len(frame) else "(no rows)"
