"""Llama 4 (text): Scout and Maverick's language model, alone (`Llama4ForCausalLM`) or
read from a vision-language checkpoint for text prompts (`Llama4ForConditionalGeneration`,
see `engine.models.LANGUAGE_MODELS`; its vision model and projector are skipped).

The Llama decoder with three kinds of difference, each read per layer from config.json:

- Attention. Layers with rotary positions (`no_rope_layers[i]` 1) attend within chunks of
  `attention_chunk_size` tokens (a query sees the keys of its own chunk only) and
  L2-normalise each head's queries and keys after the rotation (`use_qk_norm`); the others
  (NoPE) see the whole context without positions, their queries scaled by a factor that
  grows with the position (`attn_temperature_tuning`: 1 + attn_scale * log(1 +
  floor((p + 1) / floor_scale))).
- Rotary. Llama 4 rotates adjacent pairs of features (2i, 2i + 1), where our
  `RotaryEmbedding` rotates (i, i + head_dim / 2): the q and k projections' rows of each
  head are reordered at load, evens then odds, which leaves every q . k unchanged.
- Feed-forward. The layers in `moe_layers` (every `interleave_moe_layer_step`-th) route
  each token to its top experts by the sigmoid of the router's logit, which scales the
  expert's input (not its output), and add a shared expert (an MLP of
  `intermediate_size`); the others are a dense MLP of `intermediate_size_mlp`.

Checkpoints store the experts fused, gate_up_proj [E, H, 2I] (gate columns then up) and
down_proj [E, I, H], the transposes of `FusedMoE`'s w13 and w2.
"""

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.attention.layer import AttentionMetadata
from engine.distributed.communicator import TensorParallelGroup
from engine.layers.fused_moe import FusedMoE, Routing
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear, ShardSlice, StoredTensor
from engine.layers.rotary import RotaryEmbedding, RotaryPairs, RotaryPairsToHalves
from engine.lora.slots import LoRATarget
from engine.models.llama import (
    FULL_ATTENTION, AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP, activation_of, check_shape,
    head_dim_of,
)

CHUNKED_ATTENTION = "chunked_attention"
# A vision-language checkpoint's language model (transformers' Llama4ForConditionalGeneration).
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")
_EXPERTS = re.compile(r"^(?P<experts>model\.layers\.\d+\.mlp\.experts)\.(?P<leaf>gate_up_proj|down_proj)$")
_ROTATED = re.compile(r"^model\.layers\.(?P<layer>\d+)\.self_attn\.[qk]_proj\.(weight|bias)$")


@dataclass(frozen=True)
class Llama4Layer:
    """What sets layer i apart: `rotary` (config.json's `no_rope_layers[i]`), the chunk its
    queries attend within (`attention_chunk_size` where `layer_types[i]` is
    "chunked_attention", else None: the whole context) and whether its feed-forward is
    experts (`moe_layers`)."""

    rotary: bool
    chunk_size: int | None
    moe: bool

    @classmethod
    def of(cls, config: PretrainedConfig, index: int) -> "Llama4Layer":
        layer_type = config.layer_types[index]
        if layer_type not in (CHUNKED_ATTENTION, FULL_ATTENTION):
            raise ValueError(f"layer_types[{index}] is {layer_type!r}: Llama 4 layers are {CHUNKED_ATTENTION!r} "
                             f"or {FULL_ATTENTION!r}; fix config.json's layer_types")
        chunk = config.attention_chunk_size if layer_type == CHUNKED_ATTENTION else None
        return cls(bool(config.no_rope_layers[index]), chunk, index in config.moe_layers)


def check_supported(config: PretrainedConfig) -> None:
    """Raises ValueError naming the first config.json option this implementation does not
    run: experts other than SwiGLU (`hidden_act`), per-layer lists that do not cover every
    layer, layer types other than chunked and full attention, or layers chunked without an
    `attention_chunk_size`."""
    if activation_of(config) != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for Llama 4: its experts run SwiGLU "
                         "(hidden_act 'silu')")
    layers = config.num_hidden_layers
    for option in ("no_rope_layers", "layer_types"):
        if len(getattr(config, option)) < layers:
            raise ValueError(f"config.json's {option} has {len(getattr(config, option))} entries for {layers} "
                             f"layers: give one per layer")
    if CHUNKED_ATTENTION in config.layer_types[:layers] and not config.attention_chunk_size:
        raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is not set: set it "
                         "in config.json")
    for index in range(layers):
        Llama4Layer.of(config, index)


@dataclass(frozen=True)
class TemperatureTuning:
    """The NoPE layers' query scaling (Llama 4's `attn_temperature_tuning`, after
    arXiv:2501.19399): queries at position p times 1 + attn_scale * log1p(floor((p + 1) /
    floor_scale)), in float32 and rounded back to the queries' dtype as transformers does."""

    floor_scale: float
    attn_scale: float

    def __call__(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (q * scales[:, None, None]).to(q.dtype)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's features divided by their root mean square (no weight), in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(LlamaAttention):
    """Grouped-query attention as `LlamaAttention`, with the layer's rotary (or none),
    chunk, query/key L2 norm and temperature tuning (see the module's docstring)."""

    def __init__(self, config: PretrainedConfig, layer: Llama4Layer, options: AttentionOptions,
                 rotary: RotaryEmbedding, group: TensorParallelGroup):
        super().__init__(config, options, rotary, RMSNorm, group)
        self.use_rotary = layer.rotary
        self.l2_norm_eps = config.rms_norm_eps if config.use_qk_norm and layer.rotary else None
        self.temperature = (TemperatureTuning(config.floor_scale, config.attn_scale)
                            if config.attn_temperature_tuning and not layer.rotary else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None = None) -> torch.Tensor:
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.use_rotary:
            qk = self.rotary[0](positions, qk)
        if self.l2_norm_eps is not None:  # after the rotation, as transformers (equal but for rounding)
            qk = l2_normalize(qk, self.l2_norm_eps)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.temperature is not None:
            q = self.temperature(positions, q)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta).view(-1, self.q_size)
        return self.o_proj(out if kept_rows is None else out[kept_rows])


class Llama4MoE(nn.Module):
    """The router, the experts (their inputs weighted by `Routing.llama4`) and the shared
    expert, whose outputs are summed."""

    def __init__(self, config: PretrainedConfig, group: TensorParallelGroup) -> None:
        super().__init__()
        self.routing = Routing.llama4(config)
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.router.quantizable = False  # routing is a choice: it keeps the model's dtype
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size, config.intermediate_size, group,
                                weights_on_input=True)
        self.shared_expert = LlamaMLP(config, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing.select(self.router(x))
        return self.shared_expert(x) + self.experts(x, weights, ids)


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4's text model (see the module's docstring).

    Raises:
        ValueError: at construction, a config.json option it does not implement.
    """

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, index: int, group: TensorParallelGroup) -> nn.Module:
        if Llama4Layer.of(config, index).moe:
            return Llama4MoE(config, group)
        return LlamaMLP(config, group, config.intermediate_size_mlp)

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None):
        check_supported(config)
        super().__init__(config, max_position, group)
        self.layer_kinds = [Llama4Layer.of(config, i) for i in range(config.num_hidden_layers)]

    @classmethod
    def attention_options(cls, config: PretrainedConfig, index: int) -> AttentionOptions:
        """Chunked attention on the rotary layers, the whole context on the others."""
        layer = Llama4Layer.of(config, index)
        return AttentionOptions(CHUNKED_ATTENTION if layer.chunk_size else FULL_ATTENTION, cls.has_qkv_bias(config),
                                attention_chunk_size=layer.chunk_size)

    @classmethod
    def make_attention(cls, config: PretrainedConfig, index: int, options: AttentionOptions,
                       rotary: RotaryEmbedding, group: TensorParallelGroup) -> nn.Module:
        return Llama4Attention(config, Llama4Layer.of(config, index), options, rotary, group)

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, StoredTensor]]
    ) -> Iterator[tuple[str, StoredTensor]]:
        """The language model's tensors (a vision-language checkpoint's without its prefix;
        its vision model skipped), `feed_forward` as `mlp`, rotary layers' q and k rows
        reordered (`RotaryPairs`)."""
        for name, tensor in weights:
            for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
                if name.startswith(prefix):
                    name = replacement + name.removeprefix(prefix)
                    break
            if name.startswith(_VISION_PREFIXES):
                continue
            name = name.replace(".feed_forward.", ".mlp.")
            rotated = _ROTATED.match(name)
            layer = int(rotated["layer"]) if rotated else len(self.layer_kinds)
            if layer < len(self.layer_kinds) and self.layer_kinds[layer].rotary:
                tensor = RotaryPairsToHalves(tensor, self.rotary_pairs)
            yield name, tensor

    def load_tensor(self, name: str, tensor: StoredTensor, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        match = _EXPERTS.match(name)
        if match is None:
            return super().load_tensor(name, tensor, params)
        if f"{match['experts']}.w13" not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}: config.json's "
                             "moe_layers does not list its layer")
        experts: FusedMoE = self.get_submodule(match["experts"])
        group = experts.group
        local, hidden = experts.w2.shape[2], experts.w2.shape[1]
        full = local * group.size
        if match["leaf"] == "down_proj":  # [E, I, H]: this rank's rows of I
            check_shape(name, tensor, [experts.num_experts, full, hidden])
            piece = ShardSlice.even(1, full, group.rank, group.size)
            experts.w2.data.copy_(tensor.read(piece).transpose(1, 2))
            return f"{match['experts']}.w2", 0
        check_shape(name, tensor, [experts.num_experts, hidden, 2 * full])
        for shard in range(2):  # gate columns, then up: this rank's columns of each
            piece = ShardSlice(2, shard * full + group.rank * local, local, 2 * full)
            experts.w13.data.narrow(1, shard * local, local).copy_(tensor.read(piece).transpose(1, 2))
        return f"{match['experts']}.w13", 0

    @property
    def rotary_pairs(self) -> RotaryPairs:
        """Where the rotary layers' q and k rows hold their interleaved pairs: every head's."""
        head_dim = head_dim_of(self.config)
        return RotaryPairs(head_dim, 0, head_dim)

    def lora_targets(self) -> dict[str, LoRATarget]:
        """The attention projections and the dense layers' MLPs, under the checkpoint's names
        (`feed_forward`); an adapter's B on the rotary layers' q_proj and k_proj is reordered
        as their rows are (`RotaryPairs`). Not the experts, routers and shared experts."""
        targets = {}
        for path, target in super().lora_targets().items():
            layer, moved, _ = path.partition(".mlp.")
            if moved and isinstance(self.get_submodule(f"{layer}.mlp"), Llama4MoE):
                continue
            index = int(path.split(".")[2])
            if path.endswith((".q_proj", ".k_proj")) and self.layer_kinds[index].rotary:
                target = replace(target, row_order=self.rotary_pairs)
            targets[path.replace(".mlp.", ".feed_forward.")] = target
        return targets
