"""Prompt tables in: column checks, per-row overrides, images and audio, chat rendering and every
row's problem found before the model runs. Rows in, `PromptRow`s out."""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import pandas as pd
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dagster_llm.core.engine_surface import (
    SamplingParams, ToolChoice, chat_messages_problem, invalid_unicode_problem, render_chat,
    unread_parts_problem,
)
from dagster_llm.core.media import MediaColumn, RowItems, audio_column, image_column, read_column, video_column
from dagster_llm.core.sampling import SAMPLING_FIELD_NAMES, BeamSearchConfig, SamplingConfig
from dagster_llm.core.structured import StructuredOutput


class PromptTableError(ValueError):
    """The prompt table as a whole cannot be read (a missing column, a wrong type)."""


class PromptTableRules(BaseModel):
    """How a generation asset reads its prompt tables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_column: str = Field(default="prompt", description="Column with the prompt text or chat messages.")
    id_column: str = Field(default="id", description="Column that identifies a row; copied to the output.")
    chat: bool = Field(default=False, description="Render plain-text prompts with the model's chat template, "
                                                  "as one user message.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra arguments of the model's chat template for chat rows (chat=True text, "
                                  "chat-message cells), e.g. {'enable_thinking': False} to turn a Qwen3 model's "
                                  "reasoning off.")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="OpenAI function tools ({'type': 'function', 'function': {'name', 'description', "
                                  "'parameters': JSON schema of an object}}) that the chat template lists for chat "
                                  "rows; the calls the model makes go to the tool_calls column, and with one tool "
                                  "its arguments get typed columns (one per parameter, from the first call).")
    tool_choice: str | dict[str, Any] | None = Field(
        default=None, description="OpenAI's tool_choice with tools, as vLLM serves it: 'auto' (None: the model "
                                  "decides), 'none' (not asked to call), 'required' (every row's answer is one call "
                                  "or more) or {'type': 'function', 'function': {'name': ...}} (every row calls that "
                                  "tool once); the last two constrain each row's answer, after any reasoning, to "
                                  "the calls' JSON by the tools' schemas. Not with a structured output or a beam "
                                  "search.")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapter name to PEFT adapter folder (in a component: relative "
                                          "to its folder).")
    adapter_column: str = Field(default="adapter", description="Optional prompt-table column naming a row's "
                                                               "adapter; empty or null cells keep the partition's.")
    image_column: str | None = Field(
        default=None, description="Optional prompt-table column of each row's image or list of images (encoded "
                                  "bytes, a local path, a file://, data: or object-store URI) for a vision-language "
                                  "model; with chat the images open the last user message, else the prompt text "
                                  "holds the model's image placeholder once per image.")
    audio_column: str | None = Field(
        default=None, description="Optional prompt-table column of each row's audio clip or list of clips (encoded "
                                  "bytes in any format libsndfile or FFmpeg decodes, a local path, a file://, data: "
                                  "or object-store URI, or Hugging Face's {'array', 'sampling_rate'}) for a model "
                                  "that reads audio; with chat the clips open the last user message (after any "
                                  "images), else the prompt text holds the model's audio placeholder once per clip.")
    video_column: str | None = Field(
        default=None, description="Optional prompt-table column of each row's video or list of videos (an encoded "
                                  "file FFmpeg decodes, sampled at the model's frame rate: bytes, a local path, a "
                                  "file://, data: or object-store URI, or Hugging Face's {'bytes', 'path'}) for a "
                                  "model that reads videos; with chat the videos open the last user message (after "
                                  "any images and clips), else the prompt text holds the model's video placeholder "
                                  "once per video.")
    duplicate_ids: Literal["error", "keep"] = Field(
        default="error", description="'error' (a repeated id is an error row and fails the unique_ids check) or "
                                     "'keep' (every copy is generated).")

    @field_validator("adapters", mode="before")
    @classmethod
    def _folders_as_text(cls, value: object) -> object:
        return {name: str(folder) for name, folder in value.items()} if isinstance(value, dict) else value

    @property
    def media_columns(self) -> dict[str, str]:
        """The column of each modality the prompts carry ("image", "audio", "video"), in the
        order a chat message holds them."""
        given = (("image", self.image_column), ("audio", self.audio_column), ("video", self.video_column))
        return {modality: column for modality, column in given if column is not None}


_TOOL_EXAMPLE = ("{'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a city.', "
                 "'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}}}}")


def tools_problem(tools: list[dict[str, Any]] | None) -> str | None:
    """Why `tools` are not OpenAI function tools (the first wrong one, by its place), or None."""
    names: set[str] = set()
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            return f"{where}: is not a function tool; write each tool as {_TOOL_EXAMPLE}"
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            return f"{where}.function.name: give the function a name (a non-empty string), got {name!r}"
        if name in names:
            return f"{where}.function.name: {name!r} names an earlier tool too; give each tool a name of its own"
        names.add(name)
        parameters = function.get("parameters")
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            return (f"{where}.function.parameters: must be the JSON schema of an object ({{'type': 'object', "
                    f"'properties': {{...}}}}, {{'type': 'object'}} for none), got {parameters!r}")
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.exceptions.SchemaError as exc:
            at = "/".join(str(part) for part in exc.absolute_path) or "(top level)"
            return f"{where}.function.parameters: is not a valid JSON schema at {at}: {exc.message}; fix it"
    return None


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
    # sha256 of each item's bytes per modality with a column ("image", "audio"); absent: unread
    digests: dict[str, list[str]] = field(default_factory=dict)

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
    arguments = {"id_column": spec.id_column, "prompt_column": spec.prompt_column,
                 **{f"{modality}_column": column for modality, column in spec.media_columns.items()}}
    missing = [(argument, c) for argument, c in arguments.items() if c is not None and c not in frame.columns]
    if missing:
        argument, column = missing[0]
        raise PromptTableError(f"the prompt table {where} has no column {column!r} (it has "
                               f"{list(frame.columns)}). Rename the column upstream or pass {argument}= "
                               "to the generation asset.")


@dataclass(frozen=True)
class PartitionSettings:
    """What one partition's rows share: its sampling, adapter and structured output (None:
    free text), the model's default sampling that unset fields take, its beam search (None:
    sampling) and the asset's tool choice (a forced one constrains the rows' answers)."""

    key: str | None
    sampling: SamplingConfig
    adapter: str | None
    output: StructuredOutput | None
    defaults: SamplingParams
    beam: BeamSearchConfig | None = None
    tool_choice: ToolChoice = ToolChoice()

    def params(self, sampling: SamplingConfig) -> SamplingParams:
        constraint = self.output.params if self.output is not None else self.tool_choice.grammar()
        return sampling.effective_params(self.defaults, constraint)


@dataclass(frozen=True)
class ModelMedia:
    """What a model reads besides text: the text that stands for one item in its prompts, per
    modality it reads (none: a text-only model), and how each modality's column is read for
    it (the limits of its images and clips; a modality not given: the engine's default limits)."""

    placeholders: dict[str, str] = field(default_factory=dict)
    columns: dict[str, MediaColumn] = field(default_factory=dict)

    def column(self, modality: str) -> MediaColumn:
        """How the column of `modality` is read."""
        return self.columns.get(modality) or _COLUMN_READERS[modality]()

    @classmethod
    def of(cls, llm: Any, spec: "PromptTableRules") -> "ModelMedia":
        """The loaded `llm`'s (its `image_placeholder`, `image_limits`, `audio_placeholder`...),
        for the columns `spec` reads."""
        placeholders = {modality: text for modality in _COLUMN_READERS
                        if (text := getattr(llm, f"{modality}_placeholder")) is not None}
        return cls(placeholders, {modality: _COLUMN_READERS[modality](getattr(llm, f"{modality}_limits"))
                                  for modality in spec.media_columns})


# How each modality's column is read, given the model's limits for it (None: the engine's defaults).
_COLUMN_READERS: dict[str, Callable[..., MediaColumn]] = {"image": image_column, "audio": audio_column,
                                                          "video": video_column}


def read_rows(frame: pd.DataFrame, partition: PartitionSettings, spec: PromptTableRules,
              tokenizer: Any, media: ModelMedia = ModelMedia()) -> list[PromptRow]:
    """The partition's rows, rendered to token ids, with their images and clips read
    (`image_column`, `audio_column`) as `media` says the model reads them; a row that cannot
    run gets its error.

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
    columns = {modality: read_column(frame[column].tolist(), media.column(modality))
               for modality, column in spec.media_columns.items()}
    rows = []
    for position, record in enumerate(frame.to_dict("records")):
        raw_id = record[spec.id_column]
        row = PromptRow(partition.key, position, None if missing_cell(raw_id) else str(raw_id), None,
                        partition.sampling, shared, partition.adapter, output=partition.output,
                        beam=partition.beam)
        _check_id(row, first_position, spec)
        _apply_adapter(row, record, spec)
        _apply_overrides(row, {c: _plain(record[c]) for c in overrides if not missing_cell(record[c])}, partition)
        items = {modality: _attach_items(row, modality, read[position], spec, media)
                 for modality, read in columns.items()}
        _render(row, record[spec.prompt_column], spec, tokenizer, media, items, partition.tool_choice.mode)
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
    elif (problem := invalid_unicode_problem(row.id, spec.id_column)) is not None:
        row.fail(problem)
        row.id = storable_text(row.id)
    elif row.id in first_position and spec.duplicate_ids == "error":
        row.fail(f"{spec.id_column}: {row.id!r} repeats the id of row {first_position[row.id]}; ids must be "
                 "unique: fix the table upstream, or pass duplicate_ids='keep' to generate every copy")
    else:
        first_position.setdefault(row.id, row.position)


def _apply_adapter(row: PromptRow, record: dict, spec: PromptTableRules) -> None:
    value = record.get(spec.adapter_column)
    if spec.adapter_column not in record or missing_cell(value) or value == "":
        return
    row.adapter = str(value)
    if row.adapter not in spec.adapters:
        declared = ", ".join(sorted(spec.adapters)) or "none are declared"
        row.fail(f"{spec.adapter_column}: {row.adapter!r} is not a declared adapter ({declared}); "
                 "declare it in adapters= or fix the row")


# What a row's messages call one item of each modality, and the models that read it.
_NOUNS = {"image": "image", "audio": "clip", "video": "video"}
_READERS = {"image": "a vision-language model",
            "audio": "a model that reads audio in its prompts (Whisper transcribes through build_transcription_asset)",
            "video": "a model that reads videos (Qwen2-VL, Qwen2.5-VL)"}


def _attach_items(row: PromptRow, modality: str, items: RowItems, spec: PromptTableRules,
                  media: ModelMedia) -> list[object]:
    """Records the row's digests of `modality`; the items its prompt carries (none where it fails)."""
    column = spec.media_columns[modality]
    if items.problem is not None:
        which = f"row {row.id!r}" if row.id is not None else f"the row at position {row.position}"
        row.fail(f"{column}: {which}: {items.problem}")
        return []
    row.digests[modality] = items.digests
    if items.data and modality not in media.placeholders:
        reads = "text only" if not media.placeholders else f"no {modality}"
        row.fail(f"{column}: the model reads {reads}, so it cannot take the row's {len(items.data)} "
                 f"{_NOUNS[modality]}(s): point the resource's model_id at {_READERS[modality]}, or leave "
                 f"{modality}_column unset")
    return items.data


def _render(row: PromptRow, value: object, spec: PromptTableRules, tokenizer: Any,
            media: ModelMedia, items: dict[str, list[object]], tool_choice: str) -> None:
    """Sets the row's prompt text (as stored) and the engine prompt (token ids, images and
    clips; a chat's tools and its `tool_choice` mode)."""
    value = _plain(value)
    messages = _read_prompt(row, value, spec)
    if row.error is not None:
        return
    items = {modality: data for modality, data in items.items() if data}
    if messages is None:
        _text_prompt(row, value, spec, tokenizer, media, items)
    else:
        _chat_prompt(row, messages, spec, tokenizer, media, items, tool_choice)


def _read_prompt(row: PromptRow, value: object, spec: PromptTableRules) -> list[dict[str, Any]] | None:
    """Sets the row's prompt text as stored; the chat messages to render (None: plain text)."""
    column = spec.prompt_column
    if missing_cell(value):
        row.fail(f"{column}: is null: fill in the prompt or drop the row")
        return None
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
    row.prompt_text = storable_text(row.prompt_text)  # the row's error says where a '?' stands for a surrogate
    return messages


def _text_prompt(row: PromptRow, text: str, spec: PromptTableRules, tokenizer: Any,
                 media: ModelMedia, items: dict[str, list[object]]) -> None:
    """A plain-text prompt, whose text places each item by the model's placeholder of its modality."""
    for modality, column in spec.media_columns.items():
        if (placeholder := media.placeholders.get(modality)) is None:
            continue
        found, given = text.count(placeholder), len(items.get(modality, []))
        if found != given:
            noun = _NOUNS[modality]
            row.fail(f"{spec.prompt_column}: holds {found} {placeholder!r} placeholder(s) for the row's {given} "
                     f"{noun}(s) in {column!r}: write {placeholder!r} once where each {noun} goes, or set chat=True "
                     "for the model's chat template to place them")
            return
    row.prompt = {"prompt": text, "prompt_token_ids": tokenizer(text).input_ids}
    if items:
        row.prompt["multi_modal_data"] = items


def _chat_prompt(row: PromptRow, messages: list[dict[str, Any]], spec: PromptTableRules, tokenizer: Any,
                 media: ModelMedia, items: dict[str, list[object]], tool_choice: str) -> None:
    """A conversation rendered with the model's chat template, which gets the spec's tools and
    chat_template_kwargs; the row's images, then its clips, open its last user message."""
    if (problem := unread_parts_problem(messages, media.placeholders)) is not None:
        row.fail(f"{spec.prompt_column}: {problem}")
        return
    if items:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            columns = " and ".join(spec.media_columns[modality] for modality in items)
            nouns = " and ".join(f"{_NOUNS[modality]}s" for modality in items)
            row.fail(f"{columns}: the conversation has no user message for the row's {nouns}: add one")
            return
        content = messages[last_user]["content"]
        text_parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        parts = [{"type": modality, modality: data} for modality, data_list in items.items() for data in data_list]
        messages[last_user] = {**messages[last_user], "content": [*parts, *text_parts]}
    try:
        row.prompt = render_chat(tokenizer, messages, tools=spec.tools, chat_template_kwargs=spec.chat_template_kwargs,
                                 tool_choice=tool_choice)
    except Exception as exc:  # a template may raise anything for messages it does not accept
        given = " with the tools and chat_template_kwargs given" if spec.tools or spec.chat_template_kwargs else ""
        row.fail(f"{spec.prompt_column}: the model's chat template rejected the messages{given} ({exc})")


def missing_cell(value: object) -> bool:
    """A null table cell: None, NaN, pandas' NA or NaT (a list, dict or array is a value)."""
    if isinstance(value, (list, tuple, dict)) or hasattr(value, "tolist"):
        return False
    return value is None or bool(pd.isna(value))


def storable_text(text: str) -> str:
    """The text as Parquet, which holds UTF-8 only, can store it: a lone surrogate as '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _plain(value: object) -> object:
    """numpy scalars and arrays from pandas as plain Python values."""
    return value.tolist() if hasattr(value, "tolist") else value

