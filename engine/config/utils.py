"""What every group of engine settings declares its settings with (`_setting`, the classes of
how a setting bears on the rows) and the checks they share: the type check read from a field's
annotation, and the positive-integer checks."""

import types
import typing
from collections.abc import Iterable
from dataclasses import Field, field
from typing import Any

# How a setting bears on the rows an engine gives; every `EngineConfig` field declares one.
# A row's digest and a table's data version hold each OUTPUT setting as the engine resolved it
# and the fingerprint of the MODEL_FILES settings' folders (`LLM.output_settings`), never the
# OPERATIONAL ones, so that changing those reuses every row.
OUTPUT = "output"  # can change a row's tokens, or how its completion is split (reasoning, tool calls)
MODEL_FILES = "model files"  # a folder whose files decide the rows: it enters by their fingerprint, not its path
OPERATIONAL = "operational"  # only how fast, or where, the work runs; or which rows are refused before they run
SETTING_CLASSES = (OUTPUT, MODEL_FILES, OPERATIONAL)


def _setting(default: object, help: str, affects: str) -> object:
    """A dataclass field whose `help` is its one description (the `LLM` docs and the
    Dagster resource's fields are derived from it) and whose `affects` is its class in
    SETTING_CLASSES."""
    assert affects in SETTING_CLASSES, affects
    return field(default=default, metadata={"help": help, "affects": affects})


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "True or False", dict: "a dict",
               type(None): "None"}


def _type_problem(setting: Field, value: object) -> str | None:
    """What is wrong with the type of `value` for `setting`, read from its annotation (None
    when nothing is): checked before any value is compared, so that a wrong-typed setting is
    named rather than failing a comparison. True is not an integer here, an integer is a number."""
    kinds = typing.get_args(setting.type) if isinstance(setting.type, types.UnionType) else (setting.type,)
    kinds = [typing.get_origin(kind) or kind for kind in kinds]
    if any(_is_a(value, kind) for kind in kinds):
        return None
    return (f"{setting.name} must be {' or '.join(_TYPE_NAMES[kind] for kind in kinds)}, "
            f"got {type(value).__name__} {value!r:.80}")


def _is_a(value: object, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def positive_problems(settings: object, names: Iterable[str], optional: bool = False) -> list[str]:
    """Each of the settings `names` (integers, their types already checked) that is below 1;
    with `optional`, None is allowed too."""
    problems = []
    for name in names:
        value = getattr(settings, name)
        if not (optional and value is None) and value < 1:
            problems.append(f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}")
    return problems


class SettingsGroup:
    """A group of `EngineConfig`'s settings (a dataclass of `_setting` fields that
    `EngineConfig` inherits): what is wrong with its values, and its part of resolution,
    each beside the settings it reads. `self` is the whole `EngineConfig`; a check or a
    default that joins two groups is `EngineConfig`'s own."""

    def problems(self) -> list[str]:
        """What is wrong with this group's values (their types are already checked)."""
        return []

    def resolved(self, model_config: Any, attention_backend: str) -> dict[str, object]:
        """This group's settings with their defaults decided for the model (`model_config`, a
        `ModelConfig`) and its device (`EngineConfig.resolve`), as the values that change."""
        return {}
