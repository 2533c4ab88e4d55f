"""Where each process of the engine runs: the devices (or CPU cores) of every rank of
every replica, checked against the machine and the model before anything starts."""

import os
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from engine.hardware import available_cpus

# Set to 1, every rank of a GPU plan shares the first device and talks over gloo: how the
# multi-process path is checked on a machine with one GPU.
RANKS_ON_ONE_DEVICE_ENV = "DAGSTER_LLM_RANKS_ON_ONE_DEVICE"


@dataclass(frozen=True)
class RankPlacement:
    """One process: replica `replica`, tensor-parallel rank `rank`, on `device` (on a
    CPU, pinned to `cores`; None for the engine's own process, which is never pinned)."""

    replica: int
    rank: int
    device: torch.device
    cores: tuple[int, ...] | None

    def describe(self) -> str:
        where = str(self.device) if self.cores is None else f"cpu cores {','.join(map(str, self.cores))}"
        return f"replica {self.replica} rank {self.rank}: {where}"


@dataclass(frozen=True)
class ReplicaPlan:
    """The processes of one replica: its tensor-parallel ranks in order, and the
    backend of their collectives ("gloo" or "nccl")."""

    placements: list[RankPlacement]
    backend: str


@dataclass(frozen=True)
class ParallelPlan:
    """Every process of an engine, replica by replica."""

    replicas: list[ReplicaPlan]


_INTERMEDIATE_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def plan_parallelism(tensor_parallel_size: int, data_parallel_size: int, device: torch.device) -> ParallelPlan:
    """Places tensor_parallel_size x data_parallel_size processes: on GPUs, one device
    each from `device`'s index on; on a CPU, an equal share of the cores this process may
    use each (the first share is the engine's own process).

    Raises:
        ValueError: more processes than devices, or than cores, with the numbers and the fix.
    """
    tp, dp = tensor_parallel_size, data_parallel_size
    count = tp * dp
    if device.type == "cuda":
        return _gpu_plan(tp, dp, device)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    usable = min(len(cores), available_cpus())
    if count > usable:
        raise ValueError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} = {count} processes, but this process may use "
            f"{usable} CPU core(s) and each process needs one of its own: lower tensor_parallel_size or "
            f"data_parallel_size so that their product is at most {usable}"
        )
    share = usable // count

    def place(d: int, r: int) -> RankPlacement:
        first = (d * tp + r) * share
        return RankPlacement(d, r, torch.device("cpu"), None if d == r == 0 else tuple(cores[first:first + share]))

    return ParallelPlan([ReplicaPlan([place(d, r) for r in range(tp)], "gloo") for d in range(dp)])


def _gpu_plan(tp: int, dp: int, device: torch.device) -> ParallelPlan:
    first = device.index or 0
    if os.environ.get(RANKS_ON_ONE_DEVICE_ENV) == "1":
        one = torch.device("cuda", first)
        return ParallelPlan([ReplicaPlan([RankPlacement(d, r, one, None) for r in range(tp)], "gloo")
                             for d in range(dp)])
    visible = torch.cuda.device_count()
    count = tp * dp
    if first + count > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        which = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ValueError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} = {count} GPUs from cuda:{first}, but "
            f"{visible} GPU(s) are visible{which}: lower tensor_parallel_size or data_parallel_size so that their "
            f"product is at most {visible - first}, or make more GPUs visible"
        )
    return ParallelPlan([ReplicaPlan([RankPlacement(d, r, torch.device("cuda", first + d * tp + r), None)
                                      for r in range(tp)], "nccl") for d in range(dp)])


def check_tensor_parallel(hf_config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """Checks that the model splits evenly over the ranks: query heads, key/value heads
    (divisible by the ranks, or dividing them, when each key/value head is replicated)
    and the MLP's intermediate size.

    Raises:
        ValueError: naming each dimension that does not split, and the sizes that would.
    """
    tp = tensor_parallel_size
    if tp == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    # The MLP's, each expert's and the shared expert's intermediate features split over the ranks.
    mlp_sizes = {name: getattr(hf_config, name) for name in _INTERMEDIATE_SIZES if getattr(hf_config, name, None)}
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by it")
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} neither divides it nor is divisible by it")
    problems += [f"{name}={size} is not divisible by it" for name, size in mlp_sizes.items() if size % tp]
    if problems:
        sizes = [n for n in range(1, heads + 1) if not heads % n and not any(size % n for size in mlp_sizes.values())
                 and (not kv_heads % n or not n % kv_heads)]
        raise ValueError(f"tensor_parallel_size={tp} does not split this model: {'; '.join(problems)}. "
                         f"Sizes that do: {sizes}")
