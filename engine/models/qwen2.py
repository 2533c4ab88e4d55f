"""Qwen2: the Llama decoder with biases on the q, k and v projections (none on o)."""

from transformers import PretrainedConfig

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def has_qkv_bias(cls, config: PretrainedConfig) -> bool:
        return True
