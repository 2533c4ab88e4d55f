"""Quantized weights: which method a model runs with (`resolve_quantization`), and handing
each projection its method (`apply_quantization`).

As in vLLM, `LLM(quantization=...)` names the method, or None takes the checkpoint's own
(`quantization_config` in config.json), and a method the checkpoint contradicts or the
device cannot run is refused before any weight is read. A layer's method quantizes its
weights once they are loaded (`process_weights`) and computes its products (`apply`);
projections that must stay exact for the output's sake (the language-model head, the
experts' routers) keep the model's dtype.
"""

import logging
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.config import AT_LOAD, CHECKPOINT_METHODS
from engine.hardware import CpuInfo, amx_products, detect_cpu
from engine.kernels import cpu_build
from engine.quantization.checkpoint import CheckpointFormat
from engine.quantization.fp8 import Fp8LinearMethod, fp8_products_available
from engine.quantization.int4 import Int4LinearMethod
from engine.quantization.int8 import Int8LinearMethod, Int8MoEMethod
from engine.quantization.mxfp4 import MXFP4_DEQUANTIZED_WARNING, Mxfp4MoEMethod

logger = logging.getLogger(__name__)

def _settings(hf_config: PretrainedConfig) -> dict[str, Any] | None:
    settings = getattr(hf_config, "quantization_config", None)
    if settings is None or isinstance(settings, dict):
        return settings
    return settings.to_dict()


def checkpoint_quantization(hf_config: PretrainedConfig) -> str | None:
    """The method config.json's `quantization_config` names, if any."""
    settings = _settings(hf_config)
    if settings is None:
        return None
    method = settings.get("quant_method")
    return str(getattr(method, "value", method)).lower() if method is not None else "unknown"


def checkpoint_format(hf_config: PretrainedConfig) -> CheckpointFormat | None:
    """How the checkpoint stores its quantized projections; None when it is unquantized.

    Raises:
        ValueError: a method or a variant of one this engine cannot load, naming it.
    """
    method = checkpoint_quantization(hf_config)
    if method is None:
        return None
    settings = _settings(hf_config) or {}
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"the checkpoint's weights are quantized with {method!r} (config.json quantization_config), "
                         f"which this engine cannot load; it loads {', '.join(CHECKPOINT_METHODS)} checkpoints and "
                         f"16- and 32-bit ones, which quantization={sorted(AT_LOAD)} quantizes at load")
    problem = _unsupported_variant(method, settings)
    if problem:
        raise ValueError(f"the checkpoint's {method} quantization_config {problem}, which this engine cannot load")
    return CheckpointFormat.of("fp8" if method == "compressed-tensors" else method, settings)


def _unsupported_variant(method: str, settings: dict[str, Any]) -> str | None:
    """What in a checkpoint's settings this engine does not load, if anything."""
    if method in ("awq", "gptq") and settings.get("bits", 4) != 4:
        return f"has bits={settings['bits']} (only 4-bit weights load)"
    if method == "awq" and (settings.get("version", "gemm").lower() != "gemm" or not settings.get("zero_point", True)):
        return "is not AWQ's GEMM format with zero points"
    if method == "compressed-tensors":
        if settings.get("format") not in ("float-quantized", "naive-quantized"):
            return f"has format={settings.get('format')!r} (only 'float-quantized' FP8 loads)"
        for group in (settings.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                return "quantizes weights other than to 8-bit floats"
            if weights.get("strategy") not in ("tensor", "channel"):
                return f"has the weight strategy {weights.get('strategy')!r} (tensor and channel load)"
    return None


def resolve_quantization(requested: str | None, hf_config: PretrainedConfig, device: torch.device,
                         auto_dtype: torch.dtype | None = None, batch_invariant: bool = False,
                         pooling: bool = False) -> str | None:
    """The method the model runs with: the checkpoint's own, else `requested`; None for the
    model's own dtype. "auto" (the default) adds int8 where it is the faster default
    (`int8_by_default`): `auto_dtype` is the compute dtype when the dtype was left "auto",
    `batch_invariant` the engine's mode (which keeps oneDNN off AMX), `pooling` whether the
    model embeds or classifies. An MXFP4 checkpoint (gpt-oss) on a CPU, whose experts are
    dequantized as they load, takes int8 as an unquantized one does ("int8", or "auto" where
    int8 is the default), else "mxfp4".

    Raises:
        ValueError: a method this engine does not run, one the checkpoint contradicts, or
            one the device cannot run, naming the fix.
    """
    stored = checkpoint_quantization(hf_config)
    if stored == "mxfp4" and device.type == "cpu" and requested in ("auto", "int8"):
        # gpt-oss's MXFP4 experts are dequantized as they load: on a CPU the dtype's rules follow.
        checkpoint_format(hf_config)
        return _at_load(requested, device, auto_dtype, batch_invariant, pooling) or stored
    if stored is not None:
        checkpoint_format(hf_config)
        if requested not in (None, "auto") and requested != stored:
            raise ValueError(f"quantization={requested!r} contradicts the checkpoint's {stored!r} (config.json "
                             f"quantization_config); leave quantization unset to use the checkpoint's")
        return stored
    return _at_load(requested, device, auto_dtype, batch_invariant, pooling)


def _at_load(requested: str | None, device: torch.device, auto_dtype: torch.dtype | None,
             batch_invariant: bool, pooling: bool) -> str | None:
    """`resolve_quantization` for an unquantized checkpoint: the method that quantizes it at
    load, or None."""
    if requested == "auto":
        return "int8" if int8_by_default(device, auto_dtype, batch_invariant, pooling) else None
    if requested is None:
        return None
    if requested not in AT_LOAD:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with it (config.json "
                         f"quantization_config); a 16- or 32-bit one is quantized at load by {sorted(AT_LOAD)}")
    if not _runs_at_load(requested, device):
        raise ValueError(f"quantization={requested!r} needs {AT_LOAD[requested]}; this is {_describe(device)}. "
                         f"Leave quantization unset there")
    return requested


def int8_by_default(device: torch.device, auto_dtype: torch.dtype | None, batch_invariant: bool = False,
                    pooling: bool = False) -> bool:
    """Whether an unquantized checkpoint runs int8 unless told otherwise, on a CPU where the
    dtype was left to the engine:

    - with VNNI where that dtype is bfloat16 and oneDNN's products do not run on AMX tiles.
      On AVX-512 (a Zen 4) int8's products run at twice bfloat16's rate and its greedy
      output stays as close to bfloat16 as OpenVINO GenAI's int8 stays to its fp16
      (benchmarks/RESULTS.md). With AMX (a Sapphire Rapids) bfloat16 was the faster:
      1,300 against 978 output tok/s on 128 chat prompts, 501 against 396 on shared
      prefixes, 234 against 237 on long prompts; batch-invariant mode keeps oneDNN off AMX,
      where int8 is the faster again.
    - for a pooling model (embeddings, classes) with AVX2 and no VNNI (a Zen 3), where that
      dtype is float32 and the compiled kernels are built: embeddings ran 1.44x float32's
      (the int8 layer alone 1.6-1.7x) and kept a cosine of 0.997 or more with float32's
      (benchmarks/RESULTS.md). Generation stays float32 there: its greedy text is float32's.

    An explicit dtype keeps the dtype's products."""
    if device.type != "cpu" or auto_dtype is None:
        return False
    cpu = detect_cpu()
    if auto_dtype == torch.bfloat16:
        return cpu.int8_vnni and not amx_products(cpu, batch_invariant)
    return pooling and auto_dtype == torch.float32 and cpu.int16_pair_products and _int8_products_run(cpu)


def _int8_products_run(cpu: CpuInfo) -> bool:
    """Whether this CPU takes int8 products: oneDNN's with VNNI or AMX, or the compiled
    kernels' int16 pairs on AVX2, which need the kernels built."""
    return cpu.int8_vnni or cpu.int16_pair_products and cpu_build.load() is not None


def _runs_at_load(method: str, device: torch.device) -> bool:
    if method == "int8":
        return device.type == "cpu" and _int8_products_run(detect_cpu())
    return fp8_products_available(device)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (compute capability {torch.cuda.get_device_capability(device)})"
    return f"a CPU ({detect_cpu().describe()})"


def apply_quantization(model: nn.Module, method: str, hf_config: PretrainedConfig, device: torch.device,
                       triton_kernels: bool = False) -> None:
    """Gives every quantizable projection and experts layer of `model` its `method`'s
    product for this device, before the weights are loaded (of a quantized checkpoint, the
    projections it stores quantized); `triton_kernels`: the model's layers run through
    the Triton kernels. Where the device has no product for a checkpoint's format the
    weights are dequantized to the model's dtype as they load, and a warning says why."""
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.linear import Linear

    if method == "mxfp4":  # only experts are MXFP4 (`engine.models.gpt_oss`)
        if triton_kernels:
            for module in model.modules():
                if isinstance(module, FusedMoE):
                    module.quant_method = Mxfp4MoEMethod()
                    module.quant_method.create_weights(module)
        elif device.type == "cuda":
            logger.warning(MXFP4_DEQUANTIZED_WARNING)
        return
    stored = checkpoint_format(hf_config)
    linear, experts, reason = _methods(method, stored, device)
    if reason:
        logger.warning("%s weights are dequantized to the model's dtype as they load: %s", method, reason)
    for module in model.modules():
        if (isinstance(module, Linear) and module.quantizable and linear is not None
                and (module.stored_quantized or stored is None)):
            module.quant_method = linear
            linear.create_weights(module)
        elif isinstance(module, FusedMoE) and experts is not None:
            module.quant_method = experts


def _methods(method: str, stored: CheckpointFormat | None, device: torch.device) -> tuple[Any, Any, str | None]:
    """(projections' method, experts' method, why the weights are dequantized instead)."""
    if method == "int8":
        return Int8LinearMethod(), Int8MoEMethod(), None
    if method in ("awq", "gptq"):
        if device.type != "cuda":
            return None, None, "4-bit products run on a GPU (a Triton kernel); on a CPU they are the dtype's"
        return Int4LinearMethod(device), None, None
    if stored is not None and stored.block is not None:
        return None, None, "block-wise FP8 products are not built yet; the dtype's run instead"
    if not fp8_products_available(device):
        return None, None, f"FP8 products need {AT_LOAD['fp8']}, and this is {_describe(device)}"
    return Fp8LinearMethod(device), None, None
