"""Routes the model's element-wise layers and its mixture-of-experts layers through fused
Triton kernels instead of PyTorch's operators (their default), chosen once by the model
runner for the whole model."""

from torch import nn

from engine.layers.fused_moe import FusedMoE
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def route_through_triton(model: nn.Module) -> None:
    """Routes RMSNorm (with its residual add), the rotary embedding, the gated activations and
    the experts of FusedMoE through the Triton kernels of `engine.kernels.triton`; before the
    model is prepacked (`FusedMoE.prepack` then keeps the 3-D weights the kernel reads)."""
    from engine.kernels.triton.activation import act_and_mul
    from engine.kernels.triton.fused_moe import fused_moe
    from engine.kernels.triton.rms_norm import rms_norm
    from engine.kernels.triton.rotary import rotary
    from engine.models.llama import LlamaMLP

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.kernel = rotary
        elif isinstance(module, LlamaMLP):
            module.kernel = act_and_mul
        elif isinstance(module, FusedMoE):
            module.kernel = fused_moe
