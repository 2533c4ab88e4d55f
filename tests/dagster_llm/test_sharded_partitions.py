"""Row shards: one day's rows split over separate runs, each committing and resuming on its
own, and a downstream daily asset that reads the day as one table."""

import dagster as dg
import pandas as pd
import pytest

from dagster_llm import SamplingConfig, build_generation_asset, partition_file
from dagster_llm.partitions import RowShard

DAY = "2024-06-01"
days = dg.DailyPartitionsDefinition(start_date=DAY, end_date="2024-06-03")
IDS = [f"t{i}" for i in range(12)]


@dg.asset(partitions_def=days)
def tickets() -> pd.DataFrame:
    return pd.DataFrame({"id": IDS, "prompt": [f"Ticket {i}" for i in range(len(IDS))]})


gen = build_generation_asset("gen", upstream=tickets, row_shards=3,
                             sampling=SamplingConfig(max_tokens=2, ignore_eos=True))


@dg.asset(partitions_def=days)
def day_summary(context: dg.AssetExecutionContext, gen: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"rows": [len(gen)], "ids": [",".join(sorted(gen["id"]))]})


def shard_key(shard: int) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"partition": DAY, "shard": str(shard)})


def test_every_id_lands_in_exactly_one_shard_whatever_the_other_rows():
    ids = [f"row-{i}" for i in range(3000)]
    shards = [RowShard(i, 4) for i in range(4)]
    counts = [sum(shard.holds(i) for i in ids) for shard in shards]
    assert sum(counts) == len(ids) and min(counts) > 600  # each id in one shard, none starved
    assert [s.holds("row-7") for s in shards] == [RowShard(i, 4).holds("row-7") for i in range(4)]  # stable


def test_a_sharded_asset_has_a_shard_dimension_and_runs_one_shard_per_run():
    assert gen.partitions_def.partition_dimension_names == ["partition", "shard"]
    assert gen.partitions_def.get_partition_keys()[:3] == [f"{DAY}|0", f"{DAY}|1", f"{DAY}|2"]
    assert gen.backfill_policy == dg.BackfillPolicy.multi_run(1)
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="row_shards splits each upstream partition's rows, "
                                                               "but the upstream asset is not partitioned"):
        build_generation_asset("flat", upstream="prompts", row_shards=2)
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="row_shards: value error, must be at least 1, got 0"):
        build_generation_asset("none", upstream=tickets, row_shards=0)


@pytest.mark.slow
def test_shards_run_separately_and_a_daily_asset_reads_the_whole_day(env):
    with dg.instance_for_test() as instance:
        assert dg.materialize([tickets], partition_key=DAY, instance=instance, resources=env["resources"]).success
        shard_ids = []
        for shard in range(3):
            result = dg.materialize([tickets, gen], selection=[gen], partition_key=shard_key(shard),
                                    instance=instance, resources=env["resources"])
            assert result.success
            table = pd.read_parquet(partition_file(env["root"], ["gen"], shard_key(shard)))
            assert all(RowShard(shard, 3).holds(i) for i in table["id"]) and (table["completion_tokens"] == 2).all()
            shard_ids += list(table["id"])
        assert sorted(shard_ids) == sorted(IDS)
        assert (env["root"] / "gen" / f"partition={DAY}" / "shard=2.parquet").exists()

        again = dg.materialize([tickets, gen], selection=[gen], partition_key=shard_key(1), instance=instance,
                               resources=env["resources"])
        meta = again.asset_materializations_for_node("gen")[0].metadata
        assert meta["resumed_rows"].value == meta["dagster/row_count"].value > 0 and meta["generated_rows"].value == 0

        summary = dg.materialize([tickets, gen, day_summary], selection=[day_summary], partition_key=DAY, instance=instance,
                                 resources=env["resources"])
        table = pd.read_parquet(partition_file(env["root"], ["day_summary"], DAY))
        assert summary.success and table["rows"][0] == len(IDS) and table["ids"][0] == ",".join(sorted(IDS))
