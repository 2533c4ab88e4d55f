"""Beam search as a generation asset's decoding option per partition: the best beam is the
row's completion, equal to `LLM.beam_search`'s, recorded with its beam width and in the
data version; sampled partitions of the same asset are unchanged."""

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq
import pytest

from dagster_llm import BeamSearchConfig, SamplingConfig, build_generation_asset, partition_file
from engine import LLM, BeamSearchParams, SamplingParams

PARTS = dg.StaticPartitionsDefinition(["sampled", "beams", "wide"])
PROMPTS = ["The quick brown fox", "Paris is the capital of", "A paged KV cache"]


@dg.asset(partitions_def=PARTS)
def questions(context: dg.AssetExecutionContext) -> pd.DataFrame:
    return pd.DataFrame({"id": [f"{context.partition_key}-{i}" for i in range(3)], "prompt": PROMPTS})


def test_partitions_sample_or_search_beams_as_declared(env):
    answers = build_generation_asset(
        "answers", upstream=questions, sampling=SamplingConfig(temperature=0, max_tokens=8, ignore_eos=True),
        beam_search_by_partition={"beams": BeamSearchConfig(beam_width=3),
                                  "wide": BeamSearchConfig(beam_width=4, length_penalty=0.5)})
    tables = {}
    with dg.instance_for_test() as instance:
        for key in ("sampled", "beams", "wide"):
            assert dg.materialize([questions, answers], partition_key=key, resources=env["resources"],
                                  instance=instance).success
            tables[key] = pq.read_table(partition_file(env["root"], dg.AssetKey("answers"), key)).to_pandas()
    with LLM(str(env["model"]), dtype="float32") as llm:
        greedy = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8,
                                                                                   ignore_eos=True))]
        beams = {width: [o.sequences[0].text for o in llm.beam_search(
            PROMPTS, BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True, length_penalty=penalty))]
            for width, penalty in ((3, 1.0), (4, 0.5))}
    assert list(tables["sampled"]["generated_text"]) == greedy and tables["sampled"]["beam_width"].isna().all()
    assert list(tables["beams"]["generated_text"]) == beams[3] and (tables["beams"]["beam_width"] == 3).all()
    assert list(tables["wide"]["generated_text"]) == beams[4] and (tables["wide"]["beam_width"] == 4).all()
    assert beams[3] != greedy, "beams that equal greedy decoding test nothing"
    assert (tables["beams"]["completion_tokens"] == 8).all() and tables["beams"]["error"].isna().all()


def test_beam_search_and_a_structured_output_are_refused_together():
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="partition 'beams' has a beam search and a structured"):
        build_generation_asset("answers", upstream=questions, choices=["yes", "no"],
                               beam_search_by_partition={"beams": BeamSearchConfig(beam_width=2)})
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="beam_width"):
        build_generation_asset("answers", upstream=questions, beam_search={"beam_width": 0})
