"""LoRA adapters in the generation asset: per partition, per row, in metadata and versions."""

import dagster as dg
import pandas as pd
import pytest

import engine
from dagster_llm import LLMResource, SamplingConfig, build_generation_asset, partition_file
from tests.dagster_llm.test_generation_asset import PROMPTS, latest, prompts_asset, run
from tests.lora_adapters import build_lora_adapter

SAMPLING = SamplingConfig(temperature=0, max_tokens=6, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def adapters(tiny_models, tmp_path):
    return {name: build_lora_adapter(tiny_models["llama"], tmp_path / name, rank=4, alpha=8, target_modules=TARGETS,
                                     seed=seed)
            for seed, name in enumerate(["support", "sales"])}


@pytest.fixture
def lora_env(env, tiny_models):
    env["resources"]["llm"] = LLMResource(model_id=str(tiny_models["llama"]), dtype="float32",
                                          kv_cache_memory=10 << 20, enable_lora=True, max_loras=2, max_lora_rank=8)
    return env


def direct(model, prompts, adapter_folder):
    with engine.LLM(str(model), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        request = engine.LoRARequest("x", 1, str(adapter_folder)) if adapter_folder else None
        outs = llm.generate(list(prompts), SAMPLING.effective_params(llm.get_default_sampling_params()), lora_request=request, use_tqdm=False)
        digest = llm.add_lora(request) if request else None
    return [o.outputs[0].text for o in outs], digest


def test_two_partitions_with_different_adapters_in_one_single_run_backfill(lora_env, adapters):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING, adapters=adapters,
                                 adapter_by_partition={"a": "support", "b": "sales"})
    with dg.instance_for_test() as instance:
        result = run([prompts, gen], lora_env, partition_range=("a", "b"), instance=instance)
        assert result.success and len(lora_env["loads"]) == 1 and len(instance.get_runs()) == 1
        for key, name in (("a", "support"), ("b", "sales")):
            table = pd.read_parquet(partition_file(lora_env["root"], dg.AssetKey("gen"), key))
            texts, digest = direct(lora_env["model"], PROMPTS[key]["prompt"], adapters[name])
            base_texts, _ = direct(lora_env["model"], PROMPTS[key]["prompt"], None)
            assert list(table["generated_text"]) == texts and texts != base_texts
            assert (table["adapter"] == name).all()
            meta = latest(instance, "gen", key).metadata
            assert meta["adapter"].value == name
            assert meta["adapter_fingerprints"].value == {name: digest}


def test_adapter_column_unknown_names_and_data_version(lora_env, adapters, tiny_models):
    frames = {"a": pd.DataFrame({"id": ["x", "y", "z"], "prompt": ["Paris is the", "The quick brown fox", "A paged"],
                                 "adapter": ["sales", None, "marketing"]}), "b": PROMPTS["b"]}
    prompts = prompts_asset(frames)
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING, adapters=adapters, adapter="support")
    with dg.instance_for_test() as instance:
        run([prompts, gen], lora_env, partition="a", instance=instance)
        table = pd.read_parquet(partition_file(lora_env["root"], dg.AssetKey("gen"), "a"))
        assert list(table["adapter"]) == ["sales", "support", "marketing"]
        assert list(table["generated_text"][:1]) == direct(lora_env["model"], ["Paris is the"], adapters["sales"])[0]
        assert list(table["generated_text"][1:2]) == direct(lora_env["model"], ["The quick brown fox"],
                                                           adapters["support"])[0]
        assert "adapter: 'marketing' is not a declared adapter (sales, support)" in table["error"][2]
        meta = latest(instance, "gen", "a").metadata
        assert set(meta["adapter_fingerprints"].value) == {"sales", "support"}
        version = latest(instance, "gen", "a").tags["dagster/data_version"]

        run([prompts, gen], lora_env, partition="a", instance=instance)
        assert latest(instance, "gen", "a").tags["dagster/data_version"] == version
        # New weights in the same folder: a new fingerprint, so a new data version.
        build_lora_adapter(tiny_models["llama"], adapters["sales"], rank=4, alpha=8, target_modules=TARGETS, seed=9)
        run([prompts, gen], lora_env, partition="a", instance=instance)
        assert latest(instance, "gen", "a").tags["dagster/data_version"] != version


def test_adapters_need_a_lora_resource_and_declared_names(env, adapters):
    prompts = prompts_asset()
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING, adapters=adapters, adapter="sales")
    result = run([prompts, gen], env, partition="a", raise_on_error=False)
    assert not result.success and not env["loads"]  # the model never loaded
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "enable_lora=False: set LLMResource(enable_lora=True" in str(failure.event_specific_data.error)
    with pytest.raises(dg.DagsterInvalidDefinitionError, match=r"adapter\(s\) \['legal'\] are not declared"):
        build_generation_asset("gen", upstream=prompts, adapters=adapters, adapter_by_partition={"a": "legal"})


def test_a_missing_adapter_folder_fails_only_the_rows_that_use_it(lora_env, adapters, tmp_path):
    frames = {"a": pd.DataFrame({"id": ["x", "y", "z"], "prompt": ["Paris is the", "The quick", "A paged"],
                                 "adapter": ["gone", None, "sales"]}), "b": PROMPTS["b"]}
    prompts = prompts_asset(frames)
    gen = build_generation_asset("gen", upstream=prompts, sampling=SAMPLING,
                                 adapters={**adapters, "gone": tmp_path / "gone"})
    result = run([prompts, gen], lora_env, partition="a", raise_on_error=False)
    assert result.success
    table = pd.read_parquet(partition_file(lora_env["root"], dg.AssetKey("gen"), "a"))
    assert "adapter 'gone'" in table["error"][0] and "does not exist" in table["error"][0]
    assert table["error"][1:].isna().all() and table["generated_text"][1:].notna().all()
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["no_error_rows"] is False and checks["unique_ids"] is True


def test_the_component_declares_adapters(lora_env, adapters):
    from dagster_llm import GenerationComponent

    component = GenerationComponent(name="gen", upstream="prompts", partitions=["a", "b"], sampling=SAMPLING.model_dump(),
                                    adapters={k: str(v) for k, v in adapters.items()},
                                    adapter_by_partition={"b": "sales"})
    [gen] = dg.build_defs_for_component(component).assets
    run([prompts_asset(), gen], lora_env, partition="b")
    table = pd.read_parquet(partition_file(lora_env["root"], dg.AssetKey("gen"), "b"))
    assert (table["adapter"] == "sales").all()
    assert list(table["generated_text"]) == direct(lora_env["model"], PROMPTS["b"]["prompt"], adapters["sales"])[0]
