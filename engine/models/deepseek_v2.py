"""DeepSeek-V2 and DeepSeek-V3 (and checkpoints of their architectures: Kimi-K2, the V2-Lite
sizes): multi-head latent attention and a mixture of experts with shared experts.

Attention (`DeepseekV2Attention`): queries from `q_proj`, or through the low-rank
`q_a_proj`, `q_a_layernorm`, `q_b_proj` where `q_lora_rank` is set; keys and values from
one compressed latent per token (`kv_a_proj_with_mqa`, `kv_a_layernorm`) and one rotary key
shared by the heads, expanded per head by `kv_b_proj` — the latent and the rotary key are all
the KV cache keeps (`engine.attention.mla`). Rotary positions turn the last
`qk_rope_head_dim` values of each query and the shared key, in interleaved pairs as the
checkpoints lay them out (V3's `rope_interleave`; always for V2): those rows of the
projections (and a LoRA adapter's B on them) are reordered at load into the halves the
engine's rotary kernels turn (`RotaryPairs`), which changes no score. The softmax scale is qk_head_dim**-0.5, times yarn_mscale(factor,
mscale_all_dim)**2 with YaRN rotary scaling, as transformers and vLLM compute it.

The first `first_k_dense_replace` layers have a dense MLP; the others a float32 router over
`n_routed_experts` experts (`Routing.deepseek_v2`: softmax scores, group-limited where
`topk_method` says so; `Routing.deepseek_v3`: sigmoid scores chosen with the router's
`e_score_correction_bias`, groups ranked by their two best), the chosen experts' weights
times `routed_scaling_factor`, plus `n_shared_experts` shared experts as one MLP every
token takes. Checkpoints store each expert apart (`experts.3.gate_proj`), as Mixtral-style
families do (`engine.models.moe`).

Tensor parallelism splits the query heads (and their rows of `q_b_proj`/`q_proj`,
`kv_b_proj`, columns of `o_proj`) and every expert's features over the ranks; the latent
projections are whole on each rank, and so is the latent cache, as in vLLM.
"""

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.attention.layer import AttentionMetadata
from engine.attention.mla import MLAAttention, MLADims
from engine.distributed.communicator import TensorParallelGroup
from engine.layers.fused_moe import FusedMoE, Routing
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, StoredTensor
from engine.layers.rotary import RotaryEmbedding, RotaryPairs, RotaryPairsToHalves, rope_parameters, yarn_mscale
from engine.lora.slots import LoRATarget
from engine.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP
from engine.models.moe import MoEForCausalLM

# The latent layers' norms: transformers builds them with its RMSNorm's default epsilon.
_LATENT_NORM_EPS = 1e-6
# Projections whose rows hold each head's rotary query (and the shared rotary key) in
# interleaved pairs, permuted at load.
_ROTARY_ROWS = ("q_proj", "q_b_proj", "kv_a_proj_with_mqa")


def mla_dims(config: PretrainedConfig) -> MLADims:
    return MLADims(latent=config.kv_lora_rank, rope=config.qk_rope_head_dim, nope=config.qk_nope_head_dim,
                   value=config.v_head_dim)


def softmax_scale(config: PretrainedConfig) -> float:
    """qk_head_dim**-0.5, times yarn_mscale(factor, mscale_all_dim)**2 under YaRN."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def check_deepseek_config(config: PretrainedConfig) -> None:
    """Raises ValueError naming a config.json option the engine does not implement: a
    routing method or scoring function other than the family's, experts on only some
    layers past the first dense ones (`moe_layer_freq`)."""
    v2 = config.model_type == "deepseek_v2"
    methods = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    method = getattr(config, "topk_method", None) or methods[0]
    if method not in methods:
        raise ValueError(f"config.json's topk_method is {method!r}, which {config.model_type} does not run here "
                         f"(supported: {', '.join(methods)})")
    scoring = getattr(config, "scoring_func", None) or ("softmax" if v2 else "sigmoid")
    if scoring != ("softmax" if v2 else "sigmoid"):
        raise ValueError(f"config.json's scoring_func is {scoring!r}, which {config.model_type} does not run here "
                         f"(supported: {'softmax' if v2 else 'sigmoid'})")
    if (getattr(config, "moe_layer_freq", None) or 1) != 1:
        raise ValueError(f"config.json's moe_layer_freq is {config.moe_layer_freq}: only 1 (experts in every layer "
                         "from first_k_dense_replace on) is supported")


class DeepseekV2Attention(nn.Module):
    """Latent attention's projections around an `MLAAttention` over this rank's heads."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, group: TensorParallelGroup) -> None:
        super().__init__()
        dims = self.dims = mla_dims(config)
        heads = config.num_attention_heads
        if heads % group.size:
            raise ValueError(f"{heads} attention heads do not split over tensor_parallel_size={group.size}")
        self.num_heads = heads // group.size
        self.qk_head_dim = dims.nope + dims.rope
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = Linear(config.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear.split(self.q_lora_rank, [heads * self.qk_head_dim], group, bias=False)
        else:
            self.q_proj = ColumnParallelLinear.split(config.hidden_size, [heads * self.qk_head_dim], group, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, dims.cache_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(dims.latent, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear.split(dims.latent, [heads * (dims.nope + dims.value)], group,
                                                    bias=False)
        self.kv_b_proj.quantizable = False  # absorbed into the queries and outputs (`MLAAttention.absorb`)
        self.o_proj = RowParallelLinear(heads * dims.value, config.hidden_size, group, bias=bias)
        self.rotary = [rotary]
        self.attn = MLAAttention(self.num_heads, dims, softmax_scale(config), self.kv_b_proj)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None = None) -> torch.Tensor:
        dims = self.dims
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_head_dim).split([dims.nope, dims.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([dims.latent, dims.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        rotated = self.rotary[0](positions, torch.cat((q_pe, k_pe.unsqueeze(1)), dim=1))
        q_pe, k_pe = rotated.split([self.num_heads, 1], dim=1)
        out = self.attn(q_nope, q_pe, latent, k_pe.squeeze(1), meta).reshape(-1, self.num_heads * dims.value)
        return self.o_proj(out if kept_rows is None else out[kept_rows])


class DeepseekRouter(nn.Module):
    """The float32 router of a DeepSeek MoE layer: logits [tokens, experts] = x @ weight.T in
    float32 (transformers keeps `gate.weight` in float32); with `correction_bias`, the
    float32 `e_score_correction_bias` [experts] that V3 adds to the scores to choose. Both
    stay float32 when the model is cast."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts), requires_grad=False)
                                        if correction_bias else None)

    def _apply(self, fn, recurse: bool = True) -> "DeepseekRouter":
        super()._apply(fn, recurse)
        for name, param in self.named_parameters(recurse=False):
            if param.dtype != torch.float32:
                setattr(self, name, nn.Parameter(param.detach().float(), requires_grad=False))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    """The router, the routed experts and the shared experts of one layer."""

    def __init__(self, config: PretrainedConfig, group: TensorParallelGroup, routing: Routing) -> None:
        super().__init__()
        self.routing = routing
        self.gate = DeepseekRouter(config.hidden_size, config.n_routed_experts, config.model_type != "deepseek_v2")
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, group)
        self.shared_experts = None
        if getattr(config, "n_shared_experts", None):
            self.shared_experts = LlamaMLP(config, group, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing.select(self.gate(x), self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """DeepSeek-V2 (and V2-Lite): the Llama decoder with latent attention and DeepSeek's
    experts (see the module docstring)."""

    routing = staticmethod(Routing.deepseek_v2)
    # q_proj is a projection of its own here: only the MLPs' gate and up are fused.
    fused_leaves = {leaf: place for leaf, place in LlamaForCausalLM.fused_leaves.items()
                    if place[0] == "gate_up_proj"}

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None):
        check_deepseek_config(config)
        super().__init__(config, max_position, group)

    @classmethod
    def attention_options(cls, config: PretrainedConfig, index: int) -> AttentionOptions:
        return AttentionOptions()

    @classmethod
    def make_attention(cls, config: PretrainedConfig, index: int, options: AttentionOptions,
                       rotary: RotaryEmbedding, group: TensorParallelGroup) -> nn.Module:
        return DeepseekV2Attention(config, rotary, group)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, index: int, group: TensorParallelGroup) -> nn.Module:
        if index < config.first_k_dense_replace:
            return LlamaMLP(config, group)
        return DeepseekMoE(config, group, cls.routing(config))

    def _rotary(self, layer_type: str) -> RotaryEmbedding:
        return RotaryEmbedding(self.config.qk_rope_head_dim, self.max_position, rope_parameters(self.config))

    def rotary_pairs(self, projection: str) -> RotaryPairs | None:
        """Where `projection`'s rows hold interleaved rotary pairs: each head's last
        qk_rope_head_dim rows of the queries, the last rows (the shared key) of
        kv_a_proj_with_mqa; None for other projections, or where the checkpoint stores the
        rotary features as halves (V3's `rope_interleave` false)."""
        if projection not in _ROTARY_ROWS or not getattr(self.config, "rope_interleave", True):
            return None
        dims = mla_dims(self.config)
        if projection == "kv_a_proj_with_mqa":
            return RotaryPairs(dims.cache_width, dims.latent, dims.rope)
        return RotaryPairs(dims.nope + dims.rope, dims.nope, dims.rope)

    def load_tensor(self, name: str, tensor: StoredTensor, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        module_path = name.rpartition(".")[0]
        pairs = self.rotary_pairs(module_path.rpartition(".")[2])
        if pairs is not None and hasattr(getattr(self.get_submodule(module_path), "quant_method", None), "load_shard"):
            # Rows kept packed as the checkpoint stores them: no reorder here.
            raise ValueError(f"checkpoint tensor {name!r}: latent-attention projections stored quantized are not "
                             "supported yet; use the checkpoint's unquantized (bfloat16) release")
        return super().load_tensor(name, tensor if pairs is None else RotaryPairsToHalves(tensor, pairs), params)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, StoredTensor]]) -> Iterator[tuple[str, StoredTensor]]:
        """Skips the multi-token-prediction layers V3 checkpoints carry past num_hidden_layers
        (`model.layers.61.*`), which generation does not use, as vLLM does."""
        last = self.config.num_hidden_layers
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= last:
                continue
            yield name, tensor

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.absorb()
        super().prepack()

    def lora_targets(self) -> dict[str, LoRATarget]:
        """The attention projections but `kv_b_proj` (absorbed into the queries and outputs
        once loaded), an adapter's B on the rotary rows reordered as they are (`RotaryPairs`),
        and the MLPs (dense and shared experts); not the routed experts (see
        `engine.lora.adapter`)."""
        targets = {}
        for path, target in super().lora_targets().items():
            if path.endswith(".kv_b_proj"):
                continue
            pairs = self.rotary_pairs(path.rpartition(".")[2])
            targets[path] = target if pairs is None else replace(target, row_order=pairs)
        return targets


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and Kimi-K2): sigmoid routing with a score correction and the two-best
    group rank; rotary pairs laid out as `rope_interleave` says."""

    routing = staticmethod(Routing.deepseek_v3)
