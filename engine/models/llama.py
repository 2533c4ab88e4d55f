"""The Llama decoder (Llama 2/3, SmolLM, Mistral), which the other families subclass.

Weights load straight from safetensors. q/k/v and gate/up projections are fused into
one matrix each, so a layer runs two matrix products where the checkpoint has five. What
differs between families and between layers (biases, norms on the heads, a sliding
window, the MLP) comes from class hooks read once at construction (`attention_options`,
`make_mlp`, `decoder_layer`), so a family is a small subclass.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.attention.layer import Attention, AttentionMetadata
from engine.distributed.communicator import TensorParallelGroup
from engine.layers.fused_moe import FusedMoE
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, ShardSlice, StoredTensor
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.lora.slots import LoRATarget


# Checkpoint tensor suffix -> (fused parameter suffix, shard index within it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# config.json's hidden_act -> the gated activation it names (see engine.kernels.triton.activation).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_type_of(config: PretrainedConfig, index: int) -> str:
    """Whether layer `index` attends over a sliding window or the whole context: config.json's
    `layer_types` where it has them (Gemma, Qwen2), else every layer slides when it sets a
    window (Mistral, Phi-3), unless `use_sliding_window` is false."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    window = getattr(config, "sliding_window", None)
    return SLIDING_ATTENTION if window and getattr(config, "use_sliding_window", True) else FULL_ATTENTION


@dataclass(frozen=True)
class AttentionOptions:
    """One layer's attention as its family and config.json set it (see `Attention` for
    `scale`, `sliding_window`, `logit_softcap`, `sinks` and `attention_chunk_size`)."""

    layer_type: str = FULL_ATTENTION
    qkv_bias: bool = False
    qk_norm: bool = False
    scale: float | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: bool = False
    attention_chunk_size: int | None = None


def allocate(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Gives a model built on the meta device uninitialized storage on `device`, its
    parameters in `dtype` (those a module keeps in float32 stay so): cast while still on the
    meta device, so that nothing is ever allocated wider (a 21B-parameter model's float32
    would not fit an 80 GB GPU)."""
    model.to(dtype)
    model.to_empty(device=device)


def check_shape(name: str, tensor: StoredTensor, expected: list[int]) -> None:
    """Raises ValueError when a checkpoint tensor's shape is not what the model expects."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
            f"expects {tuple(expected)}: config.json does not match the weights"
        )


def copy_named_weights(owner: str, params: dict[str, nn.Parameter], weights: Iterable[tuple[str, StoredTensor]],
                       target_of: Callable[[str], str | None], what: str = "") -> None:
    """Copies each checkpoint tensor into the parameter of `params` that `target_of` names for
    it (None: a tensor that is not `params`' to load), after checking its shape; every
    parameter must be loaded. `owner` and `what` ("vision ") name the model and its part in
    the messages.

    Raises:
        ValueError: a tensor with no parameter, one of the wrong shape, or a parameter the
            checkpoint lacks.
    """
    loaded = set()
    for name, tensor in weights:
        target = target_of(name)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {owner}")
        check_shape(name, tensor, list(params[target].shape))
        params[target].data.copy_(tensor.read(None))
        loaded.add(target)
    absent = sorted(set(params) - loaded)
    if absent:
        raise ValueError(f"the checkpoint lacks {len(absent)} {what}tensors, e.g. {absent[:3]}")


class LlamaAttention(nn.Module):
    """Grouped-query attention. Over tensor-parallel ranks each rank computes its share
    of the query heads with the key/value heads they read (a key/value head is then
    held by several ranks when there are fewer of them than ranks), and o_proj sums."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, rotary: RotaryEmbedding,
                 norm: type[RMSNorm], group: TensorParallelGroup):
        super().__init__()
        qkv_bias, qk_norm = options.qkv_bias, options.qk_norm
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        self.num_heads = num_heads // group.size
        self.num_kv_heads = max(1, num_kv_heads // group.size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        first_kv_head = group.rank * num_kv_heads // group.size
        slices = [None, None, None]
        if group.size > 1:
            q = ShardSlice(0, group.rank * self.q_size, self.q_size, num_heads * self.head_dim)
            kv = ShardSlice(0, first_kv_head * self.head_dim, self.kv_size, num_kv_heads * self.head_dim)
            slices = [q, kv, kv]
        full = [num_heads * self.head_dim, num_kv_heads * self.head_dim, num_kv_heads * self.head_dim]
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, full, slices, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, group,
                                        bias=getattr(config, "attention_bias", False))
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        self.rotary = [rotary]  # a list, so the shared table is not registered once per layer
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=options.scale,
                              sliding_window=options.sliding_window, logit_softcap=options.logit_softcap,
                              sinks=options.sinks, attention_chunk_size=options.attention_chunk_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output of every row, or of `kept_rows` alone (every row's key and
        value still go to the cache)."""
        rotation = self._normed_rotation if self.qk_norm else self.rotary[0]
        out = self.attn.rotate_and_attend(self.qkv_proj(hidden), positions, rotation, meta)
        return self.o_proj(out if kept_rows is None else out[kept_rows])

    def _normed_rotation(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """The queries' and keys' RMSNorms (Qwen3, OLMo 2's per-head norms), then the rotation."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.rotary[0](positions, torch.cat((self.q_norm(q), self.k_norm(k)), dim=1))


def activation_of(config: PretrainedConfig) -> str:
    """The MLP's gated activation ("silu", "gelu_tanh") as config.json names it."""
    name = getattr(config, "hidden_activation", None) or config.hidden_act
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class LlamaMLP(nn.Module):
    """A gated MLP: SwiGLU, or GeGLU with tanh-approximated GELU (Gemma). `kernel`, when
    set (see `engine.model_loader.kernel_routing`), computes act(gate) * up from the fused gate/up
    output in one launch: kernel(gate_up, activation). `fused`, when set (see
    `engine.model_loader.kernel_routing`), runs the whole MLP in one call where its projections allow:
    fused(x, gate_up_proj, down_proj, activation), None where they do not."""

    kernel: Callable | None = None
    fused: Callable[[torch.Tensor, Linear, Linear, str], torch.Tensor | None] | None = None

    def __init__(self, config: PretrainedConfig, group: TensorParallelGroup, intermediate_size: int | None = None):
        super().__init__()
        self.activation = activation_of(config)
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.split(config.hidden_size, [size, size], group, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, group, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            out = self.fused(x, self.gate_up_proj, self.down_proj, self.activation)
            if out is not None:
                return out
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None:
            return self.down_proj(self.kernel(gate_up, self.activation))
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream. With `kept_rows`
    (the last layer, see `KeptRows`) the rows after the attention are those alone."""

    def __init__(self, config: PretrainedConfig, attention: LlamaAttention, mlp: nn.Module, norm: type[RMSNorm]):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kept_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual, kept_rows)
        hidden = self.self_attn(positions, hidden, meta, kept_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def normed_input(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                     kept_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's output added to the residual stream, normalised for this
        layer's attention; and the stream (the embeddings themselves before the first
        layer), of `kept_rows` alone where given."""
        if residual is None:
            # The stream stays in float32 (see RMSNorm), a copy of its own: the norms may add into it in place.
            normed, residual = self.input_layernorm(hidden), hidden.to(torch.float32, copy=True)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        return normed, residual if kept_rows is None else residual[kept_rows]


class LlamaModel(nn.Module):
    """The embedding, the decoder layers and the final norm. `embed_scale` multiplies the
    embeddings (Gemma: sqrt(hidden_size), rounded to the model's dtype as Gemma does).
    `fused`, when set (see `engine.model_loader.kernel_routing`), runs the layers and the final
    norm in one call where it can: fused(model, embeddings, positions, meta, kept_rows), None
    where it cannot."""

    fused: Callable[..., torch.Tensor | None] | None = None

    def __init__(self, config: PretrainedConfig, layers: list[nn.Module], norm: type[RMSNorm],
                 group: TensorParallelGroup, embed_scale: float | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = embed_scale

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer reads (scaled where the family scales them)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # a Python number: nothing for a CUDA graph to copy
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every row, or of `kept_rows` (see `KeptRows`). With
        `inputs_embeds` the first layer reads those rows instead of `input_ids`' embeddings
        (a vision-language model's, with its images' encoder outputs placed in)."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        if self.fused is not None and (out := self.fused(self, hidden, positions, meta, kept_rows)) is not None:
            return out
        residual = None
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta, kept_rows if index == last else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A decoder-only transformer with rotary positions, grouped-query attention and SwiGLU.

    Construct it under `torch.device("meta")` and call `materialize` to place it on a
    device without paying for random initialization, then `load_weights`. With a
    tensor-parallel `group` of several ranks it is this rank's share of the model.
    """

    qk_norm = False
    norm_class: type[RMSNorm] = RMSNorm
    decoder_layer_class: type[nn.Module] = LlamaDecoderLayer
    # Checkpoint leaves loaded into a fused projection: leaf -> (fused leaf, shard).
    fused_leaves: dict[str, tuple[str, int]] = _FUSED

    @classmethod
    def has_qkv_bias(cls, config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @classmethod
    def attention_options(cls, config: PretrainedConfig, index: int) -> AttentionOptions:
        """Layer `index`'s attention."""
        layer_type = layer_type_of(config, index)
        window = config.sliding_window if layer_type == SLIDING_ATTENTION else None
        return AttentionOptions(layer_type, cls.has_qkv_bias(config), cls.qk_norm, sliding_window=window)

    @classmethod
    def make_attention(cls, config: PretrainedConfig, index: int, options: AttentionOptions,
                       rotary: RotaryEmbedding, group: TensorParallelGroup) -> nn.Module:
        """Layer `index`'s attention."""
        return LlamaAttention(config, options, rotary, cls.norm_class, group)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, index: int, group: TensorParallelGroup) -> nn.Module:
        """Layer `index`'s MLP."""
        return LlamaMLP(config, group)

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None):
        super().__init__()
        group = group or TensorParallelGroup()
        self.config = config
        self.max_position = max_position
        options = [self.attention_options(config, i) for i in range(config.num_hidden_layers)]
        self.rotary_embeddings = nn.ModuleDict({
            kind: self._rotary(kind) for kind in sorted({o.layer_type for o in options})
        })
        layers = [
            self.decoder_layer_class(
                config, self.make_attention(config, i, o, self.rotary_embeddings[o.layer_type], group),
                self.make_mlp(config, i, group), self.norm_class,
            )
            for i, o in enumerate(options)
        ]
        self.model = LlamaModel(config, layers, self.norm_class, group, self.embed_scale(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, group)

    @classmethod
    def embed_scale(cls, config: PretrainedConfig) -> float | None:
        """What the embeddings are multiplied by (None: nothing)."""
        return None

    def _rotary(self, layer_type: str) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim_of(self.config), self.max_position, rope_parameters(self.config, layer_type))

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocates (uninitialized) parameters and builds the rotary tables on `device`."""
        allocate(self, device, dtype)
        self.build_buffers(device)

    def build_buffers(self, device: torch.device) -> None:
        """Builds the rotary tables on `device` (after `to_empty`, which leaves them unset)."""
        for kind, rotary in self.rotary_embeddings.items():
            fresh = self._rotary(kind)
            rotary.cos, rotary.sin = fresh.cos.to(device), fresh.sin.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [tokens, hidden] of the step's tokens; [kept, hidden] of
        `kept_rows` alone where given (the last layer's MLP runs for those only)."""
        return self.model(input_ids, positions, meta, kept_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in float32 (see `Linear.forward_float32`), on tensor-parallel
        rank 0; every rank must call it (the vocabulary's slices are gathered), the others
        get None."""
        return self.lm_head.logits(hidden)

    def prepack(self) -> None:
        """Prepares every projection for fast products once the weights are in."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.prepack()

    def lora_targets(self) -> dict[str, LoRATarget]:
        """The projections a LoRA adapter may change, by their Hugging Face path
        ("model.layers.0.self_attn.q_proj"): our Linear and which of its stacked
        checkpoint tensors the path names."""
        unfused: dict[str, list[str]] = {}  # fused projection -> its Hugging Face leaves, in shard order
        for (fused, _), leaf in sorted((place, leaf) for leaf, place in self.fused_leaves.items()):
            unfused.setdefault(fused, []).append(leaf)
        targets = {}
        for name, module in self.model.layers.named_modules(prefix="model.layers"):
            if not isinstance(module, Linear):
                continue
            prefix, _, leaf = name.rpartition(".")
            for shard, hf_leaf in enumerate(unfused.get(leaf, [leaf])):
                targets[f"{prefix}.{hf_leaf}"] = LoRATarget(module, shard)
        return targets

    def load_weights(self, weights: Iterable[tuple[str, StoredTensor]]) -> None:
        """Copies checkpoint tensors in, fusing q/k/v and gate/up; of a split projection
        only this rank's slice is read.

        Raises:
            ValueError: a tensor the model does not have, one of the wrong shape, or a
                parameter the checkpoint lacks.
        """
        params = dict(self.named_parameters())
        if self.tie_word_embeddings:
            del params["lm_head.weight"]
        expected = {(name, shard) for name in params for shard in range(self.num_checkpoint_tensors(name))}
        loaded = set()
        for name, tensor in self.checkpoint_tensors(weights):
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            loaded.add(self.load_tensor(name, tensor, params))
        absent = sorted({name for name, _ in expected - loaded})
        if absent:
            raise ValueError(f"the checkpoint lacks {len(absent)} tensors, e.g. {absent[:3]}")
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, StoredTensor]]
    ) -> Iterable[tuple[str, StoredTensor]]:
        """The checkpoint's tensors under the names `load_tensor` takes (a family whose
        checkpoints fuse projections splits them here)."""
        return weights

    def num_checkpoint_tensors(self, param_name: str) -> int:
        """How many checkpoint tensors fill the parameter (3 for a fused q/k/v)."""
        return len(self._module_of(param_name)[1])

    def load_tensor(self, name: str, tensor: StoredTensor, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        """Copies one checkpoint tensor (this rank's slice of it) into its parameter;
        returns (parameter name, which of its stacked tensors it was)."""
        module_path, _, kind = name.rpartition(".")
        prefix, _, leaf = module_path.rpartition(".")
        target, shard = name, 0
        if leaf in self.fused_leaves:
            fused_leaf, shard = self.fused_leaves[leaf]
            target = f"{prefix}.{fused_leaf}.{kind}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        module, sizes, slices = self._module_of(target)
        piece = slices[shard]
        if kind == "weight" and hasattr(getattr(module, "quant_method", None), "load_shard"):
            whole = [sizes[shard], module.in_features]
            if piece is not None:
                whole[piece.dim] = piece.full
            check_shape(name, tensor, whole)
            module.quant_method.load_shard(module, shard, tensor, piece)  # kept as the checkpoint stores it
            return target, shard
        if piece is not None and piece.dim >= params[target].dim():
            piece = None  # the bias of a row-parallel projection: whole on every rank
        rows = piece.length if piece is not None and piece.dim == 0 else sizes[shard]
        dest = params[target].data.narrow(0, sum(sizes[:shard]), rows)
        whole = list(dest.shape)
        if piece is not None:
            whole[piece.dim] = piece.full
        check_shape(name, tensor, whole)
        dest.copy_(tensor.read(piece))
        if isinstance(module, RMSNorm) and module.weight_offset:
            dest.add_(module.weight_offset)
        if rows < sizes[shard]:  # the last rank's padded share of the vocabulary
            params[target].data.narrow(0, sum(sizes[:shard]) + rows, sizes[shard] - rows).zero_()
        return target, shard

    def _module_of(self, param_name: str) -> tuple[nn.Module, list[int], list[ShardSlice | None]]:
        """The parameter's module, the rows of each checkpoint tensor stacked in it (one
        if not fused) and the slice of each that this rank holds."""
        module = self.get_submodule(param_name.rpartition(".")[0])
        sizes = getattr(module, "shard_sizes", None) or [self.get_parameter(param_name).shape[0]]
        return module, sizes, getattr(module, "checkpoint_slices", None) or [None] * len(sizes)
