"""Structured outputs, free of Dagster: a JSON schema (or a list of choices) in, the
engine's constraint, one typed Arrow column per top-level field, and each completion
parsed into those columns (or a row error saying why it could not be).

JSON schema to Arrow, per top-level field (local `$ref`s resolved, as pydantic emits them):

    string -> string         integer -> int64          number -> float64      boolean -> bool
    enum or const of strings -> dictionary<int32, string>
    array with items -> list<items>       object with properties -> struct<properties>
    object with only additionalProperties -> map<string, value>
    anyOf/oneOf/type list of one type and null -> that type (every column is nullable)

A field whose schema (or any part of it) maps to none of these (a tuple's prefixItems, a
union of two types, a recursive model, a non-local $ref) becomes a string column holding
the field's value as JSON text.
"""

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
import pyarrow as pa

from dagster_llm.core.engine_surface import StructuredOutputsParams

# The column of a classification's label (`choices=`).
CHOICE_COLUMN = "choice"
ENUM_TYPE = pa.dictionary(pa.int32(), pa.string())
_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


class OutputSpecError(ValueError):
    """A structured output that cannot be used: a bad schema, bad choices, both or neither."""


@dataclass(frozen=True)
class OutputColumn:
    """One typed column of the generation table, from one top-level field of the output."""

    name: str
    arrow_type: pa.DataType
    description: str
    as_json: bool = False  # the field's schema has no Arrow type: its value is stored as JSON text


@dataclass(frozen=True)
class ParsedOutput:
    """One completion's values by column name, or the reason it has none."""

    values: dict[str, Any]
    error: str | None = None


class StructuredOutput:
    """What every completion of a partition must be: JSON matching `schema` (one column
    per top-level property), or exactly one of `choices` (one column, `choice`).

    Args:
        schema: A JSON schema (dict) or a pydantic model class; its top level must be an
            object with properties.
        choices: The labels of a classification.
        label: What a row's error calls the output (another use of the typed columns, such
            as a tool call's arguments, names itself).

    Raises:
        OutputSpecError: both or neither given, an invalid schema (by its JSON Schema
            meta-schema), a top level that is not an object with properties, bad choices.
    """

    def __init__(self, schema: Mapping[str, Any] | type | None = None, choices: Sequence[str] | None = None,
                 label: str = "structured output") -> None:
        if (schema is None) == (choices is None):
            raise OutputSpecError("give exactly one of output_schema and choices")
        self.schema = _schema_dict(schema) if schema is not None else None
        self.choices = _checked_choices(choices) if choices is not None else None
        self.label = label
        if self.schema is not None:
            self._validator = _validator(self.schema)
            self.columns = _schema_columns(self.schema)
        else:
            self.columns = (OutputColumn(CHOICE_COLUMN, ENUM_TYPE, f"The label, one of {list(self.choices)}."),)

    @functools.cached_property
    def params(self) -> StructuredOutputsParams:
        """The engine's constraint: JSON without free whitespace (so that a small model
        cannot pad it with blank lines until max_tokens), or the choices."""
        if self.schema is not None:
            return StructuredOutputsParams(json=self.schema, disable_any_whitespace=True)
        return StructuredOutputsParams(choice=list(self.choices))

    def describe(self) -> dict[str, Any]:
        """The spec as JSON-able data, for metadata and data versions."""
        return {"schema": self.schema} if self.schema is not None else {"choices": list(self.choices)}

    def parse(self, text: str | None, finish_reason: str | None, max_tokens: int) -> ParsedOutput:
        """The typed values of one completion, or every column null and the reason (no
        reason where there is no completion: the row has its own error)."""
        if text is None:
            return ParsedOutput({column.name: None for column in self.columns})
        if self.choices is not None:
            if text in self.choices:
                return ParsedOutput({CHOICE_COLUMN: text})
            return self._failed(f"{text!r} is not one of the choices {list(self.choices)}", finish_reason, max_tokens)
        try:
            value = json.loads(text)
        except ValueError as exc:
            return self._failed(f"is not valid JSON ({exc})", finish_reason, max_tokens)
        problems = [f"{_path(e.absolute_path)}: {e.message}" for e in self._validator.iter_errors(value)]
        if problems:
            more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            return self._failed("; ".join(problems[:3]) + more, finish_reason, max_tokens)
        if not isinstance(value, dict):
            return self._failed(f"is {type(value).__name__} JSON, not an object", finish_reason, max_tokens)
        return self._typed(value)

    def _typed(self, value: dict[str, Any]) -> ParsedOutput:
        values = {}
        for column in self.columns:
            cell = value.get(column.name)
            if column.as_json and column.name in value:
                cell = json.dumps(cell, ensure_ascii=False)
            try:
                pa.scalar(cell, column.arrow_type)
            except (pa.ArrowException, OverflowError) as exc:
                return self._failed(f"{column.name}: {cell!r} does not fit the column's type {column.arrow_type} "
                                    f"({exc})", None, 0)
            values[column.name] = cell
        return ParsedOutput(values)

    def _failed(self, problem: str, finish_reason: str | None, max_tokens: int) -> ParsedOutput:
        empty = {column.name: None for column in self.columns}
        if finish_reason == "length":
            what = "the JSON" if self.schema is not None else "the choice"
            return ParsedOutput(empty, f"{self.label}: cut off by max_tokens ({max_tokens}) before {what} was "
                                       "complete; raise max_tokens (the sampling config, or a max_tokens column)")
        return ParsedOutput(empty, f"{self.label}: {problem}")


def _path(parts: Sequence[str | int]) -> str:
    """A place in the output, e.g. `products[0].name`; `(top level)` for the whole object."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    return text or "(top level)"


def _schema_dict(schema: Mapping[str, Any] | type) -> dict[str, Any]:
    if isinstance(schema, type) and callable(getattr(schema, "model_json_schema", None)):
        return schema.model_json_schema()
    if not isinstance(schema, Mapping):
        raise OutputSpecError(f"output_schema must be a JSON schema (a dict) or a pydantic model class, "
                              f"got {type(schema).__name__}")
    return json.loads(json.dumps(schema))  # a plain, JSON-able copy


def _checked_choices(choices: Sequence[str]) -> tuple[str, ...]:
    if isinstance(choices, str) or not all(isinstance(c, str) and c for c in choices) or not choices:
        raise OutputSpecError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
    if len(set(choices)) != len(choices):
        raise OutputSpecError(f"choices repeat a label: {list(choices)}")
    return tuple(choices)


def _validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise OutputSpecError(f"output_schema is not a valid JSON schema at {where}: {exc.message}") from None
    return cls(schema)


def _schema_columns(schema: dict[str, Any]) -> tuple[OutputColumn, ...]:
    top, _ = _resolve(schema, schema)
    properties = top.get("properties") if top is not None else None
    if not isinstance(properties, dict) or not properties or top.get("type", "object") != "object":
        raise OutputSpecError("output_schema must describe a JSON object with properties (one column each); "
                              "wrap a list or a single value in an object, e.g. {\"items\": [...]}")
    columns = []
    for name, field_schema in properties.items():
        arrow_type = _arrow_type(field_schema, schema)
        own = field_schema if isinstance(field_schema, dict) else {}
        text = own.get("description") or (_resolve(field_schema, schema)[0] or {}).get("description") or ""
        description = f"Output field {name!r}" + (f": {text.rstrip('.')}" if text else "")
        description += "; null where the row has an error."
        if arrow_type is None:
            columns.append(OutputColumn(name, pa.string(), description + " Stored as JSON text.", as_json=True))
        else:
            columns.append(OutputColumn(name, arrow_type, description))
    return tuple(columns)


def _resolve(node: Any, root: dict[str, Any], seen: frozenset[str] = frozenset()
             ) -> tuple[dict[str, Any] | None, frozenset[str]]:
    """`node` with local `$ref`s and one-element `allOf`s followed, and the refs followed so
    far; None where a ref is not local, not found, or already on the path (a recursive model)."""
    while isinstance(node, dict):
        if "$ref" in node:
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#") or ref in seen:
                return None, seen
            seen = seen | {ref}
            node = root
            for part in filter(None, ref[1:].split("/")):
                node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        elif isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            node = node["allOf"][0]
        else:
            return node, seen
    return None, seen


def _arrow_type(node: Any, root: dict[str, Any], seen: frozenset[str] = frozenset()) -> pa.DataType | None:
    """The Arrow type of a (sub)schema, or None where it has none (see the module docstring)."""
    node, seen = _resolve(node, root, seen)
    if node is None:
        return None
    for key in ("anyOf", "oneOf"):
        if key in node:
            options = [o for o in node[key] if not _is_null(_resolve(o, root)[0])]
            return _arrow_type(options[0], root, seen) if len(options) == 1 else None
    if "enum" in node or "const" in node:
        return _enum_type(node["enum"] if "enum" in node else [node["const"]])
    kind = node.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array" and "prefixItems" not in node and isinstance(node.get("items"), dict):
        item = _arrow_type(node["items"], root, seen)
        return pa.list_(item) if item is not None else None
    if kind == "object" and node.get("properties"):
        fields = [(name, _arrow_type(sub, root, seen)) for name, sub in node["properties"].items()]
        return pa.struct(fields) if all(t is not None for _, t in fields) else None
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        value = _arrow_type(node["additionalProperties"], root, seen)
        return pa.map_(pa.string(), value) if value is not None else None
    return None


def _enum_type(values: list[Any]) -> pa.DataType | None:
    values = [v for v in values if v is not None]
    if values and all(isinstance(v, str) for v in values):
        return ENUM_TYPE
    if values and all(isinstance(v, bool) for v in values):
        return pa.bool_()
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return pa.int64()
    return None


def _is_null(node: dict[str, Any] | None) -> bool:
    return node is not None and node.get("type") == "null"
