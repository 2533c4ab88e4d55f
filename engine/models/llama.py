"""The Llama decoder (Llama 2/3, SmolLM, Mistral); Qwen2 and Qwen3 subclass it.

Weights load straight from safetensors. q/k/v and gate/up projections are fused into
one matrix each, so a layer runs two matrix products where the checkpoint has five.
"""

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear
from engine.layers.rotary import RotaryEmbedding

# Checkpoint tensor suffix -> (fused parameter suffix, shard index within it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.qkv_proj.shard_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = [rotary]  # a list, so the shared table is not registered once per layer
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = self.rotary[0](positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta)
        return self.o_proj(out.view(-1, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU. `activation`, when set (see `engine.layers.triton_routing`), computes silu(gate) *
    up from the fused gate/up output in one launch."""

    activation: Callable | None = None

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up_proj.shard_sizes = [config.intermediate_size, config.intermediate_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation is not None:
            return self.down_proj(self.activation(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden.float()  # the residual stream stays in float32 (see RMSNorm)
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, qkv_bias, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A decoder-only transformer with rotary positions, grouped-query attention and SwiGLU.

    Construct it under `torch.device("meta")` and call `materialize` to place it on a
    device without paying for random initialization, then `load_weights`.
    """

    qk_norm = False

    @classmethod
    def has_qkv_bias(cls, config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def __init__(self, config: PretrainedConfig, max_position: int):
        super().__init__()
        self.config = config
        self.max_position = max_position
        self.rotary = RotaryEmbedding(head_dim_of(config), max_position, config.rope_parameters)
        self.model = LlamaModel(config, self.rotary, self.has_qkv_bias(config), self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocates (uninitialized) parameters and builds the rotary table on `device`."""
        self.to_empty(device=device)
        self.to(dtype)
        rope = RotaryEmbedding(head_dim_of(self.config), self.max_position, self.config.rope_parameters)
        self.rotary.cos, self.rotary.sin = rope.cos.to(device), rope.sin.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [tokens, hidden] of the step's tokens."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] in float32 (see `Linear.forward_float32`)."""
        return self.lm_head.forward_float32(hidden)

    def prepack(self) -> None:
        """Prepares every projection for fast products once the weights are in."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    def lora_targets(self) -> dict[str, tuple[Linear, int, list[int]]]:
        """The projections a LoRA adapter may change, by their Hugging Face path
        ("model.layers.0.self_attn.q_proj") -> (our Linear, shard index, shard sizes)."""
        unfused: dict[str, list[str]] = {}  # fused projection -> its Hugging Face leaves, in shard order
        for (fused, _), leaf in sorted((place, leaf) for leaf, place in _FUSED.items()):
            unfused.setdefault(fused, []).append(leaf)
        targets = {}
        for name, module in self.model.layers.named_modules(prefix="model.layers"):
            if not isinstance(module, Linear):
                continue
            prefix, _, leaf = name.rpartition(".")
            sizes = getattr(module, "shard_sizes", None) or [module.out_features]
            for shard, hf_leaf in enumerate(unfused.get(leaf, [leaf])):
                targets[f"{prefix}.{hf_leaf}"] = (module, shard, sizes)
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors in, fusing q/k/v and gate/up.

        Raises:
            ValueError: a tensor the model does not have, one of the wrong shape, or a
                parameter the checkpoint lacks.
        """
        params = dict(self.named_parameters())
        if self.tie_word_embeddings:
            del params["lm_head.weight"]
        expected = {(name, shard) for name in params for shard in range(len(self._shard_sizes(name)))}
        loaded = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            module_path, _, kind = name.rpartition(".")
            prefix, _, leaf = module_path.rpartition(".")
            target, shard = name, 0
            if leaf in _FUSED:
                fused_leaf, shard = _FUSED[leaf]
                target = f"{prefix}.{fused_leaf}.{kind}"
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            sizes = self._shard_sizes(target)
            dest = params[target].data.narrow(0, sum(sizes[:shard]), sizes[shard])
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(dest.shape)}: config.json does not match the weights"
                )
            dest.copy_(tensor)
            loaded.add((target, shard))
        absent = sorted({name for name, _ in expected - loaded})
        if absent:
            raise ValueError(f"the checkpoint lacks {len(absent)} tensors, e.g. {absent[:3]}")
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _shard_sizes(self, param_name: str) -> list[int]:
        """Row counts of the checkpoint tensors stacked in a parameter (one if not fused)."""
        module = self.get_submodule(param_name.rpartition(".")[0])
        return getattr(module, "shard_sizes", None) or [self.get_parameter(param_name).shape[0]]
