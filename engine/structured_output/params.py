"""What a request's output must match: vLLM's `StructuredOutputsParams`."""

import json
from dataclasses import dataclass
from typing import Any

# The kinds of constraint, in the order they are named in messages.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrains a completion to a JSON schema, a regular expression, one of a list of
    strings, a grammar, or any JSON object; exactly one of them.

    Args:
        json: A JSON schema: a dict, its JSON text, or a pydantic model class.
        regex: A regular expression the whole completion must match.
        choice: The completion is exactly one of these strings.
        grammar: A context-free grammar in EBNF (GBNF, `root ::= ...`) or Lark syntax.
        json_object: True: any JSON object.
        disable_any_whitespace: JSON without free whitespace: no newlines or indents, one
            space after each `:` and `,` (`{"a": 1, "b": 2}`). It also keeps small models
            from padding their output with blank lines.

    Raises:
        ValueError: when no constraint or more than one is given, or one has the wrong type.
    """

    json: str | dict | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            self.json = _pydantic_schema(self.json)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        problems = self.problems()
        if problems:
            raise ValueError("Invalid StructuredOutputsParams: " + "; ".join(problems))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `KINDS`."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text, a compile cache's key. A schema's keys keep their order:
        it is the order in which the output's properties are generated."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return json.dumps(json.loads(value) if isinstance(value, str) else value)
        if self.kind == "choice":
            return json.dumps(value)
        return "" if self.kind == "json_object" else value

    def problems(self) -> list[str]:
        """What is wrong with these settings, one message each (empty when valid)."""
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            return [f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"]
        value = getattr(self, given[0])
        if given[0] == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                return [f"json: is not valid JSON ({exc}): give a JSON schema"]
        if given[0] == "json" and not isinstance(value, dict):
            return [f"json: a JSON schema is an object, got {type(value).__name__}"]
        if given[0] in ("regex", "grammar") and not (isinstance(value, str) and value):
            return [f"{given[0]}: must be a non-empty string, got {value!r}"]
        if given[0] == "choice" and not (
            isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
        ):
            return [f"choice: must be a non-empty list of non-empty strings, got {value!r}"]
        if given[0] == "json_object" and value is not True:
            return [f"json_object: must be True, got {value!r}"]
        if not isinstance(self.disable_any_whitespace, bool):
            return [f"disable_any_whitespace: must be true or false, got {self.disable_any_whitespace!r}"]
        return []


def _pydantic_schema(model: Any) -> Any:
    """The JSON schema of a pydantic model class; anything else is returned as it is."""
    schema = getattr(model, "model_json_schema", None)
    return schema() if isinstance(model, type) and callable(schema) else model
