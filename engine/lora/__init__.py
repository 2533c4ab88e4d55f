"""Per-request LoRA adapters: loading PEFT folders, host and device slot caches."""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
