"""One declaration per option: the spec reaches the digest, the factory and the component;
the core imports without Dagster."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

import dagster_llm.components
from dagster_llm import BeamSearchConfig, GenerationComponent, GenerationSpec, SamplingConfig, build_generation_asset
from dagster_llm.core.generation import digest
from dagster_llm.spec import data_version_exclusions
from dagster_llm.kubernetes import KubernetesStep
from tests.dagster_llm.readme_tables import options_table, sampling_table

SCHEMA = {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
# A value other than the default for every option: a new option must be added here.
OTHER_VALUES = {
    "name": "other", "upstream": "raw/other", "prompt_column": "text", "id_column": "key", "chat": True,
    "adapters": {"x": "/adapters/x"}, "adapter_column": "lora", "image_column": "photo",
    "audio_column": "recording",
    "video_column": "clip",
    "duplicate_ids": "keep", "max_error_rate": 0.1, "max_empty_rate": 0.2, "max_truncation_rate": 0.3, "min_parse_rate": 0.4,
    "max_unfinished_reasoning_rate": 0.5, "chat_template_kwargs": {"enable_thinking": False}, "tools": [TOOL],
    "tool_choice": "required",
    "sampling": SamplingConfig(temperature=0.5), "sampling_by_partition": {"a": SamplingConfig(max_tokens=3)},
    "adapter": "x", "adapter_by_partition": {"a": "x"}, "output_schema": SCHEMA, "choices": ["yes", "no"],
    "output_schema_by_partition": {"a": SCHEMA}, "choices_by_partition": {"b": ["p"]}, "code_version": "2",
    "resource_key": "llm2", "io_manager_key": "tables", "pool": None, "max_partitions_per_run": 4,
    "key_prefix": ["team"], "group_name": "g", "description": "d", "progress_interval_s": 1.0, "shard_rows": 8, "reuse_rows": False,
    "row_shards": 3, "kubernetes": KubernetesStep(gpus=2), "beam_search": BeamSearchConfig(beam_width=2),
    "beam_search_by_partition": {"c": BeamSearchConfig(beam_width=3, length_penalty=0.5)},
}
BASE = {"name": "gen", "upstream": "prompts"}


def test_every_option_has_an_example_value():
    assert set(OTHER_VALUES) == set(GenerationSpec.model_fields)


@pytest.mark.parametrize("field", sorted(GenerationSpec.model_fields))
def test_every_option_that_changes_the_table_reaches_the_settings_digest(field):
    changed = GenerationSpec(**{**BASE, field: OTHER_VALUES[field]})
    moves = changed.settings_digest() != GenerationSpec(**BASE).settings_digest()
    assert moves is (field not in data_version_exclusions()), field


def test_the_digest_leaves_out_operational_fields_thresholds_and_adapter_folders():
    assert {"resource_key", "pool", "shard_rows", "max_error_rate", "min_parse_rate", "max_unfinished_reasoning_rate",
            "adapters"} <= data_version_exclusions()
    assert not {"sampling", "prompt_column", "chat", "output_schema", "code_version", "tools",
                "chat_template_kwargs"} & data_version_exclusions()


def test_the_component_passes_every_option_to_the_asset(monkeypatch):
    assert set(GenerationSpec.model_fields) <= set(GenerationComponent.model_fields)
    built = []

    @dg.asset
    def stand_in() -> None: ...

    monkeypatch.setattr(dagster_llm.components, "generation_asset",
                        lambda spec, partitions_def: built.append((spec, partitions_def)) or stand_in)
    dg.build_defs_for_component(GenerationComponent(**OTHER_VALUES, partitions=["a", "b"]))
    # Absolute adapter folders and inline schemas stay as they are.
    [(spec, partitions_def)] = built
    assert spec == GenerationSpec(**OTHER_VALUES)
    assert partitions_def.get_partition_keys() == ["a", "b"]


def test_the_factory_signature_and_docs_list_every_option():
    parameters = inspect.signature(build_generation_asset).parameters
    options = set(GenerationSpec.model_fields) - {"name", "upstream"}
    assert options <= set(parameters) and {"name", "upstream", "partitions_def"} <= set(parameters)
    assert all(f"    {name} (default " in build_generation_asset.__doc__ for name in options)
    assert parameters["shard_rows"].default == 64 and parameters["chat"].default is False


def test_the_factory_refuses_an_unknown_option_and_a_bad_value_by_name():
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="gen: promt_column: not an option; the options are"):
        build_generation_asset("gen", "prompts", promt_column="text")
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="duplicate_ids"):
        build_generation_asset("gen", "prompts", duplicate_ids="drop")
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="max_error_rate"):
        build_generation_asset("gen", "prompts", max_error_rate=2)


def test_the_core_imports_without_dagster():
    code = ("import sys; sys.modules['dagster'] = None; import dagster_llm.core, dagster_llm.core.watch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster' and sys.modules[m] is not None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


ROOT = Path(__file__).resolve().parents[2]
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_the_readme_tables_are_the_declarations():
    readme = (ROOT / "README.md").read_text()
    dagster_page = (ROOT / "docs" / "dagster.md").read_text()
    assert options_table() in readme, "README.md: paste tests.dagster_llm.readme_tables.options_table()"
    assert sampling_table() in dagster_page, "docs/dagster.md: paste tests.dagster_llm.readme_tables.sampling_table()"


def test_the_readme_is_short_and_every_relative_link_resolves():
    readme = ROOT / "README.md"
    lines = len(readme.read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines (at most 200): move detail to a page under docs/"
    broken = []
    for page in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # links in code are code
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in MARKDOWN_LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue  # http(s), mailto: and the like, or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "relative links to missing files:\n" + "\n".join(broken)


def test_a_setting_added_later_keeps_the_old_tables_versions_while_unset():
    """audio_column and video_column came after tables existed: unset, they leave the digests
    as they were (no table is generated again for a release that adds a setting); set, they
    move them."""
    spec = GenerationSpec(**BASE)
    before = spec.model_dump(mode="json", exclude=data_version_exclusions() | {"audio_column", "video_column"})
    assert spec.settings_digest() == digest(before)
    assert GenerationSpec(**BASE, audio_column="clip").settings_digest() != digest(before)
    assert GenerationSpec(**BASE, video_column="clip").settings_digest() != digest(before)
