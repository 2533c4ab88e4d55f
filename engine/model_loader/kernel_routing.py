"""Routes a built model's element-wise layers through fused kernels instead of PyTorch's
operators, chosen once by the model loader for the whole model: the RMSNorms (with their
residual add), rotary embeddings and gated MLP activations, through Triton on a GPU
(`route_through_triton`, which also routes the experts of `FusedMoE`) or through the
compiled C++ kernels on a CPU where they build (`route_through_cpu_kernels`, where an MLP
whose projections are int8 runs whole in one call, and a Llama-style model's layers too). Attention and a CPU's experts pick their
compiled kernels themselves (`engine.attention.selector`, `FusedMoE`)."""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from engine.kernels import cpu_build
from engine.layers.fused_moe import FusedMoE
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaMLP, LlamaModel
from engine.quantization.int8 import Int8LinearMethod


@dataclass(frozen=True)
class LayerKernels:
    """The kernels one device's layers run through; None leaves a layer as it is."""

    rms_norm: Callable
    rotary: Callable
    act_and_mul: Callable
    fused_moe: Callable | None = None
    int8_gated_mlp: Callable | None = None
    decoder_stack: Callable | None = None


def route_kernels(model: nn.Module, kernels: LayerKernels) -> None:
    """Sets each RMSNorm's, rotary embedding's, MLP's and (with `fused_moe`) FusedMoE's kernel,
    and (with `decoder_stack`) each Llama-style stack's fused call; before the model is prepacked
    (`FusedMoE.prepack` then keeps the 3-D weights Triton reads)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = kernels.rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.kernel = kernels.rotary
        elif isinstance(module, LlamaMLP):
            module.kernel = kernels.act_and_mul
            if kernels.int8_gated_mlp is not None and isinstance(module.gate_up_proj.quant_method, Int8LinearMethod):
                module.fused = kernels.int8_gated_mlp
        elif isinstance(module, FusedMoE) and kernels.fused_moe is not None:
            module.kernel = kernels.fused_moe
        elif isinstance(module, LlamaModel) and kernels.decoder_stack is not None:
            module.fused = kernels.decoder_stack


def route_through_triton(model: nn.Module) -> None:
    """Routes the model's element-wise layers and experts through `engine.kernels.triton`."""
    from engine.kernels.triton.activation import act_and_mul
    from engine.kernels.triton.fused_moe import fused_moe
    from engine.kernels.triton.rms_norm import rms_norm
    from engine.kernels.triton.rotary import rotary

    route_kernels(model, LayerKernels(rms_norm, rotary, act_and_mul, fused_moe=fused_moe))


def route_through_cpu_kernels(model: nn.Module) -> None:
    """Routes the model's element-wise layers through the compiled CPU kernels, an MLP whose
    projections are int8 whole through `int8_gated_mlp`, and a Llama-style stack of layers whole
    through `decoder_stack` where it fits; a no-op where they cannot be built."""
    if cpu_build.load() is None:
        return
    from engine.kernels.cpu_activation import act_and_mul
    from engine.kernels.cpu_rms_norm import rms_norm
    from engine.kernels.cpu_rotary import rotary
    from engine.model_loader.cpu_decoder_stack import decoder_stack
    from engine.quantization.int8 import int8_gated_mlp

    route_kernels(model, LayerKernels(rms_norm, rotary, act_and_mul, int8_gated_mlp=int8_gated_mlp,
                                      decoder_stack=decoder_stack))
