"""The scheduler's settings (`SchedulerSettings`: a step's sequences and tokens, chunked
prefill, the policy, asynchronous scheduling), as vLLM's `config/scheduler.py`."""

from dataclasses import dataclass
from typing import Any

from engine.config.utils import OPERATIONAL, SettingsGroup, _setting, positive_problems

# Default token budget of one step, by device type. On a CPU a step of 1,024 tokens measured
# 1.3-1.5x the throughput of 4,096 on prefill-heavy batches (its activations stay in cache
# between operators); on a GPU a larger step keeps the device busy.
DEFAULT_STEP_TOKENS = {"cpu": 1024, "cuda": 4096}


@dataclass
class SchedulerSettings(SettingsGroup):
    """What one step may hold, and in which order requests run."""

    max_num_seqs: int = _setting(256, "Most sequences in one step.", OPERATIONAL)
    max_num_batched_tokens: int | None = _setting(None, "Most tokens computed in one step (default "
                                                        f"{DEFAULT_STEP_TOKENS['cpu']} on a CPU, "
                                                        f"{DEFAULT_STEP_TOKENS['cuda']} on a GPU).", OPERATIONAL)
    enable_chunked_prefill: bool = _setting(True, "Split long prompts over several steps.", OPERATIONAL)
    scheduling_policy: str = _setting("fcfs", "'fcfs', or 'priority' (lower `priority` values run first; under "
                                              "'fcfs' a request's priority is accepted and ignored, as in vLLM).", OPERATIONAL)
    async_scheduling: bool | None = _setting(None, "Schedule each step while the previous one runs, and read its "
                                                   "sampled tokens back one step later (vLLM's async scheduling; "
                                                   "outputs are the same either way). None: on with a GPU, off on a "
                                                   "CPU, where the forward pass and the host work share the cores.", OPERATIONAL)

    def problems(self) -> list[str]:
        problems = positive_problems(self, ["max_num_seqs"])
        problems += positive_problems(self, ["max_num_batched_tokens"], optional=True)
        if self.scheduling_policy not in ("fcfs", "priority"):
            problems.append(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        return problems

    def resolved(self, model_config: Any, attention_backend: str) -> dict[str, Any]:
        """A step's token budget: the device's default (at least max_model_len without
        chunked prefill), or the one given. async_scheduling's default, which depends on
        speculative decoding too, is `EngineConfig.resolve`'s.

        Raises:
            ValueError: without chunked prefill, a budget below max_model_len (a long prompt
                could never run).
        """
        step_tokens, max_model_len = self.max_num_batched_tokens, model_config.max_model_len
        if step_tokens is None:
            step_tokens = DEFAULT_STEP_TOKENS[model_config.device.type]
            step_tokens = step_tokens if self.enable_chunked_prefill else max(step_tokens, max_model_len)
        elif not self.enable_chunked_prefill and step_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={step_tokens} is below max_model_len={max_model_len}: without chunked "
                f"prefill a long prompt could never run. Raise it, lower max_model_len, or enable_chunked_prefill=True"
            )
        return {"max_num_batched_tokens": step_tokens}
