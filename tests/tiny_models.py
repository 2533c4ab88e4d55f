"""Tiny random models of each supported family, saved as real model folders."""

from pathlib import Path

import torch
import transformers

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Continuous batching schedules requests at the granularity of iterations.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: + - * / = ( ) [ ] { } ! ? , ; :",
    "Unicode: café, naïve, 東京, Ωμέγα, emoji 🙂.",
]

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe",
            "qwen3_moe")
# Attention of the families that slide a window over the context: shorter than most test prompts.
WINDOW = 16


def build_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer (vocab ~300) saved into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(folder)


def _new_family_config(family: str, common: dict, tie: bool | None) -> "transformers.PretrainedConfig":
    """Mistral with a window; Gemma 2 (soft-capping, alternating windows), Gemma 3 (head
    norms, local and global rotary bases); Phi-3 (fused checkpoint tensors, Phi-4-mini's
    partial rotation); the mixtures of experts (Qwen2-MoE with a shared expert and a dense
    second layer)."""
    untied = {**common, "tie_word_embeddings": bool(tie)}
    if family == "mistral":
        return transformers.MistralConfig(**untied, sliding_window=WINDOW)
    if family == "gemma2":
        return transformers.Gemma2Config(**{**common, "tie_word_embeddings": tie is not False}, head_dim=32,
                                         query_pre_attn_scalar=24, sliding_window=WINDOW,
                                         attn_logit_softcapping=8.0, final_logit_softcapping=12.0)
    if family == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
        return transformers.Gemma3TextConfig(**{**common, "tie_word_embeddings": tie is not False}, head_dim=32,
                                             query_pre_attn_scalar=32, sliding_window=WINDOW, rope_parameters=rope,
                                             layer_types=["sliding_attention", "full_attention"])
    if family == "phi3":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        return transformers.Phi3Config(**{"rope_parameters": rope, **untied})
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": 48}
    if family == "mixtral":
        return transformers.MixtralConfig(**untied, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**untied, **moe, num_experts=4, shared_expert_intermediate_size=96,
                                           mlp_only_layers=[1])
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**untied, **moe, head_dim=32, num_experts=8, norm_topk_prob=True)
    raise ValueError(family)


def save_random(model: "transformers.PreTrainedModel", folder: Path) -> None:
    """Saves `model` into `folder` with its matrices drawn larger than the default init
    (normal, std 0.15), so that greedy tokens are far from ties."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)


def build_tiny_model(folder: Path, family: str, seed: int = 0, tie: bool | None = None, **overrides: object) -> Path:
    """A random model of `family` with real config, safetensors weights and tokenizer;
    `overrides` replace config fields shared by every family (`num_key_value_heads=1`)."""
    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True if tie is None else tie)
    elif family == "llama3":
        config = transformers.LlamaConfig(
            **{**common, "max_position_embeddings": 1024}, tie_word_embeddings=bool(tie),
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        )
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=bool(tie))
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=bool(tie))
    else:
        config = _new_family_config(family, common, tie)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_random(model, folder)
    build_tokenizer(folder)
    return folder
