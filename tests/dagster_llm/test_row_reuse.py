"""Row reuse across data versions: a row whose result is reproducible and whose row digest
matches a committed row of the asset is taken from it, on a disk and on the S3 server."""

import dagster as dg
import pandas as pd
import pyarrow as pa
import pytest

from dagster_llm import GenerationRun, PartitionInput, RunOptions, SamplingConfig, build_generation_asset
from dagster_llm.core.table_store import ROW_DIGEST_COLUMN, TableStore, storage_path
from tests.dagster_llm.test_generation_asset import latest, prompts_asset, run
from tests.dagster_llm.test_storage_and_resume import rows_of

SAMPLING = SamplingConfig(temperature=0, max_tokens=4, ignore_eos=True)
FRAME = pd.DataFrame({"id": [f"r{i}" for i in range(6)], "prompt": [f"Row {i} says" for i in range(6)]})


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", max_num_seqs=4, kv_cache_memory=64 * 16 * 1024)


class Generator:
    """Runs partitions of one asset ("gen") under `root` and counts the tokens generated."""

    def __init__(self, llm, root, **options) -> None:
        self.llm = llm
        self.store = TableStore(root)
        self.options = RunOptions(model_id="tiny", code_version="1", **options)

    def __call__(self, frame: pd.DataFrame, key: str = "p", sampling: SamplingConfig = SAMPLING, llm=None,
                 **options):
        llm = llm or self.llm
        before = self.llm.get_stats().num_generated_tokens
        options = RunOptions(**{**self.options.__dict__, **options})
        part = PartitionInput(key, rows_of(llm, frame, sampling, key), self.store.partition(["gen"], key))
        [result] = GenerationRun(llm, {}, options, lambda _: None).generate([part])
        return result, self.llm.get_stats().num_generated_tokens - before


def straight(llm, frame: pd.DataFrame, sampling: SamplingConfig = SAMPLING) -> list[str]:
    outputs = llm.generate(list(frame["prompt"]), sampling.effective_params(llm.get_default_sampling_params()),
                           use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def edited(frame: pd.DataFrame) -> pd.DataFrame:
    """Two rows added, one prompt edited, one row's max_tokens overridden, one id renamed."""
    frame = pd.concat([frame, pd.DataFrame({"id": ["n1", "n2"], "prompt": ["New one", "New two"]})],
                      ignore_index=True)
    frame.loc[1, "prompt"] = "Row 1 now says"
    frame["max_tokens"] = [None, None, 3, None, None, None, None, None]
    frame.loc[4, "id"] = "renamed"
    return frame


@pytest.mark.parametrize("where", ["disk", "s3"])
def test_added_and_edited_rows_are_the_only_ones_generated(llm, tmp_path, where, request):
    """Two added rows, an edited prompt and an overridden row are generated; the other four
    (one of them under a new id) come from the committed table, and the table is what
    generating every row would give."""
    if where == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        root = storage_path(f"{bucket.url}/tables", bucket.storage_options)
    else:
        root = tmp_path
    generate = Generator(llm, root)
    first, tokens = generate(FRAME)
    assert (first.stats.generated_rows, first.stats.reused_rows, tokens) == (6, 0, 24)

    frame = edited(FRAME)
    second, tokens = generate(frame)
    stats = second.stats
    assert (stats.rows, stats.reused_rows, stats.resumed_rows, stats.generated_rows) == (8, 4, 0, 4)
    assert tokens == 4 + 3 + 4 + 4 and stats.generated_tokens == tokens
    table = second.table.to_pandas()
    assert list(table["id"]) == list(frame["id"]) and list(table["prompt"]) == list(frame["prompt"])
    expected = straight(llm, frame)
    expected[2] = straight(llm, frame.iloc[[2]], SamplingConfig(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert list(table["generated_text"]) == expected
    assert generate.store.partition(["gen"], "p").read().to_pandas().equals(table)

    third, tokens = generate(frame)  # same data version: every row resumes
    assert (third.stats.resumed_rows, third.stats.reused_rows, tokens) == (8, 0, 0)


def test_rows_of_another_partition_are_reused_and_sampled_rows_only_when_seeded(llm, tmp_path):
    generate = Generator(llm, tmp_path)
    frame = FRAME.assign(temperature=[0.9, 0.9, 0.9, 0.9, None, None], seed=[None, None, 7, 8, None, None])
    generate(frame, key="p")
    other, tokens = generate(frame, key="q")
    assert (other.stats.reused_rows, other.stats.generated_rows, tokens) == (4, 2, 8)
    assert list(other.table["id"].to_pylist()) == list(frame["id"])
    # q's committed rows are indexed too: each digest now has two homes, and p's unseeded rows still generate.
    again, _ = generate(frame.assign(id=[f"x{i}" for i in range(6)]), key="p")
    assert (again.stats.reused_rows, again.stats.generated_rows) == (4, 2)


class OtherModel:
    """The engine with other model files or output settings, as the row digests see it."""

    def __init__(self, llm, **changes) -> None:
        self._llm, self._changes = llm, changes

    def __getattr__(self, name):
        return self._changes[name] if name in self._changes else getattr(self._llm, name)


@pytest.mark.parametrize("change", ["code_version", "model_files", "output_settings", "reuse_rows", "resume"])
def test_nothing_is_reused_across_models_output_settings_or_code_versions_or_when_turned_off(llm, tmp_path, change):
    generate = Generator(llm, tmp_path)
    generate(FRAME)
    frame = FRAME.assign(id=[f"x{i}" for i in range(6)])  # another data version, the same row digests
    changes = {
        "code_version": {"code_version": "2"},
        "model_files": {"llm": OtherModel(llm, output_settings={**llm.output_settings, "model": "0" * 64})},
        "output_settings": {"llm": OtherModel(llm, output_settings={**llm.output_settings, "dtype": "bfloat16"})},
        "reuse_rows": {"reuse_rows": False},
        "resume": {"resume": False},
    }[change]
    result, tokens = generate(frame, **changes)
    assert (result.stats.reused_rows, result.stats.generated_rows, tokens) == (0, 6, 24)


def test_a_replaced_table_is_not_read_through_its_stale_index(llm, tmp_path):
    generate = Generator(llm, tmp_path)
    generate(FRAME)
    files = generate.store.partition(["gen"], "p")
    index = pd.read_parquet(files.index_path.path)
    assert len(index) == 6 and index[ROW_DIGEST_COLUMN].is_unique
    files.write(pa.table({"id": ["another asset's table"]}))  # e.g. written by another IO manager
    result, tokens = generate(FRAME.assign(id=[f"x{i}" for i in range(6)]))
    assert (result.stats.reused_rows, tokens) == (0, 24)


def test_a_materialization_reports_reused_and_generated_rows(env):
    """Through Dagster: editing one prompt and adding a row of a committed partition
    generates two rows; the other two are reused, and the metadata counts them."""
    frames = {"a": pd.DataFrame({"id": ["a1", "a2", "a3"], "prompt": ["Paris is the", "The quick fox", "A KV"]})}
    gen = build_generation_asset("gen", upstream="prompts", sampling=SAMPLING,
                                 partitions_def=dg.StaticPartitionsDefinition(["a"]))
    parts = dg.StaticPartitionsDefinition(["a"])
    with dg.instance_for_test() as instance:
        run([prompts_asset(frames, parts), gen], env, partition="a", instance=instance)
        changed = {"a": pd.DataFrame({"id": ["a1", "a2", "a3", "a4"],
                                      "prompt": ["Paris is the", "The slow fox", "A KV", "Added"]})}
        run([prompts_asset(changed, parts), gen], env, partition="a", instance=instance)
        meta = latest(instance, "gen", "a").metadata
    assert (meta["reused_rows"].value, meta["generated_rows"].value, meta["resumed_rows"].value) == (2, 2, 0)
    assert meta["dagster/row_count"].value == 4


def test_changing_another_partitions_sampling_regenerates_none_of_this_ones_rows(env):
    """The asset's code version changes (every partition is stale), but partition a's rows
    resolve to the same sampling: they are all reused."""
    parts = dg.StaticPartitionsDefinition(["a", "b"])
    frames = {"a": pd.DataFrame({"id": ["a1", "a2"], "prompt": ["Paris is the", "A KV"]}), "b": None}
    with dg.instance_for_test() as instance:
        for max_tokens in (3, 5):
            gen = build_generation_asset("gen", upstream="prompts", sampling=SAMPLING, partitions_def=parts,
                                         sampling_by_partition={"b": SamplingConfig(max_tokens=max_tokens)})
            run([prompts_asset(frames, parts), gen], env, partition="a", instance=instance)
            meta = latest(instance, "gen", "a").metadata
        assert (meta["reused_rows"].value, meta["generated_rows"].value) == (2, 0)
