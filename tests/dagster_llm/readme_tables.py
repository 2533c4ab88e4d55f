"""The documented tables of generation-asset options (in README.md) and sampling fields (in
docs/dagster.md), built from their declarations (`GenerationSpec`, `SamplingParams` through
`SAMPLING_FIELDS`)."""

from dagster_llm.core.sampling import SAMPLING_FIELDS
from dagster_llm.spec import GenerationSpec, data_version_exclusions


def options_table() -> str:
    lines = ["| option | default | in the code version | meaning |", "|---|---|---|---|"]
    excluded = data_version_exclusions()
    for name, info in GenerationSpec.model_fields.items():
        default = "required" if info.is_required() else f"`{info.get_default(call_default_factory=True)!r}`"
        lines.append(f"| `{name}` | {default} | {'no' if name in excluded else 'yes'} | {info.description} |")
    return "\n".join(lines)


def sampling_table() -> str:
    lines = ["| field | column type | meaning and allowed values (the engine's) |", "|---|---|---|"]
    lines += [f"| `{f.name}` | `{f.arrow_type}` | {f.description} |" for f in SAMPLING_FIELDS]
    return "\n".join(lines)
