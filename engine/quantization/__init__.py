"""Quantized weights: which method a model runs with (`resolve_quantization`), and handing
each projection its method (`apply_quantization`).

As in vLLM, `LLM(quantization=...)` names the method, or None takes the checkpoint's own
(`quantization_config` in config.json), and a method the checkpoint contradicts or the
device cannot run is refused before any weight is read. A layer's method quantizes its
weights once they are loaded (`process_weights`) and computes its products (`apply`);
projections that must stay exact for the output's sake (the language-model head, the
experts' routers) keep the model's dtype.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.hardware import detect_cpu
from engine.quantization.int8 import Int8LinearMethod, Int8MoEMethod

# Method -> the device types it runs on.
QUANTIZATION_METHODS: dict[str, tuple[str, ...]] = {"int8": ("cpu",)}


def checkpoint_quantization(hf_config: PretrainedConfig) -> str | None:
    """The method config.json's `quantization_config` names, if any."""
    settings = getattr(hf_config, "quantization_config", None)
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else getattr(settings, "quant_method", None)
    return str(getattr(method, "value", method)).lower() if method is not None else "unknown"


def resolve_quantization(requested: str | None, hf_config: PretrainedConfig, device: torch.device) -> str | None:
    """The method the model runs with: `requested`, else the checkpoint's; None for the
    model's own dtype.

    Raises:
        ValueError: a method this engine does not run, one the checkpoint contradicts, or
            one the device cannot run, naming the fix.
    """
    stored = checkpoint_quantization(hf_config)
    if stored is not None:
        if stored not in QUANTIZATION_METHODS:
            raise ValueError(f"the checkpoint's weights are quantized with {stored!r} (config.json "
                             f"quantization_config), which this engine cannot load; it loads 16- and 32-bit "
                             f"checkpoints, quantized at load with quantization={sorted(QUANTIZATION_METHODS)}")
        if requested is not None and requested != stored:
            raise ValueError(f"quantization={requested!r} contradicts the checkpoint's {stored!r} (config.json "
                             f"quantization_config); leave quantization unset to use the checkpoint's")
    method = requested or stored
    if method is None:
        return None
    devices = QUANTIZATION_METHODS[method]
    if device.type not in devices:
        raise ValueError(f"quantization={method!r} runs on {' or '.join(devices)}, not on {device.type}; "
                         f"leave quantization unset there")
    if method == "int8" and not (cpu := detect_cpu()).int8_vnni:
        raise ValueError(f"quantization='int8' needs a CPU with VNNI or AMX (avx512_vnni, avx_vnni or amx_int8), "
                         f"where int8 products sum exactly; this one ({cpu.describe()}) has neither. Leave "
                         f"quantization unset")
    return method


def apply_quantization(model: nn.Module, method: str) -> None:
    """Gives every quantizable projection and experts layer of `model` its `method`; they
    quantize their weights when the model is prepacked."""
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.linear import Linear

    linear, experts = {"int8": (Int8LinearMethod(), Int8MoEMethod())}[method]
    for module in model.modules():
        if isinstance(module, Linear) and module.quantizable:
            module.quant_method = linear
        elif isinstance(module, FusedMoE):
            module.quant_method = experts

