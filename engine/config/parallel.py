"""How the work is spread over processes and cores (`ParallelSettings`: tensor and data
parallelism, CPU threads per rank), as vLLM's `config/parallel.py`."""

from dataclasses import dataclass
from typing import Any

from engine.config.utils import OPERATIONAL, OUTPUT, SettingsGroup, _setting, positive_problems


@dataclass
class ParallelSettings(SettingsGroup):
    """The ranks the engine runs in, and the CPU threads of each."""

    num_threads: int | None = _setting(None, "CPU threads for PyTorch's operators, set for each process that runs "
                                             "a rank (default: OMP_NUM_THREADS if set, else the cores this process "
                                             "may use, divided among the ranks).", OPERATIONAL)
    tensor_parallel_size: int = _setting(1, "Ranks one model is split over, one process each (Megatron-style: "
                                            "attention by heads, the MLP by columns, the vocabulary in slices, one "
                                            "all-reduce after each row-parallel projection): GPUs over NCCL, or on a "
                                            "CPU shares of its cores over gloo.", OUTPUT)
    data_parallel_size: int = _setting(1, "Replicas of the model, each in its own process on its own devices (or "
                                          "share of CPU cores). A call's prompts are dealt out among them by "
                                          "estimated work and come back in input order; a seeded request gives the "
                                          "same tokens whatever the number of replicas.", OPERATIONAL)

    def problems(self) -> list[str]:
        return (positive_problems(self, ["tensor_parallel_size", "data_parallel_size"])
                + positive_problems(self, ["num_threads"], optional=True))

    def resolved(self, model_config: Any, attention_backend: str) -> dict[str, Any]:
        """A CPU's threads per rank (`default_threads_per_rank`) when num_threads is not set;
        None on a GPU."""
        on_cpu = model_config.device.type == "cpu"
        return {"num_threads": self.num_threads or (self.default_threads_per_rank() if on_cpu else None)}

    @property
    def world_size(self) -> int:
        """Processes the engine runs in: tensor_parallel_size x data_parallel_size."""
        return self.tensor_parallel_size * self.data_parallel_size

    def default_threads_per_rank(self) -> int:
        """CPU threads of each rank when num_threads is not set: the process's threads
        (`default_num_threads`) shared among the ranks, at least one."""
        from engine.hardware import default_num_threads

        return max(1, default_num_threads() // self.world_size)
