"""The errors a bad request raises, with vLLM's name and both of the exception types
vLLM has raised for it.

vLLM raised `ValueError` for invalid settings until its `VLLMValidationError` stopped
being one (0.33); for a setting of the wrong type it raises `TypeError` for some fields
and `VLLMValidationError` for others. Ours are `ValueError`s carrying the field
(`parameter`) and the offending `value`, and a wrong type is a `TypeError` as well, so an
`except` clause written for any of those vLLM versions still catches them.
"""

from typing import Any


class VLLMValidationError(ValueError):
    """A request setting that cannot run; the message names the field and the fix.

    Attributes:
        parameter: The (first) field at fault.
        value: Its value.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class ParameterTypeError(VLLMValidationError, TypeError):
    """A setting of the wrong type (e.g. `stop=123`, `stop_token_ids="1,2"`), or one that
    vLLM no longer takes (`best_of`, `logits_processors`)."""
