"""`GenerationComponent`, `EmbeddingComponent` and `TranscriptionComponent`: a generation,
embedding or transcript asset declared in a `defs.yaml`."""

import dagster as dg
from pydantic import BaseModel, Field

from dagster_llm.assets import generation_asset
from dagster_llm.embedding_assets import embedding_asset
from dagster_llm.embedding_spec import EmbeddingSpec
from dagster_llm.spec import GenerationSpec
from dagster_llm.transcription_assets import transcription_asset
from dagster_llm.transcription_spec import TranscriptionSpec


class PartitionFields(BaseModel):
    """The partitions of a component's asset, which a Python definition passes as a `partitions_def`."""

    partitions: list[str] | None = Field(default=None, description="Static partition keys (same as upstream's).")
    daily_start_date: str | None = Field(default=None, description="Daily partitions from this date (YYYY-MM-DD).")
    daily_end_date: str | None = Field(
        default=None, description="End of the daily partitions, exclusive (YYYY-MM-DD); none: they run up to today.")

    def partitions_def(self, name: str) -> dg.PartitionsDefinition | None:
        if self.partitions and self.daily_start_date:
            raise dg.DagsterInvalidDefinitionError(f"{name}: give partitions or daily_start_date, not both")
        if self.daily_end_date and not self.daily_start_date:
            raise dg.DagsterInvalidDefinitionError(f"{name}: daily_end_date needs daily_start_date")
        if self.partitions:
            return dg.StaticPartitionsDefinition(self.partitions)
        if self.daily_start_date:
            return dg.DailyPartitionsDefinition(start_date=self.daily_start_date, end_date=self.daily_end_date)
        return None


class GenerationComponent(GenerationSpec, PartitionFields, dg.Component, dg.Resolvable):
    """Runs the LLM resource over an upstream prompt table; the table goes through the IO manager.
    Its fields are `GenerationSpec`'s (the options of `build_generation_asset`), plus the
    partitions, which a Python definition passes as a `partitions_def`.

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

        Arguments of the chat template (here: a Qwen3 model's reasoning off) and tools it
        lists; the calls go to the tool_calls column, and one tool's arguments get typed
        columns (here: city):

        .. code-block:: yaml

              chat_template_kwargs: {enable_thinking: false}
              tools:
                - type: function
                  function:
                    name: get_weather
                    description: The weather in a city.
                    parameters:
                      type: object
                      properties: {city: {type: string}}
                      required: [city]
    """

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        spec = GenerationSpec(**self.model_dump(include=set(GenerationSpec.model_fields)))
        return dg.Definitions(assets=[generation_asset(spec.with_files_from(context.path),
                                                       self.partitions_def(self.name))])


class EmbeddingComponent(EmbeddingSpec, PartitionFields, dg.Component, dg.Resolvable):
    """Embeds a text column of an upstream table with the embedding resource; the table of
    vectors goes through the IO manager. Its fields are `EmbeddingSpec`'s (the options of
    `build_embedding_asset`), plus the partitions.

    Examples:
        .. code-block:: yaml

            type: dagster_llm.components.EmbeddingComponent
            attributes:
              name: ticket_vectors
              upstream: ticket_texts
              text_column: text
              resource_key: embedder
              daily_start_date: "2024-06-01"
    """

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        spec = EmbeddingSpec(**self.model_dump(include=set(EmbeddingSpec.model_fields)))
        return dg.Definitions(assets=[embedding_asset(spec, self.partitions_def(self.name))])


class TranscriptionComponent(TranscriptionSpec, PartitionFields, dg.Component, dg.Resolvable):
    """Transcribes an audio column of an upstream table with the transcriber resource; the
    transcript table goes through the IO manager. Its fields are `TranscriptionSpec`'s (the
    options of `build_transcription_asset`), plus the partitions.

    Examples:
        .. code-block:: yaml

            type: dagster_llm.components.TranscriptionComponent
            attributes:
              name: call_transcripts
              upstream: call_recordings
              audio_column: recording
              language: en
              daily_start_date: "2024-06-01"
    """

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        spec = TranscriptionSpec(**self.model_dump(include=set(TranscriptionSpec.model_fields)))
        return dg.Definitions(assets=[transcription_asset(spec, self.partitions_def(self.name))])
