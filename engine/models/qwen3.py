"""Qwen3: the Llama decoder with RMSNorm on each head's queries and keys before rotary."""

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
