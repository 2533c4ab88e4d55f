"""Routes the model's RMSNorms (with their residual add), rotary embeddings and gated MLP
activations (the whole MLP where its projections are int8) through the compiled CPU kernels
instead of PyTorch's operators, where the CPU kernels can be built; chosen once by the model loader for a model on a CPU. (Attention and
the routed experts pick their compiled kernels themselves: `engine.layers.attention_selector`,
`FusedMoE`.)"""

from torch import nn

from engine.kernels import cpu_build
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def route_through_cpu_kernels(model: nn.Module) -> None:
    """Sets every RMSNorm's, rotary embedding's and MLP's kernel to the C++ one, and an MLP
    whose projections are int8 runs whole in one (`int8_gated_mlp`); a no-op where they
    cannot be built."""
    if cpu_build.load() is None:
        return
    from engine.kernels.cpu_activation import act_and_mul
    from engine.kernels.cpu_rms_norm import rms_norm
    from engine.kernels.cpu_rotary import rotary
    from engine.models.llama import LlamaMLP
    from engine.quantization.int8 import Int8LinearMethod, int8_gated_mlp

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.kernel = rotary
        elif isinstance(module, LlamaMLP):
            module.kernel = act_and_mul
            if isinstance(module.gate_up_proj.quant_method, Int8LinearMethod):
                module.fused = int8_gated_mlp
