"""The example code location as the UI loads it: partitions, location name, component fields."""

import csv
import subprocess
import sys
import tomllib
from pathlib import Path

import dagster as dg
import pytest
import yaml

from dagster_llm.components import GenerationComponent

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    import definitions

    return definitions.defs


def test_daily_assets_have_one_partition_per_day_of_the_ticket_export(defs):
    with (REPO / "example_pipelines" / "data" / "support_tickets.csv").open(newline="") as file:
        export_days = sorted({row["created_date"] for row in csv.DictReader(file)})
    daily = {key.to_user_string(): asset.partitions_def for asset in defs.resolve_all_asset_specs()
             for key in [asset.key] if isinstance(asset.partitions_def, dg.DailyPartitionsDefinition)}
    assert {"raw_support_tickets", "support_prompts", "ticket_summaries", "ticket_triage"} <= set(daily)
    for name, partitions_def in daily.items():
        assert partitions_def.get_partition_keys() == export_days, name


def test_the_definitions_load_without_torch_or_the_engine():
    """A code server, the webserver and every step process load definitions.py: torch, transformers
    and the engine load only in a process that builds an engine (`LLMResource.get_llm`)."""
    code = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None; import definitions; "
            "print(sorted(m for m in sys.modules if m.startswith('engine.') and m != 'engine.lazy_exports'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    api_types = {"engine.beam_search", "engine.exceptions", "engine.lora", "engine.lora.request",
                 "engine.config", "engine.config.cache", "engine.config.device", "engine.config.engine",
                 "engine.config.lora", "engine.config.model", "engine.config.multimodal", "engine.config.parallel",
                 "engine.config.parsers", "engine.config.scheduler", "engine.config.speculative",
                 "engine.config.utils",
                 "engine.model_loader", "engine.model_loader.embedded_model",
                 "engine.multimodal", "engine.multimodal.image", "engine.multimodal.media", "engine.outputs",
                 "engine.pooling_params", "engine.sampling_params",
                 "engine.core",  # the package alone: its __init__ imports nothing
                 "engine.core.step_cost", "engine.structured_output", "engine.structured_output.params",
                 "engine.entrypoints",  # the package alone: its __init__ imports nothing
                 "engine.entrypoints.chat_utils",
                 "engine.entrypoints.tool_choice"}  # a tool_choice is checked against its tools where the asset is defined
    loaded = set(eval(out.stdout))  # a printed list of module names
    # The tool-call parsers (which tool_choice reads forced calls with) are plain Python, as the API types.
    assert {name for name in loaded if not name.startswith("engine.tool_parsers")} <= api_types


def test_workspace_location_name_is_the_projects():
    """Dagster warns at every load (each minute, from the daemon) when these differ."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["dg"]["project"]
    workspace = yaml.safe_load((REPO / "workspace.yaml").read_text())
    assert workspace["load_from"][0]["python_file"]["location_name"] == project["code_location_name"]


def test_component_daily_end_date_needs_a_start():
    component = GenerationComponent(name="gen", upstream="prompts", daily_end_date="2024-06-06")
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="daily_end_date needs daily_start_date"):
        dg.build_defs_for_component(component)
    bounded = GenerationComponent(name="gen", upstream="prompts", daily_start_date="2024-06-01",
                                  daily_end_date="2024-06-03")
    [asset] = dg.build_defs_for_component(bounded).assets
    assert asset.partitions_def.get_partition_keys() == ["2024-06-01", "2024-06-02"]
