"""`GenerationComponent`: a generation asset declared in a `defs.yaml`."""

import json
from pathlib import Path

import dagster as dg
from pydantic import Field

from dagster_llm.assets import build_generation_asset
from dagster_llm.checks import CheckThresholds
from dagster_llm.sampling import SamplingConfig


class GenerationComponent(dg.Component, dg.Model, dg.Resolvable):
    """Runs the LLM resource over an upstream prompt table; the table goes through the IO manager.

    Examples:
        .. code-block:: yaml

            type: dagster_llm.components.GenerationComponent
            attributes:
              name: answers
              upstream: questions
              chat: true
              partitions: [factual, creative]
              sampling: {temperature: 0, max_tokens: 48}
              sampling_by_partition:
                creative: {temperature: 0.8, top_p: 0.95, seed: 7, max_tokens: 64}
              adapters: {poet: adapters/poet}   # PEFT folders, relative to this file's folder
              adapter_by_partition: {creative: poet}

        A structured output (typed columns): a JSON schema inline, or the path of a .json
        file beside the defs.yaml; or choices (a classification); per partition too:

        .. code-block:: yaml

              output_schema:
                type: object
                properties:
                  topic: {type: string, enum: [science, history, other]}
                  keywords: {type: array, items: {type: string}, maxItems: 3}
                required: [topic, keywords]
              choices_by_partition: {creative: ["poem", "story", "joke"]}
              min_parse_rate: 0.9
    """

    name: str = Field(description="The generation asset's name.")
    upstream: str = Field(description="Asset key of the prompt table, e.g. 'prompts' or 'raw/prompts'.")
    prompt_column: str = Field(default="prompt", description="Column with the prompt text or chat messages.")
    id_column: str = Field(default="id", description="Column that identifies a row.")
    chat: bool = Field(default=False, description="Render plain-text prompts with the model's chat template.")
    partitions: list[str] | None = Field(default=None, description="Static partition keys (same as upstream's).")
    daily_start_date: str | None = Field(default=None, description="Daily partitions from this date (YYYY-MM-DD).")
    daily_end_date: str | None = Field(
        default=None, description="End of the daily partitions, exclusive (YYYY-MM-DD); none: they run up to today.")
    sampling: dict = Field(default_factory=dict, description="Default sampling config (SamplingConfig fields).")
    sampling_by_partition: dict[str, dict] = Field(
        default_factory=dict, description="Partition key or glob pattern to its sampling config."
    )
    adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapter name to PEFT folder (relative paths: from this component's folder)."
    )
    adapter: str | None = Field(default=None, description="Adapter of partitions not in adapter_by_partition (none: base model).")
    adapter_by_partition: dict[str, str | None] = Field(
        default_factory=dict, description="Partition key or glob pattern to an adapter name (null: base model)."
    )
    adapter_column: str = Field(default="adapter", description="Prompt-table column that names a row's adapter.")
    output_schema: dict | str | None = Field(
        default=None, description="JSON schema every completion must match (one typed column per top-level field): "
                                  "inline, or the path of a .json file relative to this component's folder.")
    choices: list[str] | None = Field(default=None, description="Labels of a classification (a 'choice' column).")
    output_schema_by_partition: dict[str, dict | str | None] = Field(
        default_factory=dict, description="Partition key or glob pattern to its output schema (null: free text).")
    choices_by_partition: dict[str, list[str] | None] = Field(
        default_factory=dict, description="Partition key or glob pattern to its choices (null: free text).")
    duplicate_ids: str = Field(default="error", description="'error' (repeated ids are error rows) or 'keep'.")
    max_error_rate: float = Field(default=0.0, ge=0, le=1, description="Error rows above this share fail the check.")
    max_empty_rate: float = Field(default=0.0, ge=0, le=1, description="Empty generations above this share fail.")
    max_truncation_rate: float = Field(default=0.5, ge=0, le=1, description="Truncated rows above this share fail.")
    min_parse_rate: float = Field(default=1.0, ge=0, le=1,
                                  description="Structured outputs parsed below this share fail the parse_rate check.")
    resource_key: str = Field(default="llm", description="Key of the LLMResource.")
    pool: str | None = Field(default="llm", description="Concurrency pool of the generation step.")
    group_name: str | None = Field(default=None, description="Asset group.")
    code_version: str = Field(default="1", description="Version of the prompt logic.")

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        if self.partitions and self.daily_start_date:
            raise dg.DagsterInvalidDefinitionError(f"{self.name}: give partitions or daily_start_date, not both")
        if self.daily_end_date and not self.daily_start_date:
            raise dg.DagsterInvalidDefinitionError(f"{self.name}: daily_end_date needs daily_start_date")
        partitions_def = (
            dg.StaticPartitionsDefinition(self.partitions) if self.partitions
            else dg.DailyPartitionsDefinition(start_date=self.daily_start_date, end_date=self.daily_end_date)
            if self.daily_start_date else None
        )
        asset = build_generation_asset(
            self.name,
            upstream=dg.AssetKey.from_user_string(self.upstream),
            prompt_column=self.prompt_column,
            id_column=self.id_column,
            chat=self.chat,
            sampling=SamplingConfig(**self.sampling),
            sampling_by_partition={k: SamplingConfig(**v) for k, v in self.sampling_by_partition.items()},
            adapters={name: context.path / folder for name, folder in self.adapters.items()},
            adapter=self.adapter,
            adapter_by_partition=self.adapter_by_partition,
            adapter_column=self.adapter_column,
            output_schema=self._schema(self.output_schema, context.path, "output_schema"),
            choices=self.choices,
            output_schema_by_partition={
                key: self._schema(value, context.path, f"output_schema_by_partition[{key!r}]")
                for key, value in self.output_schema_by_partition.items()
            },
            choices_by_partition=self.choices_by_partition,
            duplicate_ids=self.duplicate_ids,
            partitions_def=partitions_def,
            resource_key=self.resource_key,
            pool=self.pool,
            thresholds=CheckThresholds(self.max_error_rate, self.max_empty_rate, self.max_truncation_rate,
                                       min_parse_rate=self.min_parse_rate),
            group_name=self.group_name,
            code_version=self.code_version,
        )
        return dg.Definitions(assets=[asset])

    def _schema(self, value: dict | str | None, folder: Path, field: str) -> dict | None:
        """An inline schema as it is; a path: the JSON schema in that file (relative to `folder`)."""
        if not isinstance(value, str):
            return value
        path = folder / value
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise dg.DagsterInvalidDefinitionError(
                f"{self.name}: {field}: cannot read a JSON schema from {path} ({exc}); give the path of a .json "
                "file relative to the component's folder, or the schema inline") from None
