"""Mixture-of-experts families: Mixtral, Qwen2-MoE and Qwen3-MoE.

Their decoder is Llama's (Qwen2-MoE with q/k/v biases, Qwen3-MoE with norms on each
head) with the MLP replaced, in the sparse layers, by a router and experts: each token
goes through `num_experts_per_tok` of the experts, weighted by the router's softmax
(renormalised over the chosen ones where the family says so), computed as grouped
products over all experts at once by `engine.layers.fused_moe.FusedMoE`. Qwen2-MoE adds a
shared expert that every token takes, scaled by a sigmoid gate.

Checkpoints store each expert's projections apart (`experts.3.w1`, or `gate_proj`); they
load stacked, one tensor per layer for the gate/up products and one for the down products,
each tensor-parallel rank holding its slice of every expert's intermediate features.
"""

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.distributed.communicator import TensorParallelGroup
from engine.layers.fused_moe import FusedMoE, select_experts
from engine.layers.linear import Linear, ShardSlice, StoredTensor
from engine.models.llama import LlamaForCausalLM, LlamaMLP, check_shape


# A multiple of the widest vectorised loop step (2 x 16 floats on AVX-512): see `_shared_gate`.
_GATE_LANES = 64
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<leaf>\w+)\.weight$")
# An expert's checkpoint tensor -> (stacked parameter, shard of its rows: gate 0, up 1; None for down).
_EXPERT_LEAVES = {
    "w1": ("w13", 0), "gate_proj": ("w13", 0),
    "w3": ("w13", 1), "up_proj": ("w13", 1),
    "w2": ("w2", None), "down_proj": ("w2", None),
}


def num_experts_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def is_sparse_layer(config: PretrainedConfig, index: int) -> bool:
    """Whether layer `index` has experts (Qwen's `mlp_only_layers` and `decoder_sparse_step`
    keep some dense)."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    return index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0


class SparseMoeBlock(nn.Module):
    """The router, the experts and (Qwen2-MoE) the gated shared expert of one layer.
    `round_weights`: the routing weights are rounded to the model's dtype before they
    scale the experts' outputs (Qwen), rather than kept in float32 (Mixtral)."""

    def __init__(self, config: PretrainedConfig, group: TensorParallelGroup, renormalize: bool,
                 shared_expert: bool, round_weights: bool) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = renormalize
        self.round_weights = round_weights
        size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.gate = Linear(config.hidden_size, num_experts_of(config), bias=False)
        self.gate.quantizable = False  # routing is a choice: it keeps the model's dtype (as in vLLM)
        self.experts = FusedMoE(num_experts_of(config), config.hidden_size, size, group)
        self.shared_expert = None
        if shared_expert:
            self.shared_expert = LlamaMLP(config, group, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
            self.shared_expert_gate.quantizable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = select_experts(logits, self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(logits.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + self._shared_gate(x) * self.shared_expert(x)
        return out

    def _shared_gate(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(shared_expert_gate(x)) [T, 1]. PyTorch's CPU sigmoid computes the last
        T % 32 values of a tensor with its scalar code, which rounds differently from the
        vectorised one, so a token's gate would depend on how many tokens share the step:
        each value is widened to a row of _GATE_LANES, all of which take the vector code."""
        return torch.sigmoid(self.shared_expert_gate(x).expand(-1, _GATE_LANES).contiguous())[:, :1]


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder with `SparseMoeBlock`s as the MLPs of its sparse layers."""

    shared_expert = False
    round_routing_weights = True

    @classmethod
    def renormalize(cls, config: PretrainedConfig) -> bool:
        """Whether the chosen experts' weights are renormalised to sum to one."""
        return bool(getattr(config, "norm_topk_prob", False))

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, index: int, group: TensorParallelGroup) -> nn.Module:
        if is_sparse_layer(config, index):
            return SparseMoeBlock(config, group, cls.renormalize(config), cls.shared_expert, cls.round_routing_weights)
        return LlamaMLP(config, group)

    def num_checkpoint_tensors(self, param_name: str) -> int:
        module = self.get_submodule(param_name.rpartition(".")[0])
        if isinstance(module, FusedMoE):
            return module.num_experts * (2 if param_name.endswith("w13") else 1)
        return super().num_checkpoint_tensors(param_name)

    def load_tensor(self, name: str, tensor: StoredTensor, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        match = _EXPERT.match(name)
        if match is None or match["leaf"] not in _EXPERT_LEAVES:
            return super().load_tensor(name, tensor, params)
        stacked, shard = _EXPERT_LEAVES[match["leaf"]]
        target = f"{match['block']}.experts.{stacked}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        param, expert = params[target], int(match["expert"])
        if expert >= param.shape[0]:
            raise ValueError(f"checkpoint tensor {name!r} names expert {expert}; config.json says "
                             f"{param.shape[0]} experts")
        group = self.get_submodule(target.rpartition(".")[0]).group
        if shard is None:  # down: [hidden, intermediate], this rank's columns
            full = param.shape[2] * group.size
            piece, dest, key = ShardSlice.even(1, full, group.rank, group.size), param.data[expert], expert
            check_shape(name, tensor, [param.shape[1], full])
        else:  # gate or up: [intermediate, hidden], this rank's rows
            rows = param.shape[1] // 2
            piece = ShardSlice.even(0, rows * group.size, group.rank, group.size)
            dest, key = param.data[expert].narrow(0, shard * rows, rows), 2 * expert + shard
            check_shape(name, tensor, [rows * group.size, param.shape[2]])
        dest.copy_(tensor.read(piece))
        return target, key

    def lora_targets(self) -> dict:
        """Attention projections (and dense layers' MLPs): experts, routers and shared
        experts take no adapter (see `engine.lora.adapter`)."""
        return {path: target for path, target in super().lora_targets().items() if ".mlp." not in path
                or not isinstance(self.get_submodule(path.split(".mlp.")[0] + ".mlp"), SparseMoeBlock)}


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: every layer sparse, top-2 of 8 experts renormalised (a softmax over the
    chosen experts' router logits)."""

    round_routing_weights = False

    @classmethod
    def renormalize(cls, config: PretrainedConfig) -> bool:
        return True

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, StoredTensor]]
    ) -> Iterator[tuple[str, StoredTensor]]:
        """Mixtral's `block_sparse_moe` is the layer's `mlp` here."""
        for name, tensor in weights:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE): q/k/v biases, a gated shared expert beside the routed ones."""

    shared_expert = True

    @classmethod
    def has_qkv_bias(cls, config: PretrainedConfig) -> bool:
        return True


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: RMSNorm on each head's queries and keys, no shared expert."""

    qk_norm = True
