"""Prompt tables in: column checks, per-row overrides, chat rendering and every row's
problem found before the model runs. Rows in, `PromptRow`s out."""

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dagster_llm.core.sampling import SAMPLING_FIELD_NAMES, BeamSearchConfig, SamplingConfig
from dagster_llm.core.structured import StructuredOutput
from engine import SamplingParams
from engine.chat_utils import chat_messages_problem, invalid_unicode_problem, render_chat


class PromptTableError(ValueError):
    """The prompt table as a whole cannot be read (a missing column, a wrong type)."""


class PromptTableRules(BaseModel):
    """How a generation asset reads its prompt tables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_column: str = Field(default="prompt", description="Column with the prompt text or chat messages.")
    id_column: str = Field(default="id", description="Column that identifies a row; copied to the output.")
    chat: bool = Field(default=False, description="Render plain-text prompts with the model's chat template, "
                                                  "as one user message.")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapter name to PEFT adapter folder (in a component: relative "
                                          "to its folder).")
    adapter_column: str = Field(default="adapter", description="Optional prompt-table column naming a row's "
                                                               "adapter; empty or null cells keep the partition's.")
    duplicate_ids: Literal["error", "keep"] = Field(
        default="error", description="'error' (a repeated id is an error row and fails the unique_ids check) or "
                                     "'keep' (every copy is generated).")

    @field_validator("adapters", mode="before")
    @classmethod
    def _folders_as_text(cls, value: object) -> object:
        return {name: str(folder) for name, folder in value.items()} if isinstance(value, dict) else value


@dataclass
class PromptRow:
    """One row of a partition's prompt table, ready to generate unless `error` is set.
    `params` are the engine's params of the row's final sampling and output constraint."""

    partition: str | None
    position: int
    id: str | None
    prompt_text: str | None
    sampling: SamplingConfig
    params: SamplingParams
    adapter: str | None = None
    prompt: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    output: StructuredOutput | None = None
    beam: BeamSearchConfig | None = None

    def fail(self, problem: str) -> None:
        """Records a problem; the first one found is the row's error."""
        self.error = self.error or problem


def to_dataframe(value: object, upstream: str, where: str) -> pd.DataFrame:
    if isinstance(value, pa.Table):
        return value.to_pandas()
    if isinstance(value, pd.DataFrame):
        return value
    raise PromptTableError(f"upstream asset {upstream!r} gave a {type(value).__name__} {where}; it must be a "
                           "pandas DataFrame or a pyarrow Table (a {partition: table} dict for a range)")


def check_columns(frame: pd.DataFrame, spec: PromptTableRules, where: str) -> None:
    missing = [c for c in (spec.id_column, spec.prompt_column) if c not in frame.columns]
    if missing:
        argument = "id_column" if missing[0] == spec.id_column else "prompt_column"
        raise PromptTableError(f"the prompt table {where} has no column {missing[0]!r} (it has "
                               f"{list(frame.columns)}). Rename the column upstream or pass {argument}= "
                               "to the generation asset.")


@dataclass(frozen=True)
class PartitionSettings:
    """What one partition's rows share: its sampling, adapter and structured output (None:
    free text), the model's default sampling that unset fields take, and its beam search
    (None: sampling)."""

    key: str | None
    sampling: SamplingConfig
    adapter: str | None
    output: StructuredOutput | None
    defaults: SamplingParams
    beam: BeamSearchConfig | None = None

    def params(self, sampling: SamplingConfig) -> SamplingParams:
        return sampling.effective_params(self.defaults, self.output.params if self.output is not None else None)


def read_rows(frame: pd.DataFrame, partition: PartitionSettings, spec: PromptTableRules,
              tokenizer: Any) -> list[PromptRow]:
    """The partition's rows, rendered to token ids; a row that cannot run gets its error.

    Raises:
        PromptTableError: the partition's own sampling clashes with the model's defaults.
    """
    try:
        shared = partition.params(partition.sampling)
    except ValueError as exc:
        where = f" of partition {partition.key!r}" if partition.key is not None else ""
        raise PromptTableError(f"the sampling{where}: {exc}") from None
    overrides = [c for c in SAMPLING_FIELD_NAMES if c in frame.columns]
    first_position: dict[str, int] = {}
    rows = []
    for position, record in enumerate(frame.to_dict("records")):
        raw_id = record[spec.id_column]
        row = PromptRow(partition.key, position, None if _missing(raw_id) else str(raw_id), None,
                        partition.sampling, shared, partition.adapter, output=partition.output,
                        beam=partition.beam)
        _check_id(row, first_position, spec)
        _apply_adapter(row, record, spec)
        _apply_overrides(row, {c: _plain(record[c]) for c in overrides if not _missing(record[c])}, partition)
        _render(row, record[spec.prompt_column], spec, tokenizer)
        rows.append(row)
    return rows


def _apply_overrides(row: PromptRow, changes: dict[str, Any], partition: PartitionSettings) -> None:
    if not changes:
        return
    try:
        row.sampling = row.sampling.merged(changes, "column ")
        row.params = partition.params(row.sampling)
    except ValueError as exc:
        row.fail(f"sampling override {exc}: fix the cell or drop the column")


def _check_id(row: PromptRow, first_position: dict[str, int], spec: PromptTableRules) -> None:
    if row.id is None:
        row.fail(f"{spec.id_column}: is null: give every row an id")
    elif row.id in first_position and spec.duplicate_ids == "error":
        row.fail(f"{spec.id_column}: {row.id!r} repeats the id of row {first_position[row.id]}; ids must be "
                 "unique: fix the table upstream, or pass duplicate_ids='keep' to generate every copy")
    else:
        first_position.setdefault(row.id, row.position)


def _apply_adapter(row: PromptRow, record: dict, spec: PromptTableRules) -> None:
    value = record.get(spec.adapter_column)
    if spec.adapter_column not in record or _missing(value) or value == "":
        return
    row.adapter = str(value)
    if row.adapter not in spec.adapters:
        declared = ", ".join(sorted(spec.adapters)) or "none are declared"
        row.fail(f"{spec.adapter_column}: {row.adapter!r} is not a declared adapter ({declared}); "
                 "declare it in adapters= or fix the row")


def _render(row: PromptRow, value: object, spec: PromptTableRules, tokenizer: Any) -> None:
    """Sets the row's prompt text (as stored) and the engine prompt (token ids)."""
    value = _plain(value)
    column = spec.prompt_column
    if _missing(value):
        row.fail(f"{column}: is null: fill in the prompt or drop the row")
        return
    messages = None
    if isinstance(value, list):
        row.prompt_text = json.dumps(value, ensure_ascii=False, default=str)
        problem = chat_messages_problem(value)
        if problem is None:
            messages = [{"role": m["role"], "content": m["content"]} for m in value]
        else:
            row.fail(f"{column}: {problem}")
    elif isinstance(value, str):
        row.prompt_text = value
        if (problem := invalid_unicode_problem(value, column)) is not None:
            row.fail(problem)
        elif spec.chat:
            messages = [{"role": "user", "content": value}]
    else:
        row.prompt_text = str(value)
        row.fail(f"{column}: expected text or chat messages, got {type(value).__name__}: fix the column upstream")
    # Parquet holds UTF-8 only: a lone surrogate is stored as '?' (the row's error says where).
    row.prompt_text = row.prompt_text.encode("utf-8", "replace").decode("utf-8")
    if row.error is not None:
        return
    if messages is None:
        row.prompt = {"prompt": value, "prompt_token_ids": tokenizer(value).input_ids}
        return
    try:
        row.prompt = render_chat(tokenizer, messages)
    except Exception as exc:  # a template may raise anything for messages it does not accept
        row.fail(f"{column}: the model's chat template rejected the messages ({exc})")


def _missing(value: object) -> bool:
    if isinstance(value, (list, tuple, dict)) or hasattr(value, "tolist"):
        return False
    return value is None or bool(pd.isna(value))


def _plain(value: object) -> object:
    """numpy scalars and arrays from pandas as plain Python values."""
    return value.tolist() if hasattr(value, "tolist") else value

