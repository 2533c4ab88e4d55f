"""`EmbeddingSpec`: every option of an embedding asset, declared once (the factory's
keyword arguments and the component's fields are read from it)."""

from pydantic import ConfigDict, Field, field_validator

from dagster_llm.spec import AssetKeys


class EmbeddingSpec(AssetKeys):
    """An embedding asset: an upstream text table in, one vector per row out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The embedding asset's name.")
    upstream: str = Field(description="Asset key of the text table, e.g. 'tickets' or 'raw/tickets' (the factory "
                                      "also takes an AssetKey or the upstream AssetsDefinition).")
    text_column: str = Field(default="text", description="The column of text to embed.")
    id_column: str = Field(default="id", description="The column of row ids (unique within a partition).")
    normalize: bool | None = Field(default=None, description="Scale each vector to unit length (None: the model's "
                                                             "default, which is yes unless its sentence-transformers "
                                                             "modules leave vectors unnormalised).")
    resource_key: str = Field(default="embedder", description="The LLMResource that embeds: one that loads an "
                                                              "embedding model, or a causal LM with "
                                                              "runner='pooling'.")
    io_manager_key: str = Field(default="io_manager", description="The IO manager of the embedding table "
                                                                  "(ParquetIOManager: shards, resume and locks).")
    key_prefix: list[str] = Field(default_factory=list, description="Prefix of the asset key.")
    group_name: str | None = Field(default=None, description="Asset group.")
    description: str | None = Field(default=None, description="Asset description.")
    code_version: str = Field(default="1", description="Bump it when the embedding logic changes.")
    pool: str | None = Field(default=None, description="Dagster concurrency pool the step claims a slot of.")
    shard_rows: int = Field(default=64, description="Embedded rows per shard (a shard is also written every 30 s).")

    @field_validator("shard_rows")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value
