"""The generation asset on tiny random models: contents, metadata, partitions, errors, versions."""

import hashlib
import json
import logging
import shutil
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

import engine
from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset, partition_file
from engine.hardware import CPU_KIND_ENV, detect_cpu, machine_cpu
from tests.cpu_kinds import stand_ins
from tests.processes import child_pids

PARTS = dg.StaticPartitionsDefinition(["a", "b"])
PROMPTS = {
    "a": pd.DataFrame({"id": ["a1", "a2", "a3"], "prompt": ["Paris is the", "The quick brown fox", "A paged KV"]}),
    "b": pd.DataFrame({"id": ["b1", "b2"], "prompt": ["Numbers: 0 1 2", "Unicode: café"]}),
}
METADATA_KEYS = {
    "dagster/row_count", "dagster/column_schema", "dagster/column_lineage", "path", "model_id",
    "model_fingerprint", "engine_output_settings", "engine_version", "elapsed_s", "partitions_in_run", "prompt_tokens",
    "completion_tokens", "reasoning_tokens", "tool_call_rows", "finish_reasons", "error_rows", "generated_rows",
    "resumed_rows", "reused_rows", "adapter", "sampling_config", "data_version", "upstream_data_version", "preview",
}


def prompts_asset(frames=PROMPTS, partitions_def=PARTS, name="prompts"):
    @dg.asset(name=name, partitions_def=partitions_def, backfill_policy=dg.BackfillPolicy.single_run())
    def _prompts(context: dg.AssetExecutionContext):
        out = {k: frames[k] for k in context.partition_keys}
        return out if len(out) > 1 else out[context.partition_key]

    return _prompts


def run(assets, env, *, partition=None, partition_range=None, run_config=None, instance=None, raise_on_error=True):
    tags = {}
    if partition_range:
        tags = {"dagster/asset_partition_range_start": partition_range[0],
                "dagster/asset_partition_range_end": partition_range[1]}
    return dg.materialize(assets, partition_key=partition, tags=tags, resources=env["resources"],
                          run_config=run_config, instance=instance, raise_on_error=raise_on_error)


def latest(instance, key: str, partition: str):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[partition]), limit=1).records
    return records[0].asset_materialization


def test_partition_contents_equal_direct_generation_and_carry_full_metadata(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(temperature=0, max_tokens=6))
    with dg.instance_for_test() as instance:
        result = run([prompts, gen], env, partition="a", instance=instance)
        table = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "a"))
        with engine.LLM(str(env["model"]), dtype="float32") as llm:
            direct = llm.generate(list(PROMPTS["a"]["prompt"]), engine.SamplingParams(temperature=0, max_tokens=6),
                                  use_tqdm=False)
        assert list(table["id"]) == ["a1", "a2", "a3"]
        assert list(table["generated_text"]) == [o.outputs[0].text for o in direct]
        assert list(table["completion_tokens"]) == [len(o.outputs[0].token_ids) for o in direct]
        assert table["error"].isna().all() and (table["max_tokens"] == 6).all()
        assert (table["model"] == str(env["model"])).all()

        meta = latest(instance, "gen", "a").metadata
        assert METADATA_KEYS <= set(meta)
        assert meta["dagster/row_count"].value == 3
        assert meta["error_rows"].value == 0
        assert meta["completion_tokens"].value == int(table["completion_tokens"].sum())
        assert meta["sampling_config"].value["max_tokens"] == 6
        assert len(meta["model_fingerprint"].value) == 64
        settings = meta["engine_output_settings"].value
        assert settings["model"] == meta["model_fingerprint"].value
        assert {name: settings[name] for name in ("device", "dtype", "quantization", "kv_cache_dtype", "batch_invariant",
                                                  "reasoning_parser", "runner")} == {
            "device": "cpu", "dtype": "float32", "quantization": None, "kv_cache_dtype": "float32",
            "batch_invariant": False, "reasoning_parser": None, "runner": "generate"}
        assert [c.name for c in meta["dagster/column_schema"].value.columns][:4] == ["id", "prompt", "generated_text", "finish_reason"]
        deps = meta["dagster/column_lineage"].value.deps_by_column["generated_text"]
        assert deps[0].asset_key == dg.AssetKey("prompts") and deps[0].column_name == "prompt"
        assert sum(json.loads(json.dumps(meta["finish_reasons"].value)).values()) == 3
        # upstream_data_version is the upstream partition's own; Dagster's input_data_version tag
        # hashes the data versions of every upstream partition the step read (here one).
        upstream_version = latest(instance, "prompts", "a").tags["dagster/data_version"]
        assert meta["upstream_data_version"].value == upstream_version
        tags = latest(instance, "gen", "a").tags
        assert tags["dagster/input_data_version/prompts"] == hashlib.sha256(upstream_version.encode()).hexdigest()
        checks = {(e.check_name, e.partition): e.passed for e in result.get_asset_check_evaluations()}
        assert checks == {("no_error_rows", "a"): True, ("no_empty_generations", "a"): True,
                          ("truncation_rate", "a"): checks[("truncation_rate", "a")], ("unique_ids", "a"): True,
                          ("unfinished_reasoning", "a"): True}


def test_single_run_backfill_loads_the_model_once_and_writes_each_partition(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=4))
    with dg.instance_for_test() as instance:
        result = run([prompts, gen], env, partition_range=("a", "b"), instance=instance)
        assert result.success and len(env["loads"]) == 1
        for key, rows in (("a", 3), ("b", 2)):
            assert len(pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), key))) == rows
            meta = latest(instance, "gen", key).metadata
            assert meta["dagster/row_count"].value == rows and meta["partitions_in_run"].value == 2
        assert len(instance.get_runs()) == 1
        assert {e.partition for e in result.get_asset_check_evaluations()} == {"a", "b"}
        # The checks, evaluated per partition, still count as the step's outputs.
        messages = [entry.user_message for entry in instance.all_logs(result.run_id)]
        assert not [m for m in messages if "did not yield or return expected outputs" in m]


def test_a_range_on_two_replicas_writes_the_tables_of_one(env, tmp_path):
    """The resource's data_parallel_size: one run over a range deals every day's rows to
    two replicas, and each partition's table equals the one a single replica writes; the
    replica's process is gone when the step ends."""
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=8, temperature=0))
    tables = {}
    for replicas in (1, 2):
        resource = env["resources"]["llm"].model_copy(update={"data_parallel_size": replicas})
        root = tmp_path / f"replicas{replicas}"
        resources = {"llm": resource, "io_manager": ParquetIOManager(base_path=str(root))}
        with dg.instance_for_test() as instance:
            tags = {"dagster/asset_partition_range_start": "a", "dagster/asset_partition_range_end": "b"}
            assert dg.materialize([prompts, gen], tags=tags, resources=resources, instance=instance).success
        columns = ["id", "generated_text", "completion_tokens"]
        tables[replicas] = {key: pd.read_parquet(partition_file(root, dg.AssetKey("gen"), key))[columns]
                            for key in ("a", "b")}
    for key in ("a", "b"):
        pd.testing.assert_frame_equal(tables[2][key], tables[1][key])
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in child_pids()]
    assert not [command for command in commands if b"engine.distributed.child" in command]



def test_sampling_by_partition_and_run_overrides(env):
    prompts = prompts_asset()
    gen = build_generation_asset(
        "gen", upstream=prompts, sampling=SamplingConfig(max_tokens=3),
        sampling_by_partition={"b": SamplingConfig(temperature=0.9, seed=11, max_tokens=5)},
    )
    run([prompts, gen], env, partition_range=("a", "b"))
    a = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "a"))
    b = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "b"))
    # Unset fields take the model's defaults: vLLM's, as the tiny model has no generation config.
    assert (a["temperature"] == engine.SamplingParams().temperature).all() and (a["max_tokens"] == 3).all()
    assert (b["temperature"] == 0.9).all() and (b["seed"] == 11).all() and (b["max_tokens"] == 5).all()
    run([prompts, gen], env, partition="b", run_config={"ops": {"gen": {"config": {"sampling": {"max_tokens": 2}}}}})
    b2 = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "b"))
    assert (b2["max_tokens"] == 2).all() and (b2["temperature"] == 0.9).all()


def test_every_sampling_field_reaches_the_engine_and_the_table(env):
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=8, min_tokens=3, seed=5,
                              stop=["zzz"], ignore_eos=True)
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=sampling)
    run([prompts, gen], env, partition="a")
    table = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "a"))
    with engine.LLM(str(env["model"]), dtype="float32") as llm:
        params = engine.SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                                       frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=8, min_tokens=3,
                                       seed=5, stop=["zzz"], ignore_eos=True)
        direct = llm.generate(list(PROMPTS["a"]["prompt"]), params, use_tqdm=False)
        unpenalized = llm.generate(list(PROMPTS["a"]["prompt"]), engine.SamplingParams(
            temperature=0.8, top_p=0.9, top_k=40, max_tokens=8, seed=5, ignore_eos=True), use_tqdm=False)
    assert list(table["generated_text"]) == [o.outputs[0].text for o in direct]
    assert list(table["generated_text"]) != [o.outputs[0].text for o in unpenalized]
    for field, value in sampling.model_dump().items():
        assert [list(v) if field == "stop" else v for v in table[field]] == [value] * 3, field


def test_row_overrides_and_bad_rows_land_in_the_table(env):
    frames = {"a": pd.DataFrame({"id": ["x", "y", "z"], "prompt": ["Paris is the", "", "The quick"],
                                 "max_tokens": [2, None, 7]}), "b": PROMPTS["b"]}
    prompts = prompts_asset(frames)
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=4, ignore_eos=True))
    result = run([prompts, gen], env, partition="a")
    table = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "a"))
    assert list(table["max_tokens"]) == [2, 4, 7]
    assert list(table["completion_tokens"][[0, 2]]) == [2, 7]
    assert pd.isna(table["error"][0]) and pd.isna(table["error"][2])
    assert "prompt: is empty" in table["error"][1] and pd.isna(table["generated_text"][1])
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert not checks["no_error_rows"].passed and checks["no_error_rows"].metadata["rows"].value == 1


def test_missing_prompt_column_fails_with_a_clear_message(env):
    prompts = prompts_asset({"a": pd.DataFrame({"id": ["1"], "text": ["hi"]}), "b": PROMPTS["b"]})
    gen = build_generation_asset("gen", upstream=prompts)
    result = run([prompts, gen], env, partition="a", raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    message = str(failure.event_specific_data.error)
    assert "has no column 'prompt'" in message and "prompt_column=" in message and "'text'" in message
    assert not env["loads"]  # failed before loading the model


def test_invalid_sampling_config_fails_before_the_model_loads(env):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts)
    with pytest.raises(dg.DagsterInvalidConfigError, match="temprature"):  # unknown field: refused at launch
        run([prompts, gen], env, partition="a", run_config={"ops": {"gen": {"config": {"sampling": {"temprature": 1}}}}})
    result = run([prompts, gen], env, partition="a", raise_on_error=False,
                 run_config={"ops": {"gen": {"config": {"sampling": {"temperature": -1}}}}})
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    rule = engine.SamplingParams.rule
    assert f"ops.gen.config.sampling.temperature must be {rule('temperature')}, got -1" in str(
        failure.event_specific_data.error)
    assert not env["loads"]
    result = run([prompts, gen], env, partition="a", raise_on_error=False,
                 run_config={"ops": {"gen": {"config": {"sampling": {"top_p": 0, "max_tokens": 0}}}}})
    message = str(next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE").event_specific_data.error)
    assert f"sampling.top_p must be {rule('top_p')}" in message
    assert f"sampling.max_tokens must be {rule('max_tokens')}" in message
    assert "ValidationError" not in message and not env["loads"]
    with pytest.raises(Exception, match="top_p"):
        build_generation_asset("gen2", upstream=prompts, sampling=SamplingConfig(top_p=2.0))


def test_unknown_partition_in_the_sampling_mapping_is_a_definition_error():
    prompts = prompts_asset()
    with pytest.raises(dg.DagsterInvalidDefinitionError, match=r"names \['c'\], which match no partition key"):
        build_generation_asset("gen", upstream=prompts, sampling_by_partition={"c": SamplingConfig()})
    build_generation_asset("gen", upstream=prompts, sampling_by_partition={"[ab]": SamplingConfig()})


def test_data_version_tracks_upstream_sampling_and_nothing_else(env):
    frames = {k: v.copy() for k, v in PROMPTS.items()}
    prompts = prompts_asset(frames)
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=3))

    def version(instance):
        return latest(instance, "gen", "a").tags["dagster/data_version"]

    with dg.instance_for_test() as instance:
        run([prompts, gen], env, partition="a", instance=instance)
        first = version(instance)
        run([prompts, gen], env, partition="a", instance=instance)
        assert version(instance) == first
        run([prompts, gen], env, partition="a", instance=instance,
            run_config={"ops": {"gen": {"config": {"sampling": {"max_tokens": 4}}}}})
        assert version(instance) != first
        run([prompts, gen], env, partition="a", instance=instance)
        assert version(instance) == first
        frames["a"] = pd.DataFrame({"id": ["a9"], "prompt": ["Berlin is"]})
        run([prompts, gen], env, partition="a", instance=instance)
        assert version(instance) != first


def test_sampling_settings_are_part_of_the_code_version():
    prompts = prompts_asset()

    def code_version(**kwargs):
        gen = build_generation_asset("gen", upstream=prompts, **kwargs)
        return gen.code_versions_by_key[dg.AssetKey("gen")]

    base = code_version(sampling=SamplingConfig(max_tokens=3))
    assert base == code_version(sampling=SamplingConfig(max_tokens=3))
    assert base != code_version(sampling=SamplingConfig(max_tokens=4))
    assert base != code_version(sampling=SamplingConfig(max_tokens=3), sampling_by_partition={"b": SamplingConfig()})
    assert base.startswith("1+")


def test_multi_dimensional_partitions_with_a_pattern(env):
    parts = dg.MultiPartitionsDefinition({"style": dg.StaticPartitionsDefinition(["plain", "fancy"]),
                                          "lang": dg.StaticPartitionsDefinition(["en", "fr"])})
    frame = PROMPTS["a"]

    @dg.asset(partitions_def=parts, name="prompts")
    def prompts(context: dg.AssetExecutionContext) -> pd.DataFrame:
        return frame

    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=2),
                                 sampling_by_partition={"fr|*": SamplingConfig(max_tokens=3)})
    key = dg.MultiPartitionKey({"style": "fancy", "lang": "fr"})
    run([prompts, gen], env, partition=key)
    path = partition_file(env["root"], dg.AssetKey("gen"), key)
    assert path.parts[-2:] == ("lang=fr", "style=fancy.parquet")
    assert (pd.read_parquet(path)["max_tokens"] == 3).all()


def test_daily_partitions(env):
    days = dg.DailyPartitionsDefinition(start_date="2024-06-01", end_date="2024-06-05")
    frames = {d: PROMPTS["a"] for d in days.get_partition_keys()}
    prompts = prompts_asset(frames, days)
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(max_tokens=2),
                                 sampling_by_partition={"2024-06-0[34]": SamplingConfig(max_tokens=3)})
    run([prompts, gen], env, partition_range=("2024-06-02", "2024-06-03"))
    assert (pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "2024-06-02"))["max_tokens"] == 2).all()
    assert (pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "2024-06-03"))["max_tokens"] == 3).all()


def test_resource_creates_the_engine_lazily_and_frees_it(env):
    resource = env["resources"]["llm"]
    with dg.build_resources({"llm": resource}) as resources:
        assert not env["loads"]
        first = resources.llm.get_llm()
        assert resources.llm.get_llm() is first and len(env["loads"]) == 1
    with pytest.raises(RuntimeError, match="closed"):  # at teardown
        first.llm_engine


def test_rows_of_other_numerics_never_join_a_table(env, tiny_models, monkeypatch):
    """The engine's resolved output settings are part of the data version: materialized again under
    the same CPU kind, the partition's rows are all reused; under another kind (mocked: AVX2,
    where dtype "auto" is float32, after this machine's own kind, where it is bfloat16, or an
    explicit bfloat16 where that is not native), every row is generated again, and the
    metadata says which numerics."""
    own = stand_ins(machine_cpu().flags)[0][-1]  # the widest kind this machine runs as
    prompts, gen = prompts_asset(), build_generation_asset("gen", upstream="prompts", prompt_column="prompt",
                                                           partitions_def=PARTS)
    first_dtype = "auto" if own.info().native_bf16 else "bfloat16"  # "auto" is bfloat16 where it is native
    runs = [(own.name, first_dtype), (own.name, first_dtype), ("avx2", "auto")]
    seen = []
    with dg.instance_for_test() as instance:
        for kind, dtype in runs:
            monkeypatch.setenv(CPU_KIND_ENV, kind)
            detect_cpu.cache_clear()
            resources = {**env["resources"], "llm": LLMResource(model_id=str(tiny_models["llama"]), dtype=dtype,
                                                                kv_cache_memory=10 << 20)}
            result = dg.materialize([prompts, gen], partition_key="a", resources=resources, instance=instance)
            meta = latest(instance, "gen", "a").metadata
            seen.append((meta["resumed_rows"].value, meta["generated_rows"].value, meta["engine_output_settings"].value,
                         meta["data_version"].value))
        said = [r.user_message for r in instance.all_logs(result.run_id) if "generated again" in r.user_message]
    detect_cpu.cache_clear()
    assert len(said) == 1 and "dtype float32" in said[0], said
    (_, generated, numerics, version), (resumed, regenerated, _, same), (resumed_after, generated_after, other,
                                                                        changed) = seen
    assert (generated, resumed, regenerated, same) == (3, 3, 0, version)
    assert numerics["dtype"] == "bfloat16" and other["dtype"] == "float32"
    assert (resumed_after, generated_after) == (0, 3) and changed != version


def _engine_messages(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """The run's log messages that came from the engine's logger."""
    return [record.user_message for record in instance.all_logs(run_id)
            if record.user_message and "engine: " in record.user_message]


def test_the_engines_log_reaches_the_run(env, tmp_path):
    """The engine's start-up choices (device, dtype, kernels, KV cache blocks) are in the run's
    event log, once; after the step the engine's logger is as it was. An instance whose
    python_logs captures the `engine` logger itself gets them once too, not twice."""
    prompts, gen = prompts_asset(), build_generation_asset("gen", upstream="prompts", prompt_column="prompt",
                                                           partitions_def=PARTS)
    logger = logging.getLogger("engine")
    before = (logger.level, list(logger.handlers))
    with dg.instance_for_test() as instance:
        result = run([prompts, gen], env, partition="a", instance=instance)
        messages = _engine_messages(instance, result.run_id)
    startup = [m for m in messages if "engine: CPU: " in m or "engine: GPU: " in m]
    assert len(startup) == 1 and "dtype float32" in startup[0], messages
    assert any("engine: KV cache: " in m and " blocks " in m for m in messages)
    assert (logger.level, list(logger.handlers)) == before
    managed = {"python_logs": {"managed_python_loggers": ["engine"], "python_log_level": "INFO"}}
    with dg.instance_for_test(overrides=managed) as instance:
        result = run([prompts, gen], env, partition="b", instance=instance)
        captured = [r.user_message for r in instance.all_logs(result.run_id)
                    if r.user_message and ("CPU: " in r.user_message or "GPU: " in r.user_message)]
    assert len(captured) == 1, captured


def test_unset_sampling_fields_take_the_models_generation_config_as_llm_generate_does(env, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(env["model"], model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5, "max_new_tokens": 4}))
    resources = {**env["resources"], "llm": LLMResource(model_id=str(model), dtype="float32", kv_cache_memory=10 << 20)}
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(seed=3, ignore_eos=True),
                                 sampling_by_partition={"b": SamplingConfig(temperature=0, max_tokens=2)})
    with dg.instance_for_test() as instance:
        dg.materialize([prompts, gen], partition_key="a", resources=resources, instance=instance)
        dg.materialize([prompts, gen], partition_key="b", resources=resources, instance=instance)
        a = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "a"))
        assert (a["temperature"] == 0.3).all() and (a["top_k"] == 5).all() and (a["max_tokens"] == 4).all()
        assert (a["completion_tokens"] == 4).all() and (a["seed"] == 3).all()
        with engine.LLM(str(model), dtype="float32") as llm:
            params = llm.get_default_sampling_params()
            params.seed, params.ignore_eos = 3, True
            direct = llm.generate(list(PROMPTS["a"]["prompt"]), params, use_tqdm=False)
        assert list(a["generated_text"]) == [o.outputs[0].text for o in direct]
        assert latest(instance, "gen", "a").metadata["sampling_config"].value["temperature"] == 0.3
        # Set fields win over the model's defaults; the table records what ran (greedy turns top_k off).
        b = pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "b"))
        assert (b["temperature"] == 0).all() and (b["max_tokens"] == 2).all() and (b["top_k"] == 0).all()


def test_speculative_decoding_on_the_resource_keeps_the_table_and_reports_acceptance(env, tiny_models):
    """A resource with n-gram speculation, and one with a draft model (the target itself, so
    that its proposals are accepted), write the same greedy table as one without, and the
    materialization records how many proposed tokens were accepted."""
    frames = {"a": pd.DataFrame({"id": ["r1", "r2"], "prompt": ["a b c a b c a b c a b", "x y x y x y x y x"]})}
    parts = dg.StaticPartitionsDefinition(["a"])
    tables, speculations = [], []
    with dg.instance_for_test() as instance:
        for speculative in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3},
                            {"model": str(tiny_models["llama"]), "num_speculative_tokens": 3}):
            gen = build_generation_asset("gen", upstream="prompts", partitions_def=parts,
                                         sampling=SamplingConfig(temperature=0, max_tokens=24, ignore_eos=True))
            resources = {**env["resources"], "llm": LLMResource(model_id=str(tiny_models["llama"]), dtype="float32",
                                                                kv_cache_memory=10 << 20,
                                                                speculative_config=speculative)}
            dg.materialize([prompts_asset(frames, parts), gen], partition_key="a", resources=resources,
                           instance=instance, run_config={"ops": {"gen": {"config": {"resume": False}}}})
            tables.append(pd.read_parquet(partition_file(env["root"], dg.AssetKey("gen"), "a")))
            speculations.append(latest(instance, "gen", "a").metadata.get("speculative_decoding"))
    assert speculations[0] is None
    for table, speculation in zip(tables[1:], speculations[1:]):
        pd.testing.assert_frame_equal(tables[0], table)
        speculation = speculation.value
        assert speculation["accepted_tokens"] > 0 and 0 < speculation["acceptance_rate"] <= 1
        assert speculation["mean_acceptance_length"] > 1
