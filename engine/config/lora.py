"""The LoRA adapters' settings (`LoRASettings`), as vLLM's `config/lora.py`."""

from dataclasses import dataclass
from typing import Any

from engine.config.utils import OPERATIONAL, SettingsGroup, _setting, positive_problems


@dataclass
class LoRASettings(SettingsGroup):
    """Whether adapters are accepted, and how many of which rank are kept where."""

    enable_lora: bool = _setting(False, "Accept LoRA adapters (`lora_request` in generate and chat).", OPERATIONAL)
    max_loras: int = _setting(1, "Most distinct adapters in one step (device slots).", OPERATIONAL)
    max_lora_rank: int = _setting(16, "Highest adapter rank accepted.", OPERATIONAL)
    max_cpu_loras: int | None = _setting(None, "Adapters kept in host memory (default: max_loras).", OPERATIONAL)

    def problems(self) -> list[str]:
        problems = positive_problems(self, ["max_loras", "max_lora_rank"])
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            problems.append(f"max_cpu_loras must be at least max_loras={self.max_loras}, got {self.max_cpu_loras!r}")
        return problems

    def resolved(self, model_config: Any, attention_backend: str) -> dict[str, Any]:
        """The adapters kept in host memory: max_loras when not set."""
        return {"max_cpu_loras": self.max_cpu_loras or self.max_loras}
