"""The IO manager, shards, resume, locks and bad rows, on the tiny Llama."""

import time

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet
import pytest
from transformers import AutoTokenizer

from dagster_llm import GenerationRun, PartitionFiles, PartitionInput, RunOptions, SamplingConfig, build_generation_asset
from dagster_llm.core.progress import PROMPT_TOKEN_WEIGHT, GenerationProgress, StepCost, StepTimes, WorkCounters
from dagster_llm.core.prompts import PartitionSettings, PromptTableRules, read_rows
from dagster_llm.core.table_store import POSITION_COLUMN, data_version_of
from dagster_llm.core.watch import LaunchingProcessDied, ParentWatch
from engine import EngineStats, SamplingParams, UnfinishedOutput
from tests.dagster_llm.test_generation_asset import PROMPTS, latest, prompts_asset, run

SAMPLING = SamplingConfig(temperature=0, max_tokens=5, ignore_eos=True)


def test_downstream_assets_load_one_partition_and_a_range_through_the_io_manager(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING)
    seen = {}

    @dg.asset(partitions_def=prompts.partitions_def, backfill_policy=dg.BackfillPolicy.single_run())
    def lengths(context: dg.AssetExecutionContext, gen) -> None:
        seen["lengths"] = gen

    @dg.asset(partitions_def=prompts.partitions_def)
    def arrow(gen: pa.Table) -> None:
        seen["arrow"] = gen

    @dg.asset(partitions_def=prompts.partitions_def, backfill_policy=dg.BackfillPolicy.single_run())
    def arrow_range(gen: dict[str, pa.Table]) -> None:
        seen["arrow_range"] = gen

    run([prompts, gen, lengths, arrow], env, partition="a")
    assert isinstance(seen["lengths"], pd.DataFrame) and list(seen["lengths"]["id"]) == ["a1", "a2", "a3"]
    assert isinstance(seen["arrow"], pa.Table) and seen["arrow"].num_rows == 3
    run([prompts, gen, lengths, arrow_range], env, partition_range=("a", "b"))
    assert set(seen["lengths"]) == {"a", "b"} and list(seen["lengths"]["b"]["id"]) == ["b1", "b2"]
    assert isinstance(seen["arrow_range"]["b"], pa.Table)
    # A later run of the downstream asset alone loads the stored table.
    assert dg.materialize([prompts, gen, lengths], selection=[lengths], partition_key="b",
                          resources=env["resources"]).success
    assert list(seen["lengths"]["generated_text"]) == list(
        pd.read_parquet(env["root"] / "gen" / "b.parquet")["generated_text"])


def test_a_range_commits_partitions_one_after_another_with_their_own_metadata(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=4))
    with dg.instance_for_test() as instance:
        result = run([prompts, gen], env, partition_range=("a", "b"), instance=instance)
        materializations = [e for e in result.all_events if e.event_type_value == "ASSET_MATERIALIZATION"
                            and e.asset_key == dg.AssetKey("gen")]
        assert sorted(m.partition for m in materializations) == ["a", "b"]  # each as it committed, once
        for key, rows in (("a", 3), ("b", 2)):
            meta = latest(instance, "gen", key).metadata
            assert meta["dagster/row_count"].value == rows and meta["generated_rows"].value == rows
            assert latest(instance, "gen", key).tags["dagster/data_version"] == meta["data_version"].value
            assert data_version_of(env["root"] / "gen" / f"{key}.parquet") == meta["data_version"].value


def test_a_rerun_reuses_the_committed_partition_unless_told_not_to(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING)
    with dg.instance_for_test() as instance:
        run([prompts, gen], env, partition="a", instance=instance)
        first = pd.read_parquet(env["root"] / "gen" / "a.parquet")
        run([prompts, gen], env, partition="a", instance=instance)
        meta = latest(instance, "gen", "a").metadata
        assert meta["resumed_rows"].value == 3 and meta["generated_rows"].value == 0
        pd.testing.assert_frame_equal(pd.read_parquet(env["root"] / "gen" / "a.parquet"), first)
        run([prompts, gen], env, partition="a", instance=instance,
            run_config={"ops": {"gen": {"config": {"resume": False}}}})
        meta = latest(instance, "gen", "a").metadata
        assert meta["resumed_rows"].value == 0 and meta["generated_rows"].value == 3


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", max_num_seqs=2, kv_cache_memory=64 * 16 * 1024)


def rows_of(llm, frame, sampling=SAMPLING, key="p"):
    settings = PartitionSettings(key, sampling, None, None, llm.get_default_sampling_params())
    return read_rows(frame, settings, PromptTableRules(), llm.get_tokenizer())


FRAME = pd.DataFrame({"id": [f"r{i}" for i in range(8)], "prompt": [f"Row {i} says" for i in range(8)]})


class StopAfter:
    """A check_alive that raises once `limit` calls have passed, like a parent dying."""

    def __init__(self, limit: int) -> None:
        self.calls, self.limit = 0, limit

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > self.limit:
            raise LaunchingProcessDied("parent gone")


def test_an_interrupted_partition_resumes_from_its_shards_and_generates_only_the_rest(llm, tmp_path):
    files = PartitionFiles(tmp_path / "gen" / "p.parquet")
    options = RunOptions(model_id="tiny", code_version="1", shard_rows=1)
    stop = StopAfter(limit=15)
    with pytest.raises(LaunchingProcessDied):
        list(GenerationRun(llm, {}, options, lambda _: None, stop).generate(
            [PartitionInput("p", rows_of(llm, FRAME), files)]))
    assert not files.path.exists()  # nothing committed: readers see no partial table
    [version] = [p.name for p in files.shard_root.iterdir()]
    saved = files.finished_rows(version)
    assert 0 < saved.num_rows < 8

    tokens_before = llm.get_stats().num_generated_tokens
    [result] = GenerationRun(llm, {}, options, lambda _: None).generate(
        [PartitionInput("p", rows_of(llm, FRAME), files)])
    assert result.stats.resumed_rows == saved.num_rows and result.stats.generated_rows == 8 - saved.num_rows
    assert llm.get_stats().num_generated_tokens - tokens_before == 5 * (8 - saved.num_rows)
    table = pd.read_parquet(files.path)
    assert list(table["id"]) == list(FRAME["id"]) and table["id"].is_unique and POSITION_COLUMN not in table
    assert not files.shard_root.exists()
    straight = llm.generate(list(FRAME["prompt"]), SAMPLING.effective_params(llm.get_default_sampling_params()),
                            use_tqdm=False)
    assert list(table["generated_text"]) == [o.outputs[0].text for o in straight]


def test_partitions_of_a_range_commit_one_after_another(llm, tmp_path):
    options = RunOptions(model_id="tiny", code_version="1")
    start = llm.get_stats().num_generated_tokens
    parts = [PartitionInput(key, rows_of(llm, FRAME, key=key), PartitionFiles(tmp_path / f"{key}.parquet"))
             for key in "xyz"]
    committed = [(r.key, llm.get_stats().num_generated_tokens - start)
                 for r in GenerationRun(llm, {}, options, lambda _: None).generate(parts)]
    assert [key for key, _ in committed] == ["x", "y", "z"]
    # With two sequences at a time, x is stored after about a third of the work, not at the end.
    assert committed[0][1] <= 5 * 8 + 5 * 2 and committed[1][1] <= 5 * 16 + 5 * 2


def test_shards_of_another_data_version_are_discarded_not_mixed(llm, tmp_path):
    files = PartitionFiles(tmp_path / "gen" / "p.parquet")
    options = RunOptions(model_id="tiny", code_version="1", shard_rows=1)
    with pytest.raises(LaunchingProcessDied):
        list(GenerationRun(llm, {}, options, lambda _: None, StopAfter(15)).generate(
            [PartitionInput("p", rows_of(llm, FRAME), files)]))
    other = SamplingConfig(max_tokens=3, ignore_eos=True)
    [result] = GenerationRun(llm, {}, options, lambda _: None).generate(
        [PartitionInput("p", rows_of(llm, FRAME, other), files)])
    assert result.stats.resumed_rows == 0 and result.stats.generated_rows == 8
    assert (pd.read_parquet(files.path)["completion_tokens"] == 3).all()


def test_a_second_writer_of_a_partition_is_refused_with_a_clear_message(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING)
    files = env["resources"]["io_manager"].table_store().partition(["gen"], "a")
    with files.lock("run 1234 of gen"):
        result = run([prompts, gen], env, partition="a", raise_on_error=False)
    message = str(next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE").event_specific_data.error)
    assert "is being generated by run 1234 of gen on " in message and "(pid " in message and "wait for that run to finish" in message
    assert not env["loads"]
    assert run([prompts, gen], env, partition="a").success  # released


@pytest.mark.parametrize("column,values,expected", [
    ("id", ["x", "x", "y"], "id: 'x' repeats the id of row 0; ids must be unique"),
    ("prompt", ["ok", None, "fine"], "prompt: is null: fill in the prompt or drop the row"),
    ("prompt", ["ok", "bad \ud800 text", "fine"], "prompt: holds a lone surrogate '\\ud800' at character 4"),
    ("prompt", ["ok", [{"role": "user", "content": "bad \ud800"}], "fine"],
     "prompt: message 0 content: holds a lone surrogate '\\ud800' at character 4"),
    ("prompt", ["ok", [{"role": "user", "content": 5}], "fine"], "message 0: content must be a string, got int"),
    ("prompt", ["ok", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}], "fine"],
     "prompt: message 0: content part 0 is an image ('image_url'), but the model reads text only: drop the image, "
     "or load a vision-language model"),
    ("stop", [None, 5, None], "sampling override column stop: input should be a valid list, got 5"),
    ("temperature", [None, -1.0, None], f"sampling override column temperature must be {SamplingParams.rule('temperature')}"),
])
def test_each_bad_input_becomes_its_rows_error_with_a_message(env, column, values, expected):
    frame = pd.DataFrame({"id": ["x", "y", "z"], "prompt": ["ok", "good", "fine"]})
    frame[column] = pd.Series(values, dtype=object)

    # Held in memory: Parquet itself refuses some of these cells (a lone surrogate).
    @dg.asset(name="prompts", partitions_def=dg.StaticPartitionsDefinition(["a"]), io_manager_key="memory")
    def prompts() -> pd.DataFrame:
        return frame

    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING)
    result = dg.materialize([prompts, gen], partition_key="a",
                            resources={**env["resources"], "memory": dg.InMemoryIOManager()})
    table = pd.read_parquet(env["root"] / "gen" / "a.parquet")
    assert table["error"][1].startswith(expected) or expected in table["error"][1], table["error"][1]
    assert table["error"][[0, 2]].isna().all() and table["generated_text"][[0, 2]].notna().all()
    if column == "prompt" and values[1] is None:
        stored = pa.parquet.read_table(env["root"] / "gen" / "a.parquet")["prompt"]
        assert stored[1].as_py() is None  # stays null, not 'nan'
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["no_error_rows"] is False
    assert checks["unique_ids"] is (column != "id")


def test_chat_rows_take_openai_text_parts(tiny_models):
    """Content as OpenAI's text parts renders as their text joined by newlines, as in vLLM's chat."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    frame = pd.DataFrame({"id": ["parts", "text"],
                          "prompt": pd.Series([parts, [{"role": "user", "content": "Hi\nthere"}]], dtype=object)})
    rows = read_rows(frame, PartitionSettings("p", SAMPLING, None, None, SamplingParams()), PromptTableRules(),
                     tokenizer)
    assert [r.error for r in rows] == [None, None]
    assert rows[0].prompt == rows[1].prompt and rows[0].prompt["prompt_token_ids"]


def test_a_bad_chat_cell_names_its_column_once(tiny_models):
    """A conversation's problem comes after the column's name, which it does not repeat
    (a column called "messages" once gave "messages: messages: expected a non-empty list")."""
    frame = pd.DataFrame({"id": ["empty", "text", "role"],
                          "messages": pd.Series([[], "hi", [{"role": "user"}]], dtype=object)})
    rows = read_rows(frame, PartitionSettings("p", SAMPLING, None, None, SamplingParams()),
                     PromptTableRules(prompt_column="messages"), AutoTokenizer.from_pretrained(tiny_models["llama"]))
    assert [r.error for r in rows] == [
        "messages: expected a non-empty list of messages ({'role', 'content'} dicts), got an empty list", None,
        "messages: message 0: expected a dict with 'role' and 'content', got {'role': 'user'}"]


def test_duplicate_ids_can_be_kept_by_the_definition(env):
    frame = pd.DataFrame({"id": ["x", "x"], "prompt": ["one", "two"]})
    prompts = prompts_asset({"a": frame, "b": PROMPTS["b"]})
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING, duplicate_ids="keep")
    result = run([prompts, gen], env, partition="a")
    assert pd.read_parquet(env["root"] / "gen" / "a.parquet")["error"].isna().all()
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["unique_ids"] and checks["no_error_rows"]


def test_the_eta_comes_from_tokens_and_adapts_to_early_stops():
    counters = WorkCounters(rows_total=4, prompt_tokens_total=400, max_output_tokens_total=400,
                            prompt_tokens_done=400, output_tokens_done=100)
    # Two rows of 100 max_tokens are open with 20 tokens each; two finished, one at its max.
    counters.open_outputs = [UnfinishedOutput(20, 100), UnfinishedOutput(20, 100)]
    counters.rows_done, counters.finished_rows_at_max = 2, 1
    reaching_max = 1.5 / 3
    assert counters.share_reaching_max() == pytest.approx(reaching_max)
    # Each open row: the rest of its max_tokens if it runs on, half of it if it stops early.
    left = 80 * (1 + reaching_max) / 2
    assert counters.expected_output_tokens() == pytest.approx(100 + 2 * left)
    done, total = 400 * PROMPT_TOKEN_WEIGHT + 100, 400 * PROMPT_TOKEN_WEIGHT + 100 + 2 * left
    assert counters.eta_seconds(elapsed_s=10.0) == pytest.approx(10.0 * (total - done) / done)
    # With decode steps timed: the longest row's steps at the overhead, plus each token's share.
    counters.step_cost = StepCost(0.05, 0.01)
    assert counters.eta_seconds(elapsed_s=10.0) == pytest.approx(0.05 * left + 0.01 * 2 * left)
    # A row still waiting to start keeps the estimate on tokens.
    counters.open_outputs = [UnfinishedOutput(0, 100), UnfinishedOutput(20, 100)]
    assert counters.eta_seconds(elapsed_s=10.0) == pytest.approx(10.0 * (100 * 0.75 + left) / done)
    assert WorkCounters(rows_total=1).eta_seconds(1.0) is None


def test_step_times_fit_overhead_and_per_token_cost_once_batches_differ():
    times = StepTimes()
    for batch in (200, 180):
        times.add(batch, 0.04 + 0.002 * batch)
    times.add(190, 0.04 + 0.002 * 190)
    assert times.fit() is None  # one batch size, more or less: nothing to separate
    for batch in (90, 40, 10):
        times.add(batch, 0.04 + 0.002 * batch)
    cost = times.fit()
    assert cost.overhead_s == pytest.approx(0.04) and cost.per_row_s == pytest.approx(0.002)


def test_progress_lines_keep_coming_while_one_step_blocks():
    lines = []
    progress = GenerationProgress(lines.append, 0.05, WorkCounters(rows_total=1, max_output_tokens_total=10),
                                  EngineStats)
    with progress:
        time.sleep(0.3)  # one long prefill step: no callback from the engine meanwhile
    assert len(lines) >= 4 and lines[0].startswith("generation progress: 0/1 rows")


def test_the_parent_watch_raises_once_the_launching_process_is_gone(monkeypatch):
    watch = ParentWatch()
    watch.parent = 4242
    monkeypatch.setattr("os.getppid", lambda: 4242)
    watch.check()
    monkeypatch.setattr("os.getppid", lambda: 1)
    with pytest.raises(LaunchingProcessDied, match="pid 4242"):
        watch.check()
