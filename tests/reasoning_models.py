"""Tiny random reasoning models: a Qwen3 decoder whose tokenizer carries a family's markers
and chat template (the family's own, `tests/chat_templates/`)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer

from tests.tiny_models import build_tiny_model

TEMPLATES = Path(__file__).parent / "chat_templates"
# Per family: its special tokens (the first is the end of a turn, the model's EOS), and the
# markers its vocabulary holds as plain added tokens (not special: they stay in the text).
FAMILY_TOKENS = {
    "qwen3": (["<|im_end|>", "<|im_start|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>"]),
    "deepseek_r1": (["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                    ["<think>", "</think>"]),
}


def build_reasoning_model(folder: Path, family: str = "qwen3", markers_as_tokens: bool = True,
                          favour: dict[str, float] | None = None) -> Path:
    """A random Qwen3-shaped model in `folder` with the family's chat template; without
    `markers_as_tokens` its `<think>` and `</think>` are split into several tokens.
    `favour` adds about this much to the logits of these tokens at every position (see
    `favour_tokens`): a random model that opens and closes its reasoning by itself."""
    build_tiny_model(folder, "qwen3", vocab_size=336, max_position_embeddings=2048)
    special, markers = FAMILY_TOKENS[family]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    if markers_as_tokens:
        tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    tokenizer.eos_token = special[0]
    if family == "deepseek_r1":
        tokenizer.bos_token = special[1]
    tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    tokenizer.save_pretrained(folder)
    assert len(tokenizer) <= 336, len(tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = tokenizer.eos_token_id
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if favour:
        favour_tokens(folder, {tokenizer.convert_tokens_to_ids(token): bias for token, bias in favour.items()})
    return folder


def favour_tokens(folder: Path, biases: dict[int, float]) -> None:
    """Rewrites the weights so that the given tokens' logits gain about `bias` each: hidden
    dimension 0 of every embedding becomes a constant that no layer writes to (the attention
    and MLP output rows 0 are zeroed), so after the final norm it is a positive number of
    stable size (measured here on a text), which only the favoured tokens' head rows read."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    for name, tensor in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor[0] = 0.0
    weights["model.norm.weight"][0] = 1.0
    weights["lm_head.weight"][:, 0] = 0.0
    save_file(weights, path, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(folder)("Reasoning about a question, then answering it.",
                                                return_tensors="pt").input_ids
    with torch.no_grad():
        level = model(ids, output_hidden_states=True).hidden_states[-1][0, :, 0].mean().item()
    for token, bias in biases.items():
        weights["lm_head.weight"][token, 0] = bias / level
    save_file(weights, path, metadata={"format": "pt"})
