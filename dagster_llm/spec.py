"""`GenerationSpec`: every option of a generation asset, declared once.

The factory's keyword arguments and docs, the component's fields, the prompt-table rules,
the check thresholds, the column schema and the settings digest of the code version are all
read from this model. A new option is one field here (plus its use and its test); it joins
the code version unless it is marked `operational` (it does not change the table's data).
"""

import json
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import BaseModel, Field, ValidationError, field_validator

from dagster_llm.core.checks import CheckThresholds
from dagster_llm.core.generation import digest
from dagster_llm.core.prompts import PromptTableRules
from dagster_llm.core.sampling import BeamSearchConfig, SamplingConfig
from dagster_llm.kubernetes import KubernetesStep

_OPERATIONAL = {"operational": True}


def _operational(default: Any, description: str) -> Any:
    """A field that says how the asset runs or is shown, not what its table holds."""
    return Field(default=default, description=description, json_schema_extra=_OPERATIONAL)


class AssetKeys(BaseModel):
    """The asset key and the upstream's of a spec that declares `name`, `upstream` (an
    asset key string, or an AssetKey or AssetsDefinition turned into one) and `key_prefix`
    (a string is one level). The fields stay the spec's own, where its options list them."""

    @field_validator("upstream", mode="before", check_fields=False)
    @classmethod
    def _upstream_key(cls, value: object) -> object:
        if isinstance(value, dg.AssetsDefinition):
            value = value.key
        return value.to_user_string() if isinstance(value, dg.AssetKey) else value

    @field_validator("key_prefix", mode="before", check_fields=False)
    @classmethod
    def _one_level(cls, value: object) -> object:
        return [value] if isinstance(value, str) else [] if value is None else value

    @classmethod
    def from_options(cls, name: str, upstream: object, options: dict[str, Any]) -> Any:
        """The spec of a factory's arguments.

        Raises:
            DagsterInvalidDefinitionError: naming the asset and each bad option with its value.
        """
        try:
            return cls(name=name, upstream=upstream, **options)
        except ValidationError as exc:
            problems = [f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}, got {e['input']!r:.200}"
                        for e in exc.errors()]
            raise dg.DagsterInvalidDefinitionError(f"{name}: " + "; ".join(problems)) from None

    @property
    def asset_key(self) -> dg.AssetKey:
        return dg.AssetKey([*self.key_prefix, self.name])

    @property
    def upstream_key(self) -> dg.AssetKey:
        return dg.AssetKey.from_user_string(self.upstream)


class GenerationSpec(CheckThresholds, PromptTableRules, AssetKeys):
    """A generation asset: an upstream prompt table in, one completion per row out."""

    name: str = _operational(..., "The generation asset's name.")
    upstream: str = _operational(..., "Asset key of the prompt table, e.g. 'prompts' or 'raw/prompts' (the factory "
                                      "also takes an AssetKey or the upstream AssetsDefinition).")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="Sampling of partitions that sampling_by_partition does not name (SamplingConfig fields); "
                    "unset fields take the model's defaults (its generation_config.json, else vLLM's).")
    sampling_by_partition: dict[str, SamplingConfig] = Field(
        default_factory=dict, description="Partition key or glob pattern (e.g. '2024-*', 'creative|*') to its "
                                          "sampling; exact keys win over patterns, earlier patterns over later.")
    beam_search: BeamSearchConfig | None = Field(
        default=None, description="Beam search instead of sampling for partitions that beam_search_by_partition "
                                  "does not name (BeamSearchConfig: beam_width, length_penalty; max_tokens and "
                                  "ignore_eos from the sampling); the best beam is the completion. Not with a "
                                  "structured output.")
    beam_search_by_partition: dict[str, BeamSearchConfig | None] = Field(
        default_factory=dict, description="Partition key or glob pattern to its beam search (None: sampling), "
                                          "matched like sampling_by_partition.")
    adapter: str | None = Field(default=None, description="The LoRA adapter of partitions that adapter_by_partition "
                                                          "does not name (None: the base model).")
    adapter_by_partition: dict[str, str | None] = Field(
        default_factory=dict, description="Partition key or glob pattern to an adapter name (None: the base model), "
                                          "matched like sampling_by_partition.")
    output_schema: dict[str, Any] | str | None = Field(
        default=None, description="What every completion must be: a JSON schema whose top level is an object (a "
                                  "pydantic model class in Python, or the path of a .json file), one typed column "
                                  "per top-level field; a field named like a column of the generation table is a "
                                  "definition error.")
    choices: list[str] | None = Field(default=None, description="Labels of a classification: every completion is "
                                                                "exactly one of them (a 'choice' column).")
    output_schema_by_partition: dict[str, dict[str, Any] | str | None] = Field(
        default_factory=dict, description="Partition key or glob pattern to its output schema (None: free text), "
                                          "matched like sampling_by_partition.")
    choices_by_partition: dict[str, list[str] | None] = Field(
        default_factory=dict, description="Partition key or glob pattern to its choices (None: free text); a "
                                          "partition named here and in output_schema_by_partition is an error.")
    code_version: str = Field(default="1", description="Your version of the prompt logic; the settings that "
                                                       "change the table are added to it, so changing them marks "
                                                       "the asset stale.")
    resource_key: str = _operational("llm", "Key of the LLMResource.")
    io_manager_key: str = _operational("io_manager", "Key of the IO manager of the generation table.")
    pool: str | None = _operational("llm", "Concurrency pool of the generation step; None claims no pool.")
    max_partitions_per_run: int | None = _operational(
        None, "None runs a whole backfill as one run (BackfillPolicy.single_run(), which `dagster asset "
              "materialize --partition-range` needs); N splits backfills into runs of at most N partitions.")
    row_shards: int | None = _operational(
        None, "Split each upstream partition's rows into this many shards (a second, static partition dimension "
              "named 'shard', rows by a hash of their id), so that one day's rows spread over several runs or "
              "pods, each shard committing and resuming on its own; a downstream asset partitioned like the "
              "upstream reads the day as one table. Each shard's data version covers its rows.")
    kubernetes: KubernetesStep | None = _operational(
        None, "The generation step's pod on Kubernetes (dagster-k8s): GPUs, model volume, environment, node "
              "selector, set as the op's dagster-k8s/config tag (kubernetes.run_tags gives a job's run tags).")
    key_prefix: list[str] = _operational([], "Prefix of the asset key (a string is one level).")
    group_name: str | None = _operational(None, "Dagster asset group.")
    description: str | None = _operational(None, "Asset description.")
    progress_interval_s: float = _operational(5.0, "Seconds between progress lines in the event log.")
    shard_rows: int = _operational(64, "Finished rows per shard (a shard is also written every 30 s).")
    reuse_rows: bool = _operational(
        True, "Reuse a committed row of this asset (any partition, any data version) whose row digest matches a row "
              "to generate: its prompt, the sampling it resolved to, adapter, output, images, the model's files, the "
              "engine's output settings and the code version. Only reproducible rows (greedy, seeded or beam search) are "
              "reused; False generates every row of a partition whose data version changed.")

    @field_validator("output_schema", mode="before")
    @classmethod
    def _model_schema(cls, value: object) -> object:
        return value.model_json_schema() if isinstance(value, type) and issubclass(value, BaseModel) else value

    @field_validator("output_schema_by_partition", mode="before")
    @classmethod
    def _model_schemas(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value
        return {key: cls._model_schema(schema) for key, schema in value.items()}

    @field_validator("row_shards")
    @classmethod
    def _some_shards(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be at least 1")
        return value


    def with_files_from(self, folder: Path) -> "GenerationSpec":
        """The spec with adapter folders and schema files (relative paths) read from `folder`.

        Raises:
            DagsterInvalidDefinitionError: a schema file that cannot be read as JSON.
        """
        return self.model_copy(update={
            "adapters": {name: str(folder / path) for name, path in self.adapters.items()},
            "output_schema": self._schema_file(self.output_schema, folder, "output_schema"),
            "output_schema_by_partition": {
                key: self._schema_file(value, folder, f"output_schema_by_partition[{key!r}]")
                for key, value in self.output_schema_by_partition.items()},
        })

    def _schema_file(self, value: dict | str | None, folder: Path, field: str) -> dict | None:
        if not isinstance(value, str):
            return value
        path = folder / value
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise dg.DagsterInvalidDefinitionError(
                f"{self.name}: {field}: cannot read a JSON schema from {path} ({exc}); give the path of a .json "
                "file (relative to the component's folder, or to the working directory in Python), or the "
                "schema inline") from None

    def settings_digest(self) -> str:
        """Digest of every setting that changes the table: all fields but the operational
        ones and the check thresholds (they judge the table, they do not change it).
        Adapters enter each row's data version by the fingerprint of their weights."""
        return digest(self._settings(data_version_exclusions()))

    def row_settings_digest(self) -> str:
        """Digest of the settings that every row's result depends on: the settings digest's
        fields but those each row's digest records as it resolved them (its sampling,
        adapter, beam search and output; its prompt, id and images whatever their column's
        name; whether a repeated id is an error). Changing one partition's sampling then
        regenerates that partition's rows only."""
        return digest(self._settings(data_version_exclusions() | _RESOLVED_PER_ROW))

    def _settings(self, exclude: set[str]) -> dict[str, Any]:
        """The fields a digest reads: all but `exclude`, and but the settings added after tables
        existed while they are unset, so that a new setting keeps the old tables' versions."""
        values = self.model_dump(mode="json", exclude=exclude)
        return {name: value for name, value in values.items()
                if not (name in _ADDED_LATER and value == GenerationSpec.model_fields[name].default)}

    def thresholds(self) -> CheckThresholds:
        return CheckThresholds(**self.model_dump(include=set(CheckThresholds.model_fields)))


_RESOLVED_PER_ROW = {
    "sampling", "sampling_by_partition", "beam_search", "beam_search_by_partition", "adapter", "adapter_by_partition",
    "output_schema", "choices", "output_schema_by_partition", "choices_by_partition", "prompt_column", "id_column",
    "adapter_column", "image_column", "audio_column", "video_column", "duplicate_ids",
}
# Settings added after tables were made with this spec: left out of the digests at their defaults.
_ADDED_LATER = {"audio_column", "video_column"}


def data_version_exclusions() -> set[str]:
    """The spec's fields that do not enter the settings digest."""
    operational = {name for name, info in GenerationSpec.model_fields.items()
                   if info.json_schema_extra == _OPERATIONAL}
    return operational | set(CheckThresholds.model_fields) | {"adapters"}
