"""The generation table: its columns (sampling columns from `SAMPLING_FIELDS`, typed
output columns from a `StructuredOutput`, typed columns of the one declared tool's
arguments, the image and audio digests of a table with those columns), their descriptions,
and the table built from finished rows."""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from dagster_llm.core.checks import REASONING_NOT_ENDED
from dagster_llm.core.engine_surface import CompletionOutput, RequestOutput, ToolCall
from dagster_llm.core.prompts import PromptRow
from dagster_llm.core.sampling import SAMPLING_FIELDS, used_values
from dagster_llm.core.structured import OutputColumn, ParsedOutput, StructuredOutput
from dagster_llm.core.table_store import POSITION_COLUMN

TOOL_CALLS_TYPE = pa.list_(pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())]))

_RESULT_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("id", pa.string(), "The prompt row's id, from the upstream table."),
    ("prompt", pa.string(), "The prompt as given: text, or chat messages as JSON (null when it was null)."),
    ("generated_text", pa.string(), "The completion's answer, without its reasoning section and tool calls (their "
                                    "own columns); null when the row could not run. With a structured output, the "
                                    "raw JSON or the chosen label."),
    ("finish_reason", pa.string(), "'stop' (EOS or a stop string) or 'length' (max_tokens reached)."),
    ("prompt_tokens", pa.int32(), "Tokens in the rendered prompt."),
    ("completion_tokens", pa.int32(), "Tokens generated, the reasoning's included."),
    ("reasoning", pa.string(), "The reasoning section of a reasoning model's completion (between its markers, "
                               "such as Qwen3's <think> and </think>); null where there is none: a model that does "
                               "not reason, reasoning turned off (chat_template_kwargs), a beam search."),
    ("reasoning_tokens", pa.int32(), "Tokens of the reasoning section, its markers included; 0 without one."),
    ("tool_calls", TOOL_CALLS_TYPE, "The tool calls the completion made (with tools): each call's id, function "
                                    "name and arguments (a JSON object's text), in order; null where it made none. "
                                    "A call that does not parse is the row's error instead."),
    ("model", pa.string(), "The model id."),
    ("adapter", pa.string(), "The LoRA adapter used, or null for the base model."),
    ("beam_width", pa.int64(), "Beams of the beam search whose best beam is the completion; null for a sampled "
                               "row (the sampling columns then say how)."),
)
_ERROR_COLUMN = ("error", pa.string(), "Why the row was not generated, or why its answer is not usable (its "
                                       "reasoning did not end, its tool call or structured output did not parse); "
                                       "null otherwise.")
# Only in the table of an asset with an image_column (audio_column, video_column), after the error.
_DIGESTS_COLUMNS = {modality: (f"{modality}_digests", pa.list_(pa.string()),
                               f"sha256 (hex) of each of the row's {noun} as read from the {modality} column, in "
                               f"order{decoded}; null when they could not be read.")
                    for modality, noun, decoded in (("image", "images", ""),
                                                    ("audio", "clips", " (a decoded clip's: of its float32 samples "
                                                                       "and sample rate)"),
                                                    ("video", "videos", ""))}

COLUMN_DESCRIPTIONS: dict[str, str] = {
    **{name: text for name, _, text in (*_RESULT_COLUMNS, _ERROR_COLUMN, *_DIGESTS_COLUMNS.values())},
    **{f.name: f"Sampling setting used. {f.description}" for f in SAMPLING_FIELDS},
}
GENERATION_SCHEMA = pa.schema(
    [pa.field(name, kind) for name, kind, _ in _RESULT_COLUMNS]
    + [pa.field(f.name, f.arrow_type) for f in SAMPLING_FIELDS]
    + [pa.field(_ERROR_COLUMN[0], _ERROR_COLUMN[1])]
)


@dataclass(frozen=True)
class ToolArguments:
    """The typed columns of the one declared tool's arguments, one per parameter (typed as
    an output schema's fields are), filled from a completion's first call."""

    name: str
    parameters: StructuredOutput
    columns: tuple[OutputColumn, ...]

    @classmethod
    def of(cls, tools: Sequence[Mapping[str, Any]] | None) -> "ToolArguments | None":
        """The argument columns of `tools` when they hold exactly one function, with
        parameters; else None. Assumes `prompts.tools_problem(tools)` found nothing.

        Raises:
            OutputSpecError: parameters that give no columns (a top level with no properties
                after its $refs).
        """
        if tools is None or len(tools) != 1 or not tools[0]["function"]["parameters"].get("properties"):
            return None
        function = tools[0]["function"]
        name, properties = function["name"], function["parameters"]["properties"]
        parameters = StructuredOutput(function["parameters"], label=f"tool call 1 ({name}): arguments")
        columns = []
        for column in parameters.columns:
            own = properties.get(column.name)
            text = own.get("description", "") if isinstance(own, dict) else ""
            description = (f"Argument {column.name!r} of the first call of tool {name!r}"
                           + (f": {text.rstrip('.')}" if text else "")
                           + "; null where the row made no call or has an error."
                           + (" Stored as JSON text." if column.as_json else ""))
            columns.append(replace(column, description=description))
        return cls(name, parameters, tuple(columns))

    def parse(self, calls: list[ToolCall] | None) -> ParsedOutput:
        """The first call's arguments by column; every column null where there is no call,
        and the reason where the call is of another function or its arguments do not match
        the parameters."""
        if not calls:
            return ParsedOutput({column.name: None for column in self.columns})
        call = calls[0].function
        if call.name != self.name:
            return ParsedOutput({column.name: None for column in self.columns},
                                f"tool call 1 names {call.name!r}, not the declared tool {self.name!r}: its arguments "
                                "fill no columns (the call stays in tool_calls); check the prompt and the tool's "
                                "description")
        return self.parameters.parse(call.arguments, None, 0)


def output_columns_problem(output: StructuredOutput) -> str | None:
    """Why `output`'s columns cannot join the generation table (a name it already has), or None."""
    clashes = _table_clashes(output.columns)
    if not clashes:
        return None
    return (f"output field(s) {clashes} would replace the generation table's column(s) of the same name; rename "
            f"them in the schema (the table's columns: {', '.join(_table_names())})")


def tool_columns_problem(tool: ToolArguments, outputs: Iterable[StructuredOutput | None]) -> str | None:
    """Why the tool's argument columns cannot join the generation table (a name it already
    has, or a field of one of the structured `outputs`), or None."""
    clashes = _table_clashes(tool.columns)
    if clashes:
        return (f"the parameter(s) {clashes} of tool {tool.name!r} would replace the generation table's column(s) of "
                f"the same name; rename them in its parameters (the table's columns: {', '.join(_table_names())})")
    fields = {column.name for output in outputs for column in output_columns(output)}
    shared = [column.name for column in tool.columns if column.name in fields]
    if shared:
        return (f"the parameter(s) {shared} of tool {tool.name!r} are also fields of the structured output, and "
                "each makes a column: rename them in the tool's parameters or in the schema")
    return None


def _table_names() -> list[str]:
    return generation_schema(None, media=tuple(_DIGESTS_COLUMNS)).names


def _table_clashes(columns: Sequence[OutputColumn]) -> list[str]:
    taken = {*_table_names(), POSITION_COLUMN}
    return [column.name for column in columns if column.name in taken]


def output_columns(output: StructuredOutput | None) -> tuple[OutputColumn, ...]:
    return output.columns if output is not None else ()


def tool_columns(tool: ToolArguments | None) -> tuple[OutputColumn, ...]:
    return tool.columns if tool is not None else ()


def generation_schema(output: StructuredOutput | None, media: Sequence[str] = (),
                      tool: ToolArguments | None = None) -> pa.Schema:
    """The generation table's schema; after `error`, the digests of each modality the prompts
    have a column of (`media`: "image", "audio"), a structured output's columns, then the
    tool's argument columns."""
    schema = GENERATION_SCHEMA
    for modality in _DIGESTS_COLUMNS:
        if modality in media:
            schema = schema.append(pa.field(_DIGESTS_COLUMNS[modality][0], _DIGESTS_COLUMNS[modality][1]))
    for column in (*output_columns(output), *tool_columns(tool)):
        schema = schema.append(pa.field(column.name, column.arrow_type))
    return schema


def column_descriptions(output: StructuredOutput | None, tool: ToolArguments | None = None) -> dict[str, str]:
    return {**COLUMN_DESCRIPTIONS,
            **{column.name: column.description for column in (*output_columns(output), *tool_columns(tool))}}


def result_record(row: PromptRow, output: RequestOutput | None, model_id: str,
                  tool: ToolArguments | None = None) -> dict[str, Any]:
    """One row of the generation table; `output` is None where the row has an error. A
    completion whose reasoning did not end, or whose tool call does not parse, has that as
    its error; else, with a structured output, its answer is parsed into its columns, and
    with one declared tool (`tool`) its first call's arguments into theirs, or the row gets
    the error."""
    completion = output.outputs[0] if output is not None else None
    record = {
        "id": row.id,
        "prompt": row.prompt_text,
        "generated_text": completion.text if completion else None,
        "finish_reason": completion.finish_reason if completion else None,
        "prompt_tokens": len(output.prompt_token_ids) if output else None,
        "completion_tokens": len(completion.token_ids) if completion else None,
        "reasoning": completion.reasoning if completion else None,
        "reasoning_tokens": completion.num_reasoning_tokens if completion else None,
        "tool_calls": _tool_call_cells(completion.tool_calls) if completion else None,
        "model": model_id,
        "adapter": row.adapter,
        "beam_width": row.beam.beam_width if row.beam is not None else None,
        **used_values(row.params),
        "error": row.error or (_answer_problem(completion, row.params.max_tokens) if completion else None),
        # Dropped by a table without the modality's column.
        **{name: row.digests.get(modality) for modality, (name, _, _) in _DIGESTS_COLUMNS.items()},
    }
    answered = completion is not None and record["error"] is None
    if row.output is not None:
        parsed = row.output.parse(record["generated_text"] if answered else None, record["finish_reason"],
                                  row.params.max_tokens)
        record.update(parsed.values)
        record["error"] = record["error"] or parsed.error
    if tool is not None:
        parsed = tool.parse(completion.tool_calls if answered else None)
        record.update(parsed.values)
        record["error"] = record["error"] or parsed.error
    return record


def _tool_call_cells(calls: list[ToolCall] | None) -> list[dict[str, str]] | None:
    if not calls:
        return None
    return [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments} for call in calls]


_THINKING_OFF = "or turn the reasoning off (chat_template_kwargs={'enable_thinking': False} for Qwen3's template)"


def _answer_problem(completion: CompletionOutput, max_tokens: int | None) -> str | None:
    """Why a completion has no usable answer: its reasoning did not end (how it stopped),
    or a tool call in it does not parse (the calls that parse are still in its tool_calls,
    and the row is flagged); None otherwise."""
    if completion.reasoning_ended is False:
        if completion.finish_reason == "length" and max_tokens is not None:
            return (f"{REASONING_NOT_ENDED} within max_tokens={max_tokens}: raise max_tokens (the sampling config, "
                    f"or a max_tokens column), {_THINKING_OFF}")
        if completion.finish_reason == "length":
            return f"{REASONING_NOT_ENDED} before the model's context was full: shorten the prompt, {_THINKING_OFF}"
        if completion.stop_reason is None:
            return (f"{REASONING_NOT_ENDED}: the completion ended at EOS inside it: sample again (another seed or "
                    f"temperature), {_THINKING_OFF}")
        return (f"{REASONING_NOT_ENDED}: the completion stopped at {completion.stop_reason!r} (a stop string or "
                f"token) inside it: drop that stop, {_THINKING_OFF}")
    if completion.tool_call_error is not None:
        cut = (f"; it was cut off by max_tokens={max_tokens}: raise max_tokens"
               if completion.finish_reason == "length" else "")
        return (f"tool_calls: {completion.tool_call_error} (kept as the model wrote it: in tool_calls where the call "
                f"is named, else in generated_text){cut}")
    return None


def records_table(records: Sequence[Mapping[str, Any]], output: StructuredOutput | None = None,
                  extra: Mapping[str, pa.Array] | None = None, media: Sequence[str] = (),
                  tool: ToolArguments | None = None) -> pa.Table:
    """The generation table of `records` (plus `extra` columns, such as shard positions;
    `media`: with the digests columns of those modalities; `tool`: with its argument columns).
    A record without a column (saved before the column existed) has it null."""
    table = pa.Table.from_pylist(list(records), schema=generation_schema(output, media, tool))
    for name, values in (extra or {}).items():
        table = table.append_column(name, values)
    return table
