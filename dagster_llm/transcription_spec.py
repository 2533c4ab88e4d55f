"""`TranscriptionSpec`: every option of a transcript asset, declared once (the factory's
keyword arguments and the component's fields are read from it)."""

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from dagster_llm.spec import AssetKeys


class TranscriptionSpec(AssetKeys):
    """A transcript asset: an upstream table of audio clips in, one transcript per row out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The transcript asset's name.")
    upstream: str = Field(description="Asset key of the table of clips, e.g. 'calls' or 'raw/calls' (the factory "
                                      "also takes an AssetKey or the upstream AssetsDefinition).")
    audio_column: str = Field(default="audio", description="The column of each row's clip: encoded bytes (any "
                                                           "format libsndfile or FFmpeg decodes), a local path, a "
                                                           "file://, data: or object-store URI, or Hugging Face's "
                                                           "{'bytes', 'path'} or {'array', 'sampling_rate'} struct.")
    id_column: str = Field(default="id", description="The column of row ids (unique within a partition).")
    language: str | None = Field(default=None, description="ISO 639-1 code of the clips' language ('en'), as the "
                                                           "model's tokenizer names it; None detects each clip's on "
                                                           "its first window.")
    task: Literal["transcribe", "translate"] = Field(default="transcribe", description="'transcribe' (text in the "
                                                                                       "spoken language) or "
                                                                                       "'translate' (to English).")
    prompt: str | None = Field(default=None, description="Text every window follows (names, spellings, earlier "
                                                         "speech), as Whisper's prompt.")
    max_tokens: int | None = Field(default=None, description="Most tokens per window (None: up to the model's "
                                                             "context).")
    resource_key: str = Field(default="transcriber", description="The LLMResource that transcribes: one that loads "
                                                                 "a speech-to-text model (Whisper).")
    io_manager_key: str = Field(default="io_manager", description="The IO manager of the transcript table "
                                                                  "(ParquetIOManager: shards, resume and locks).")
    key_prefix: list[str] = Field(default_factory=list, description="Prefix of the asset key.")
    group_name: str | None = Field(default=None, description="Asset group.")
    description: str | None = Field(default=None, description="Asset description.")
    code_version: str = Field(default="1", description="Bump it when the transcription logic changes.")
    pool: str | None = Field(default=None, description="Dagster concurrency pool the step claims a slot of.")
    shard_rows: int = Field(default=16, description="Transcribed rows per shard (a shard is also written every 30 s).")
    reuse_rows: bool = Field(default=True, description="Take a committed row of the asset with the same clip and "
                                                       "settings rather than transcribe it again.")

    @field_validator("shard_rows")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _positive_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be at least 1, or None for the model's context")
        return value
