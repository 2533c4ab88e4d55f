"""What enters a table's version: every engine setting declares once how it bears on the rows
(`engine.config`: output, model files or operational). Changing an output setting or a file of
the model folder between two runs of a partition generates every row again (neither resumed nor
reused by digest); changing an operational one resumes them all, and a renamed copy of the
rows reuses them all by digest."""

import json
import shutil

import dagster as dg
import pandas as pd
import pytest

from dagster_llm import GenerationRun, LLMResource, PartitionInput, RunOptions, SamplingConfig, build_generation_asset
from dagster_llm.core.embedding import EmbeddingOptions, EmbeddingRun, TextPartition, text_rows
from dagster_llm.core.table_store import TableStore
from dagster_llm.resource import _engine_fields
import engine.entrypoints.llm
from engine import LLM
from engine.config import OUTPUT, SETTING_CLASSES, engine_settings
from engine.output_processor.parsing import PARSING_REVISION
from tests.dagster_llm.test_generation_asset import latest, prompts_asset
from tests.dagster_llm.test_storage_and_resume import rows_of
from tests.reasoning_models import build_reasoning_model

SAMPLING = SamplingConfig(temperature=0, max_tokens=3, ignore_eos=True)
FRAME = pd.DataFrame({"id": [f"r{i}" for i in range(4)], "prompt": [f"Row {i} says" for i in range(4)]})
RENAMED = FRAME.assign(id=[f"x{i}" for i in range(4)])  # another data version, the same row digests
BASE = {"dtype": "float32", "kv_cache_memory": 4 << 20, "max_num_seqs": 4, "max_model_len": 256,
        "reasoning_parser": "qwen3", "tool_call_parser": "hermes"}


def test_every_setting_declares_its_class():
    """An engine setting, or a field of the resource, added without saying how it bears on the
    rows fails here (and `_setting` refuses one at import)."""
    unclassified = [s.name for s in engine_settings() if s.metadata.get("affects") not in SETTING_CLASSES]
    assert not unclassified, f"engine settings without a class (output, model files or operational): {unclassified}"
    resource = {name: (info.json_schema_extra or {}).get("affects") for name, info in LLMResource.model_fields.items()}
    assert not [name for name, affects in resource.items() if affects not in SETTING_CLASSES], resource
    assert set(resource) == set(_engine_fields()) | {"model_id", "gpu_lease_timeout_s"}


def test_the_docs_list_each_setting_under_its_class():
    """docs/dagster.md's table says what the declarations say."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "dagster.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in text.splitlines()
            if line.startswith(("| model files |", "| output |", "| operational |"))}
    for setting in engine_settings():
        listed = [cls for cls, names in rows.items() if f"`{setting.name}`" in names]
        assert listed == [setting.metadata["affects"]], (setting.name, listed)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Qwen3-shaped model whose tokenizer implies the qwen3 reasoning parser and hermes tool calls."""
    return build_reasoning_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


class Runs:
    """Runs partition "p" of one generation asset on engines built from a copy of the model folder."""

    def __init__(self, model_folder, tmp_path) -> None:
        self.folder = tmp_path / "model"
        shutil.copytree(model_folder, self.folder)
        self.store = TableStore(tmp_path / "tables")

    def __call__(self, settings: dict, *frames: pd.DataFrame) -> list:
        with LLM(str(self.folder), **{**BASE, **settings}) as llm:
            results = []
            for frame in frames:
                part = PartitionInput("p", rows_of(llm, frame, SAMPLING), self.store.partition(["gen"], "p"))
                [result] = GenerationRun(llm, {}, RunOptions(model_id="tiny", code_version="1"),
                                         lambda _: None).generate([part])
                results.append(result)
            return results


def _edit_json(path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


# Each edit changes one file of the folder that decides completions (a no-op for these rows or not).
FILE_EDITS = {
    "config.json": lambda folder: _edit_json(folder / "config.json", rms_norm_eps=1e-5),
    "generation_config.json": lambda folder: (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9})),
    "chat template": lambda folder: (folder / "chat_template.jinja").write_text(
        (folder / "chat_template.jinja").read_text().replace("<|im_start|>assistant", "<|im_start|>assistant ")),
    "tokenizer": lambda folder: _edit_json(folder / "tokenizer_config.json", clean_up_tokenization_spaces=True),
}
OUTPUT_CHANGES = {
    "reasoning_parser": {"reasoning_parser": None},
    "tool_call_parser": {"tool_call_parser": None},
    "max_model_len": {"max_model_len": 128},
}
OPERATIONAL_CHANGES = {
    "num_threads": {"num_threads": 1},
    "block_size": {"block_size": 32},
    "speculative_config": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2}},
    "async_scheduling": {"async_scheduling": True},
    "max_num_seqs": {"max_num_seqs": 2},
}


@pytest.mark.parametrize("change", [*OUTPUT_CHANGES, *FILE_EDITS])
def test_an_output_setting_or_model_file_changed_generates_every_row_again(model_folder, tmp_path, change):
    runs = Runs(model_folder, tmp_path)
    [first] = runs({}, FRAME)
    if change in FILE_EDITS:
        FILE_EDITS[change](runs.folder)
    [second] = runs(OUTPUT_CHANGES.get(change, {}), FRAME)
    assert first.stats.generated_rows == len(FRAME)
    assert (second.stats.resumed_rows, second.stats.reused_rows, second.stats.generated_rows) == (0, 0, len(FRAME))
    assert second.data_version != first.data_version


@pytest.mark.parametrize("change", OPERATIONAL_CHANGES)
def test_an_operational_setting_changed_reuses_every_row(model_folder, tmp_path, change):
    runs = Runs(model_folder, tmp_path)
    [first] = runs({}, FRAME)
    same, renamed = runs(OPERATIONAL_CHANGES[change], FRAME, RENAMED)
    assert (same.stats.resumed_rows, same.stats.generated_rows, same.data_version) == (
        len(FRAME), 0, first.data_version)
    assert (renamed.stats.reused_rows, renamed.stats.generated_rows) == (len(FRAME), 0)
    assert renamed.table["generated_text"].to_pylist() == first.table["generated_text"].to_pylist()


def test_files_that_cannot_change_a_row_keep_the_fingerprint(model_folder, tmp_path):
    """Documentation, hidden files and weights in formats never loaded stay out; a file the
    loaders may read (a processor config, a sentence-transformers module) enters."""
    runs = Runs(model_folder, tmp_path)
    with LLM(str(runs.folder), **BASE) as llm:
        before = llm.model_fingerprint
        (runs.folder / "README.md").write_text("# a model card\n")
        (runs.folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
        (runs.folder / "pytorch_model.bin").write_bytes(b"\0" * 64)
        assert llm.model_fingerprint == before
        (runs.folder / "1_Pooling").mkdir()
        (runs.folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
        assert llm.model_fingerprint != before


def test_the_resolved_settings_enter_not_the_words_that_chose_them(model_folder, tmp_path):
    """'auto' enters as what it resolved to: the parsers the tokenizer implies, the runner,
    the dtype; rows generated under 'auto' are resumed under the explicit names."""
    runs = Runs(model_folder, tmp_path)
    with LLM(str(runs.folder), **{**BASE, "reasoning_parser": "auto", "tool_call_parser": "auto"}) as llm:
        settings = llm.output_settings
    assert {name: settings[name] for name in ("reasoning_parser", "tool_call_parser", "runner", "dtype")} == {
        "reasoning_parser": "qwen3", "tool_call_parser": "hermes", "runner": "generate", "dtype": "float32"}
    assert set(settings) == {"model", "output_parsing"} | {s.name for s in engine_settings()
                                                           if s.metadata["affects"] == OUTPUT}
    assert settings["output_parsing"] == PARSING_REVISION
    [first] = runs({"reasoning_parser": "auto", "tool_call_parser": "auto"}, FRAME)
    [second] = runs({}, FRAME)
    assert (second.stats.resumed_rows, second.data_version) == (len(FRAME), first.data_version)


def test_rows_parsed_under_older_parser_rules_are_generated_again(model_folder, tmp_path, monkeypatch):
    """A new revision of the parsers' rules (engine.output_processor.parsing.PARSING_REVISION) keeps no
    row parsed the old way, resumed or reused: its reasoning and tool-call columns would be
    the old rules'."""
    runs = Runs(model_folder, tmp_path)
    [first] = runs({}, FRAME)
    monkeypatch.setattr(engine.entrypoints.llm, "PARSING_REVISION", PARSING_REVISION + 1)
    [second] = runs({}, FRAME)
    assert second.data_version != first.data_version
    assert (second.stats.resumed_rows, second.stats.reused_rows, second.stats.generated_rows) == (0, 0, len(FRAME))
    with LLM(str(runs.folder), **{**BASE, "reasoning_parser": None, "tool_call_parser": None}) as llm:
        assert "output_parsing" not in llm.output_settings  # nothing parsed: nothing to regenerate


def test_an_embedding_tables_version_follows_the_same_classes(model_folder, tmp_path):
    """An embedding partition: embedded again under another max_model_len, resumed under another block size."""
    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    store = TableStore(tmp_path / "tables")
    versions = []
    for settings in ({}, {"block_size": 32}, {"max_model_len": 128}):
        with LLM(str(folder), **{**BASE, "runner": "pooling", **settings}) as llm:
            part = TextPartition("p", text_rows(list(FRAME["id"]), list(FRAME["prompt"])), store.partition(["emb"], "p"))
            [result] = EmbeddingRun(llm, EmbeddingOptions(model_id="tiny", code_version="1"), lambda _: None).embed([part])
            versions.append((result.data_version, result.stats.resumed_rows))
    assert versions[1] == (versions[0][0], len(FRAME))
    assert versions[2][0] != versions[0][0] and versions[2][1] == 0


def test_a_materialization_under_another_reasoning_parser_generates_again(model_folder, tmp_path, env):
    """Through Dagster: the resource's reasoning_parser changed between two materializations
    of a partition regenerates its rows; the metadata shows the parser each ran with."""
    parts = dg.StaticPartitionsDefinition(["a"])
    frames = {"a": FRAME}
    gen = build_generation_asset("gen", upstream="prompts", sampling=SAMPLING, partitions_def=parts)
    seen = []
    with dg.instance_for_test() as instance:
        for parser in ("qwen3", None):
            llm = LLMResource(model_id=str(model_folder), **{**BASE, "reasoning_parser": parser})
            dg.materialize([prompts_asset(frames, parts), gen], partition_key="a", instance=instance,
                           resources={**env["resources"], "llm": llm})
            meta = latest(instance, "gen", "a").metadata
            seen.append((meta["generated_rows"].value, meta["engine_output_settings"].value["reasoning_parser"]))
    assert seen == [(len(FRAME), "qwen3"), (len(FRAME), None)]



def test_an_openai_batch_tables_version_follows_the_same_classes(model_folder, tmp_path):
    """An OpenAI batch partition (whose version once left the engine's settings out): another
    max_model_len gives another data version, another block size the same one."""
    from dagster_llm.core.openai_batch import BatchEngines, Engine, OpenAIBatchRun, RequestPartition, table_rows

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    frame = pd.DataFrame({"custom_id": ["a", "b"], "url": ["/v1/completions"] * 2,
                          "body": [{"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0}
                                   for text in ("Row 0 says", "Row 1 says")]})
    versions = []
    for settings in ({}, {"block_size": 32}, {"max_model_len": 128}):
        with LLM(str(folder), **{**BASE, **settings}) as llm:
            engines = BatchEngines(Engine("tiny", "the test's engine", lambda: llm))
            [result] = OpenAIBatchRun(engines, "1", lambda _: None).run([RequestPartition("p", table_rows(frame))])
            assert result.stats.ok_rows == 2
            versions.append(result.data_version)
    assert versions[1] == versions[0] != versions[2]
