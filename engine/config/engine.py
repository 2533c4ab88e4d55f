"""`EngineConfig`, everything `LLM(...)` accepts, composed of the groups of settings beside
this module (as vLLM's `VllmConfig` in `config/vllm.py` is of its configs, but flat: each
setting is an attribute of the one config, `config.block_size`): it runs each group's checks
and resolution, and the ones that join two groups."""

import os
from dataclasses import Field, dataclass, fields, replace

from engine.config.cache import CacheSettings
from engine.config.device import DeviceSettings
from engine.config.lora import LoRASettings
from engine.config.model import ModelConfig, ModelSettings
from engine.config.multimodal import MultiModalSettings
from engine.config.parallel import ParallelSettings
from engine.config.parsers import ParserSettings
from engine.config.scheduler import SchedulerSettings
from engine.config.speculative import SpeculativeSettings
from engine.config.utils import MODEL_FILES, _type_problem

# The groups in the order users see their settings (`engine_settings()`: the `LLM` docs, the
# command line's options, the Dagster resource's fields), the model's first; their checks
# and resolution run in this order too.
_GROUPS = (ModelSettings, DeviceSettings, SchedulerSettings, CacheSettings, ParallelSettings, LoRASettings,
           MultiModalSettings, ParserSettings, SpeculativeSettings)


# The KV cache of a CPU engine whose dtype and cache dtype are both left to it: the compiled
# kernel's bfloat16 cache, also under a float32 model (the default without native bfloat16),
# where it halves what decode reads (decode attention 3.7 -> 2.3 s of workload (b) on an AVX2
# Zen 3) and keeps the float32 cache's greedy tokens on 62 of 64 chat prompts
# (benchmarks/quantization_agreement.py; a bfloat16 model keeps 46). An explicit dtype keeps
# its own cache.
CPU_AUTO_KV_CACHE_DTYPE = "bfloat16"


# A dataclass takes its bases' fields in reverse method resolution order: the groups are
# listed reversed, so that the fields come in `_GROUPS`' order.
@dataclass
class EngineConfig(*reversed(_GROUPS)):
    """Everything `LLM(...)` accepts; the meaning of each field follows vLLM's and is in
    its `help` (`engine_settings()` lists them)."""

    def __post_init__(self) -> None:
        for setting in fields(self):  # a folder may be given as a path object
            value = getattr(self, setting.name)
            if setting.metadata.get("affects") == MODEL_FILES and isinstance(value, os.PathLike):
                setattr(self, setting.name, os.fspath(value))
        wrong = [problem for setting in fields(self)
                 if (problem := _type_problem(setting, getattr(self, setting.name)))]
        if wrong:
            raise TypeError("Invalid engine settings: " + "; ".join(wrong))
        problems = self.problems()
        if problems:
            raise ValueError("Invalid engine settings: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with the values (their types checked): each group's problems, then
        those of settings of two groups together."""
        problems = [problem for group in _GROUPS for problem in group.problems(self)]
        if self.speculative_config is not None and self.async_scheduling:
            problems.append("async_scheduling=True does not combine with speculative_config: a step's accepted "
                            "tokens decide the next step's inputs; leave async_scheduling None")
        return problems

    def resolve(self, model_config: ModelConfig, attention_backend: str) -> "EngineConfig":
        """These settings with every default filled in for the model and the device it
        runs on: the one place defaults are decided (each group's `resolved`, in `_GROUPS`'
        order), and what the engine, the scheduler and the model runner read. `self` is left
        as it is. `attention_backend` is what this field resolves to on the model's device
        (`engine.attention.selector.resolve_backend_name`).

        kv_cache_memory stays None on a GPU, where the model runner measures it. A CPU
        engine's cache is CPU_AUTO_KV_CACHE_DTYPE where dtype and kv_cache_dtype are both "auto".

        Raises:
            ValueError: without chunked prefill, a step budget below max_model_len (a long
                prompt could never run); an attention backend that cannot run here, or
                that cannot read the kv_cache_dtype; batch_invariant on a GPU.
        """
        changes = {}
        for group in _GROUPS:
            changes |= group.resolved(self, model_config, attention_backend)
        if self.async_scheduling is None:  # on with a GPU, unless speculation decides the next step's inputs
            changes["async_scheduling"] = model_config.device.type == "cuda" and self.speculative_config is None
        if self.dtype == self.kv_cache_dtype == "auto" and attention_backend == "cpu":
            changes["kv_cache_dtype"] = CPU_AUTO_KV_CACHE_DTYPE
        return replace(self, **changes)


def engine_settings() -> list[Field]:
    """The fields of `EngineConfig`, each with its type, default and `metadata["help"]`."""
    return list(fields(EngineConfig))
