"""A Llama-style model's decoder layers in one compiled call on a CPU (`cpu_decoder.cpp`), where
every layer is one the call computes with the same kernels in the same order (the same bits).

Why: on a CPU the interpreter's work between the kernels adds to every step, and it is slow
there, each product evicting the code and data the Python after it needs. On a Zen 3 a 32-row
decode step of the embedded model spent 10-15 of its ~150 ms between the kernels
(`benchmarks/RESULTS.md`, twelfth session of issue 66); on a CPU whose products are several times
faster (AMX) that share grows by as much.

`decoder_stack` is set as `LlamaModel.fused` by `engine.model_loader.kernel_routing`. It builds
a plan on its first call, and again whenever the KV cache is allocated anew or a projection's
weights change form (prepacked, quantized, an adapter attached); it returns None, and the model
runs its layers itself, where some layer is not one the compiled stack computes: a decoder
layer, attention or MLP of another class, per-head query/key norms, a rotation without tables
(M-RoPE), adapters, a quantization other than int8, a projection summed over tensor-parallel
ranks, or an attention backend other than the CPU's; and while any of the layers' modules has
a forward hook (calibration records the projections' inputs so), or PyTorch has a global one.
"""

import logging
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from engine.attention.backends.cpu_attn import CpuAttentionBackend
from engine.attention.layer import AttentionMetadata
from engine.kernels import cpu_build
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MIN_ROWS, Linear, RowParallelLinear
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from engine.quantization.int8 import Int8LinearMethod, kernel_weight, quantized_without_adapter

logger = logging.getLogger(__name__)


@dataclass
class DecoderPlan:
    """A model's compiled stack (None: its layers run themselves, for `reason`) and what it was
    built from: the first layer's cache and projection, whose identity changes when the cache is
    allocated anew or a projection's weights change form."""

    stack: object | None
    witness: tuple
    reason: str = ""
    layers: int = 0
    hooks: tuple[dict, ...] = ()  # every forward hook table the layers would run, PyTorch's global ones too
    # A step breakdown's seconds [3] float64 (products, attention, norms), added to by every call.
    seconds: ClassVar[torch.Tensor | None] = None

    def current(self, model: LlamaModel) -> bool:
        """Whether `model`'s cache and first projection are still those the plan was built from."""
        witness = _witness(model)
        return len(witness) == len(self.witness) and all(a is b for a, b in zip(witness, self.witness))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None) -> torch.Tensor:
        rows = meta.backend_data
        return self.stack.forward(hidden, positions, meta.slot_mapping, rows.block_tables, rows.row_seq,
                                  rows.row_keys, meta.block_size, kept_rows, self.seconds)


_plans: "weakref.WeakKeyDictionary[LlamaModel, DecoderPlan]" = weakref.WeakKeyDictionary()


def decoder_stack(model: LlamaModel, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  kept_rows: torch.Tensor | None) -> torch.Tensor | None:
    """`model`'s final hidden states of `hidden` (its embeddings), every layer and the final norm
    in one compiled call, as `LlamaModel.forward` computes them; None where the call cannot."""
    plan = _plans.get(model)
    if plan is None or not plan.current(model):
        plan = _plans[model] = _build(model)
    if plan.stack is None or positions.dim() != 1 or any(plan.hooks):
        return None
    return plan.forward(hidden, positions, meta, kept_rows)


def _witness(model: LlamaModel) -> tuple:
    first = model.layers[0].self_attn if len(model.layers) else None
    if not isinstance(first, LlamaAttention):
        return ()
    qkv = first.qkv_proj
    return (first.attn.k_cache, qkv.quant_method, qkv.packed_weight, qkv.__dict__.get("qweight"), qkv.lora)


def _build(model: LlamaModel) -> DecoderPlan:
    witness = _witness(model)
    reason = _unfit(model)
    if reason:
        logger.debug("decoder layers run one by one: %s", reason)
        return DecoderPlan(None, witness, reason)
    stack = cpu_build.load().DecoderStack(model.norm.weight, model.norm.eps)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        cos, sin = attn.rotary[0].tables
        caches = attn.attn
        stack.add_layer(
            input_norm=layer.input_layernorm.weight, input_eps=layer.input_layernorm.eps,
            post_norm=layer.post_attention_layernorm.weight, post_eps=layer.post_attention_layernorm.eps,
            qkv=_parts(attn.qkv_proj), o=_parts(attn.o_proj), gate_up=_parts(mlp.gate_up_proj),
            down=_parts(mlp.down_proj), min_rows=MIN_ROWS, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            cos=cos, sin=sin, sinks=_or_empty(caches.sinks), scale=caches.scale, softcap=caches.logit_softcap or 0.0,
            sliding_window=caches.sliding_window or 0, chunk_size=caches.attention_chunk_size or 0,
            gelu=mlp.activation == "gelu_tanh", k_cache=caches.k_cache, v_cache=caches.v_cache,
            k_scale=caches.k_scale, v_scale=caches.v_scale)
    modules = [m for part in (model.layers, model.norm) for m in part.modules()]
    hooks = (*(table for m in modules for table in (m._forward_pre_hooks, m._forward_hooks)),
             nn.modules.module._global_forward_pre_hooks, nn.modules.module._global_forward_hooks)
    return DecoderPlan(stack, witness, layers=len(model.layers), hooks=hooks)


def _or_empty(tensor: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0) if tensor is None else tensor.detach()


def _parts(layer: Linear) -> list[torch.Tensor | None]:
    """A projection as the compiled stack takes it: [packed, bias], or int8's seven parts."""
    if isinstance(layer.quant_method, Int8LinearMethod):
        return kernel_weight(layer)
    return [layer.packed_weight, layer.bias]


def _unfit(model: LlamaModel) -> str:
    """Why the compiled stack cannot compute `model`'s layers ("" where it can)."""
    if cpu_build.load() is None:
        return "the CPU kernels are not built"
    if not model.layers:
        return "no layers"
    for index, layer in enumerate(model.layers):
        reason = _unfit_layer(layer)
        if reason:
            return f"layer {index}: {reason}"
    return _unfit_norm(model.norm)


def _unfit_layer(layer: nn.Module) -> str:
    if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention:
        return f"{type(layer).__name__} is not a plain Llama decoder layer"
    if type(layer.mlp) is not LlamaMLP or layer.mlp.kernel is None:
        return f"{type(layer.mlp).__name__} is not a gated MLP on the CPU kernels"
    attn = layer.self_attn
    if attn.qk_norm:
        return "per-head query and key norms"
    if getattr(attn.rotary[0], "tables", None) is None:
        return "a rotation without tables"
    if not isinstance(attn.attn.backend, CpuAttentionBackend) or attn.attn.values_in_keys:
        return "not the CPU attention backend"
    projections = [attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    kinds = {_kind(p) for p in projections}
    if len(kinds) != 1 or None in kinds:
        return "projections neither all prepacked for oneDNN nor all int8, or with adapters"
    if any(isinstance(p, RowParallelLinear) and p.group.size > 1 for p in projections):
        return "projections summed over tensor-parallel ranks"
    return _unfit_norm(layer.input_layernorm) or _unfit_norm(layer.post_attention_layernorm)


def _kind(layer: Linear) -> str | None:
    """"onednn" or "int8" where the compiled stack multiplies by `layer` as it does, else None."""
    if layer.quant_method is None and layer.lora is None:
        return "onednn" if layer.packed_weight is not None else None
    return "int8" if quantized_without_adapter(layer) else None


def _unfit_norm(norm: nn.Module) -> str:
    if not isinstance(norm, RMSNorm) or type(norm).forward is not RMSNorm.forward or norm.kernel is None:
        return f"{type(norm).__name__} is not an RMSNorm on the CPU kernels"
    return ""
