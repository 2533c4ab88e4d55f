"""`LoRARequest`: which adapter a request runs with (vLLM's offline API)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors).

    Args:
        lora_name: A name for logs, outputs and metadata.
        lora_int_id: The adapter's identity inside one engine: a positive integer, one per
            adapter. It keys the adapter caches and the prefix cache.
        lora_path: The adapter's folder.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
