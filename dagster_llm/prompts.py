"""Prompt tables in, generation tables out: column checks, chat rendering, output schema."""

import json
from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg
import pandas as pd
import pyarrow as pa

from dagster_llm.config import SamplingConfig
from engine import RequestOutput

# Optional columns of a prompt table that override the partition's sampling per row.
OVERRIDE_COLUMNS = tuple(SamplingConfig.model_fields)

GENERATION_SCHEMA = pa.schema([
    pa.field("id", pa.string()),
    pa.field("prompt", pa.string()),
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("model", pa.string()),
    pa.field("adapter", pa.string()),
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("top_k", pa.int32()),
    pa.field("min_p", pa.float64()),
    pa.field("presence_penalty", pa.float64()),
    pa.field("frequency_penalty", pa.float64()),
    pa.field("repetition_penalty", pa.float64()),
    pa.field("max_tokens", pa.int32()),
    pa.field("min_tokens", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("stop", pa.list_(pa.string())),
    pa.field("ignore_eos", pa.bool_()),
    pa.field("error", pa.string()),
])

COLUMN_DESCRIPTIONS = {
    "id": "The prompt row's id, from the upstream table.",
    "prompt": "The prompt as given: text, or chat messages as JSON.",
    "generated_text": "The completion (null when the row has an error).",
    "finish_reason": "'stop' (EOS or a stop string) or 'length' (max_tokens reached).",
    "prompt_tokens": "Tokens in the rendered prompt.",
    "completion_tokens": "Tokens generated.",
    "model": "The model id.",
    "adapter": "The LoRA adapter used, or null for the base model.",
    "error": "Why the row was not generated, or null.",
}


@dataclass
class PromptRow:
    """One row to generate, with where it came from."""

    partition: str | None
    id: str
    prompt_text: str
    rendered: dict
    sampling: SamplingConfig
    error: str | None = None
    adapter: str | None = None


def to_dataframe(value: object, asset_name: str, upstream: str) -> pd.DataFrame:
    if isinstance(value, pa.Table):
        return value.to_pandas()
    if isinstance(value, pd.DataFrame):
        return value
    raise dg.Failure(
        description=f"{asset_name}: upstream asset {upstream!r} gave a {type(value).__name__}; "
        "it must be a pandas DataFrame or a pyarrow Table"
    )


def check_columns(frame: pd.DataFrame, id_column: str, prompt_column: str, asset_name: str, where: str) -> None:
    missing = [c for c in (id_column, prompt_column) if c not in frame.columns]
    if missing:
        raise dg.Failure(
            description=(
                f"{asset_name}: the prompt table {where} has no column {missing[0]!r} "
                f"(it has {list(frame.columns)}). Rename the column upstream or pass "
                f"{'id_column' if missing[0] == id_column else 'prompt_column'}= to the generation asset."
            )
        )


def _messages(value: object) -> list[dict] | None:
    """Chat messages from a cell: a list of {role, content} (Parquet gives an array)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return None


def render_rows(
    frame: pd.DataFrame,
    partition: str | None,
    base_sampling: SamplingConfig,
    *,
    id_column: str,
    prompt_column: str,
    chat: bool,
    tokenizer,
    adapter: str | None = None,
    adapters: Sequence[str] = (),
    adapter_column: str = "adapter",
) -> list[PromptRow]:
    """Turns table rows into engine prompts; a row that cannot be used gets an error.

    `adapter` is the partition's LoRA adapter (None: the base model); a non-empty value
    in `adapter_column` names another one of the declared `adapters` for its row.
    """
    overrides = [c for c in OVERRIDE_COLUMNS if c in frame.columns]
    rows = []
    for _, record in frame.iterrows():
        row_id = str(record[id_column])
        value = record[prompt_column]
        messages = _messages(value)
        error = None
        row_adapter = adapter
        if adapter_column in frame.columns and _present(record[adapter_column]) and record[adapter_column] != "":
            row_adapter = str(record[adapter_column])
            if row_adapter not in adapters:
                declared = ", ".join(sorted(adapters)) or "none are declared"
                error = (f"{adapter_column}: {row_adapter!r} is not a declared adapter ({declared}); "
                         f"declare it in adapters= or fix the row")
        sampling = base_sampling
        changes = {c: record[c] for c in overrides if _present(record[c])}
        if changes:
            try:
                sampling = SamplingConfig(**{**base_sampling.model_dump(), **_plain(changes)})
            except Exception as exc:  # pydantic's message names the field and the rule
                error = error or f"sampling override columns: {exc}".replace("\n", " ")
        if messages is not None:
            text = json.dumps(messages, ensure_ascii=False)
        elif isinstance(value, str):
            text = value
            if chat:
                messages = [{"role": "user", "content": value}]
        else:
            text = "" if value is None else str(value)
            error = error or (f"{prompt_column}: expected text or chat messages, got "
                              f"{'null' if not _present(value) else type(value).__name__}: fill in the prompt or drop the row")
        rendered = {"prompt": text}
        if messages is not None and error is None:
            try:
                chat_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as exc:
                error = f"{prompt_column}: the model's chat template rejected the messages ({exc})"
            else:
                # The template already holds any BOS token: do not add a second one.
                rendered = {"prompt_token_ids": tokenizer(chat_text, add_special_tokens=False).input_ids}
        rows.append(PromptRow(partition, row_id, text, rendered, sampling, error, row_adapter))
    return rows


def _present(value: object) -> bool:
    if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
        return True
    return value is not None and not pd.isna(value)


def _plain(changes: dict) -> dict:
    """numpy scalars and arrays from pandas as plain Python values."""
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in changes.items()}


def generation_table(rows: Sequence[PromptRow], outputs: Sequence[RequestOutput | None], model_id: str) -> pa.Table:
    """The generation table of `rows`; `outputs[i]` is None where row i has an error."""
    columns: dict[str, list] = {field.name: [] for field in GENERATION_SCHEMA}
    for row, out in zip(rows, outputs):
        completion = out.outputs[0] if out is not None else None
        values = {
            "id": row.id,
            "prompt": row.prompt_text,
            "generated_text": completion.text if completion else None,
            "finish_reason": completion.finish_reason if completion else None,
            "prompt_tokens": len(out.prompt_token_ids) if out else None,
            "completion_tokens": len(completion.token_ids) if completion else None,
            "model": model_id,
            "adapter": row.adapter,
            **row.sampling.model_dump(),
            "error": row.error,
        }
        for name in columns:
            columns[name].append(values[name])
    return pa.table(columns, schema=GENERATION_SCHEMA)
