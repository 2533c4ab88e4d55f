"""Phi-3 and Phi-4: the Llama decoder, from checkpoints whose q/k/v and gate/up
projections are already fused (`qkv_proj`, `gate_up_proj`), with LongRoPE scaling and, in
Phi-4-mini, rotation of part of each head (see `engine.layers.rotary`)."""

from collections.abc import Iterable, Iterator

from engine.layers.linear import StoredTensor
from engine.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, StoredTensor]]
    ) -> Iterator[tuple[str, StoredTensor]]:
        """The fused tensors split into the q/k/v and gate/up tensors they stack, so that
        each loads (and each tensor-parallel rank reads its slice) as in Llama."""
        config = self.config
        heads, head_dim = config.num_attention_heads, head_dim_of(config)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        parts = {
            "qkv_proj": [("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)],
            "gate_up_proj": [("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)],
        }
        for name, tensor in weights:
            module_path, _, kind = name.rpartition(".")
            prefix, _, leaf = module_path.rpartition(".")
            if leaf not in parts:
                yield name, tensor
                continue
            if tensor.shape[0] != sum(rows for _, rows in parts[leaf]):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the model expects "
                                 f"{' + '.join(str(r) for _, r in parts[leaf])}: config.json does not match the weights")
            start = 0
            for part, rows in parts[leaf]:
                yield f"{prefix}.{part}.{kind}", tensor.rows(start, rows)
                start += rows
