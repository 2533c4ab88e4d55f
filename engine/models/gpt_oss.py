"""gpt-oss (OpenAI's open-weight mixture of experts): the Llama decoder with gpt-oss's
differences.

Attention has biases on q/k/v/o and a learned sink per head (a logit that joins every
softmax's denominator without a value, `Attention(sinks=True)`); layers alternate between a
sliding window (128 keys in the released models) and the whole context (`layer_types`);
rotary positions are YaRN-scaled. Every layer's MLP is a router with a bias whose top k
logits are softmaxed (`Routing.gpt_oss`), and experts with biases and a clamped SwiGLU
(`ClampedSwiGLU`).

Checkpoints store each layer's experts stacked and their gate/up products fused with the
gate and up features alternating: transformers' layout (`gate_up_proj` [E, H, 2I],
`down_proj` [E, I, H], as `x @ W`) or the released MXFP4 one (`gate_up_proj_blocks`
[E, 2I, H / 32, 16] and `_scales`, `down_proj_blocks` [E, H, I / 32, 16] and `_scales`,
rows as a `Linear`'s), with the biases unquantized. Both load one expert at a time into
`FusedMoE`'s layout (gate rows, then up rows): MXFP4 kept as stored where the Triton
kernels run the experts, else dequantized to the model's dtype (`engine.quantization.mxfp4`);
the rest of an MXFP4 checkpoint is unquantized.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.distributed.communicator import TensorParallelGroup
from engine.layers.fused_moe import ClampedSwiGLU, FusedMoE, Routing, deinterleave_gate_up
from engine.layers.linear import Linear, ShardSlice, StoredTensor
from engine.lora.slots import LoRATarget
from engine.models.llama import (
    FULL_ATTENTION, SLIDING_ATTENTION, AttentionOptions, LlamaForCausalLM, check_shape,
)
from engine.quantization.mxfp4 import BLOCK_SIZE, Mxfp4MoEMethod, dequantize_mxfp4

_LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)
# The MXFP4 parts of a quantized expert tensor, by checkpoint suffix.
_MXFP4_PARTS = ("_blocks", "_scales")
_EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def check_gpt_oss_config(config: PretrainedConfig) -> None:
    """Raises ValueError naming a config.json option this engine does not implement (or
    lacks a value for): `layer_types` other than sliding and full attention, a sliding layer
    without `sliding_window`, no `swiglu_limit` (a missing `swiglu_alpha` is the released
    1.702). An unknown `rope_type` fails as the rotary table is built (`engine.layers.rotary`)."""
    types = getattr(config, "layer_types", None) or []
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.json's layer_types has {len(types)} entries for num_hidden_layers="
                         f"{config.num_hidden_layers}: give one of {list(_LAYER_TYPES)} per layer")
    for index, kind in enumerate(types):
        if kind not in _LAYER_TYPES:
            raise ValueError(f"config.json's layer_types[{index}] is {kind!r}, which gpt-oss does not run here "
                             f"(supported: {', '.join(_LAYER_TYPES)})")
    if SLIDING_ATTENTION in types and not getattr(config, "sliding_window", None):
        raise ValueError("config.json's layer_types has sliding_attention layers but sliding_window is not set: "
                         "set it (128 in the released gpt-oss models)")
    if getattr(config, "swiglu_limit", None) is None:
        raise ValueError("config.json lacks swiglu_limit, which gpt-oss's experts need (the released models: 7.0): "
                         "set it")


class GptOssMoE(nn.Module):
    """One layer's router (with a bias; it keeps the model's dtype) and experts."""

    def __init__(self, config: PretrainedConfig, group: TensorParallelGroup) -> None:
        super().__init__()
        self.routing = Routing.gpt_oss(config)
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.router.quantizable = False  # routing is a choice: it keeps the model's dtype (as in vLLM)
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size, config.intermediate_size, group,
                                bias=True, activation=ClampedSwiGLU.of(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        weights, ids = self.routing.select(logits)
        return self.experts(x, weights.to(logits.dtype), ids)  # transformers' softmax is in the logits' dtype


@dataclass(frozen=True)
class DenseExperts:
    """A stacked expert tensor in transformers' layout, [E, in, out] (`x @ W`)."""

    tensor: StoredTensor

    def check(self, name: str, experts: int, rows: int, columns: int) -> None:
        """Raises ValueError unless it holds `experts` matrices of [rows, columns] (out, in)."""
        check_shape(name, self.tensor, [experts, columns, rows])

    def expert(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `index`'s matrix [out, in] (read alone), in `dtype`."""
        whole = self.tensor.shape[0]
        return self.tensor.read(ShardSlice(0, index, 1, whole))[0].t().to(dtype)


@dataclass(frozen=True)
class Mxfp4Experts:
    """A stacked expert tensor in the MXFP4 layout: blocks [E, out, in / 32, 16] and
    scales [E, out, in / 32] (named `<name>_blocks` and `<name>_scales`)."""

    blocks: StoredTensor
    scales: StoredTensor

    def check(self, name: str, experts: int, rows: int, columns: int) -> None:
        """Raises ValueError unless it holds `experts` matrices of [rows, columns] (out, in)."""
        if columns % BLOCK_SIZE:
            raise ValueError(f"checkpoint tensor {name + '_blocks'!r} is MXFP4, whose blocks of {BLOCK_SIZE} need "
                             f"input features in multiples of {BLOCK_SIZE}; config.json gives {columns}")
        check_shape(name + "_blocks", self.blocks, [experts, rows, columns // BLOCK_SIZE, BLOCK_SIZE // 2])
        check_shape(name + "_scales", self.scales, [experts, rows, columns // BLOCK_SIZE])

    def expert(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `index`'s matrix [out, in] (read alone), dequantized to `dtype`."""
        piece = ShardSlice(0, index, 1, self.blocks.shape[0])
        return dequantize_mxfp4(self.blocks.read(piece)[0], self.scales.read(piece)[0], dtype)


ExpertTensor = DenseExperts | Mxfp4Experts


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: attention with biases and sinks over alternating sliding and full layers,
    YaRN rotary positions, and a mixture of experts with biases and a clamped SwiGLU in
    every layer."""

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None):
        check_gpt_oss_config(config)
        group = group or TensorParallelGroup()
        super().__init__(config, max_position, group)
        self.group = group

    @classmethod
    def attention_options(cls, config: PretrainedConfig, index: int) -> AttentionOptions:
        """Llama's, with a sink per query head (this rank's heads; loaded from the
        checkpoint's `self_attn.sinks`)."""
        return replace(super().attention_options(config, index), sinks=True)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, index: int, group: TensorParallelGroup) -> nn.Module:
        return GptOssMoE(config, group)

    def lora_targets(self) -> dict[str, LoRATarget]:
        """The attention projections: experts and routers take no adapter (see `engine.lora.adapter`)."""
        return {path: target for path, target in super().lora_targets().items() if ".mlp." not in path}

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, StoredTensor]]
    ) -> Iterator[tuple[str, StoredTensor | ExpertTensor]]:
        """The checkpoint's tensors with each stacked expert tensor as a `DenseExperts` or
        (its blocks and scales joined) an `Mxfp4Experts` under the unquantized name, and the
        sinks under the attention layer's name.

        Raises:
            ValueError: MXFP4 blocks without their scales, or scales without their blocks.
        """
        halves: dict[str, dict[str, StoredTensor]] = {}
        for name, tensor in weights:
            stem, _, leaf = name.rpartition(".experts.")
            base = next((leaf.removesuffix(part) for part in _MXFP4_PARTS if leaf.endswith(part)), leaf)
            if stem and base in _EXPERT_TENSORS and base != leaf:
                parts = halves.setdefault(f"{stem}.experts.{base}", {})
                parts[leaf.removeprefix(base)] = tensor
                if len(parts) == len(_MXFP4_PARTS):
                    yield f"{stem}.experts.{base}", Mxfp4Experts(parts["_blocks"], parts["_scales"])
                    del halves[f"{stem}.experts.{base}"]
            elif stem and leaf in _EXPERT_TENSORS:
                yield name, DenseExperts(tensor)
            elif name.endswith(".self_attn.sinks"):
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
            else:
                yield name, tensor
        for name, parts in halves.items():
            (present,) = parts
            missing = next(part for part in _MXFP4_PARTS if part != present)
            raise ValueError(f"checkpoint tensor {name + present!r} has no {name + missing!r}: an MXFP4 expert "
                             "tensor needs both; the checkpoint is incomplete")

    def load_tensor(self, name: str, tensor: StoredTensor | ExpertTensor,
                    params: dict[str, nn.Parameter]) -> tuple[str, int]:
        module_path, _, leaf = name.rpartition(".")
        if module_path.endswith(".mlp.experts") and leaf in (*_EXPERT_TENSORS, "gate_up_proj_bias", "down_proj_bias"):
            experts = self.get_submodule(module_path)
            if leaf in _EXPERT_TENSORS:
                return self._load_experts(name, experts, tensor)
            return self._load_expert_bias(name, experts, tensor)
        if leaf == "sinks" and name in params:
            full = self.config.num_attention_heads
            check_shape(name, tensor, [full])
            params[name].data.copy_(tensor.read(ShardSlice.even(0, full, self.group.rank, self.group.size)))
            return name, 0
        return super().load_tensor(name, tensor, params)

    def _load_experts(self, name: str, experts: FusedMoE, stored: ExpertTensor) -> tuple[str, int]:
        """Every expert's fused gate/up (deinterleaved into gate rows then up rows) or down
        matrix, this rank's share of its intermediate features, one expert at a time."""
        if isinstance(experts.quant_method, Mxfp4MoEMethod):
            return self._load_mxfp4_experts(name, experts, stored)
        rank, ranks = self.group.rank, self.group.size
        gate_up = name.endswith("gate_up_proj")
        param = experts.w13 if gate_up else experts.w2
        local = param.shape[1] // 2 if gate_up else param.shape[2]
        hidden = param.shape[2] if gate_up else param.shape[1]
        if gate_up:
            stored.check(name, experts.num_experts, 2 * local * ranks, hidden)
        else:
            stored.check(name, experts.num_experts, hidden, local * ranks)
        for index in range(experts.num_experts):
            matrix = stored.expert(index, param.dtype)
            if gate_up:  # this rank's gate and up features alternate in 2 * local consecutive rows
                param.data[index].copy_(deinterleave_gate_up(matrix.narrow(0, 2 * rank * local, 2 * local)))
            else:
                param.data[index].copy_(matrix.narrow(1, rank * local, local))
        return f"{name.rpartition('.')[0]}.{'w13' if gate_up else 'w2'}", 0

    def _load_mxfp4_experts(self, name: str, experts: FusedMoE, stored: ExpertTensor) -> tuple[str, int]:
        """`_load_experts` for experts kept in MXFP4 (`Mxfp4MoEMethod`): the blocks and scales
        as stored, rows in the same order, this rank's share of whole 32-feature blocks."""
        if not isinstance(stored, Mxfp4Experts):
            raise ValueError(f"checkpoint tensor {name!r} is not MXFP4 although config.json's quantization_config "
                             "says mxfp4: give its *_blocks and *_scales, or drop the quantization_config")
        rank, ranks = self.group.rank, self.group.size
        gate_up = name.endswith("gate_up_proj")
        blocks, scales = (experts.w13_blocks, experts.w13_scales) if gate_up else (experts.w2_blocks,
                                                                                   experts.w2_scales)
        hidden = experts.w2_blocks.shape[1]
        local = experts.w13_blocks.shape[1] // 2
        stored.check(name, experts.num_experts, *((2 * local * ranks, hidden) if gate_up else (hidden, local * ranks)))
        for index in range(experts.num_experts):
            piece = ShardSlice(0, index, 1, stored.blocks.shape[0])
            for source, target in ((stored.blocks, blocks), (stored.scales, scales)):
                matrix = source.read(piece)[0]  # [rows, groups(, 16)]
                if gate_up:
                    matrix = deinterleave_gate_up(matrix.narrow(0, 2 * rank * local, 2 * local))
                else:
                    matrix = matrix.narrow(1, rank * local // BLOCK_SIZE, local // BLOCK_SIZE)
                target[index].copy_(matrix.flatten(1))
        return f"{name.rpartition('.')[0]}.{'w13' if gate_up else 'w2'}", 0

    def _load_expert_bias(self, name: str, experts: FusedMoE, tensor: StoredTensor) -> tuple[str, int]:
        """gate_up_proj_bias [E, 2I] (this rank's features, deinterleaved) or down_proj_bias
        [E, H] (whole on every rank; rank 0 alone adds it)."""
        if name.endswith("gate_up_proj_bias"):
            local = experts.w13_bias.shape[1] // 2
            check_shape(name, tensor, [experts.num_experts, 2 * local * self.group.size])
            piece = ShardSlice.even(1, 2 * local * self.group.size, self.group.rank, self.group.size)
            experts.w13_bias.data.copy_(deinterleave_gate_up(tensor.read(piece), dim=1))
            return f"{name.rpartition('.')[0]}.w13_bias", 0
        check_shape(name, tensor, list(experts.w2_bias.shape))
        experts.w2_bias.data.copy_(tensor.read())
        return f"{name.rpartition('.')[0]}.w2_bias", 0
