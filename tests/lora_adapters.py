"""LoRA adapters for tests: random PEFT adapters and PEFT's own greedy output as reference.

PEFT initializes `lora_B` to zero, so a freshly made adapter changes nothing. The
adapters built here have every `lora_A` and `lora_B` weight drawn at random instead,
large enough to change a model's greedy output but not so large that it degenerates.
"""

import math
from pathlib import Path

import torch


def build_lora_adapter(
    base_model_folder: Path,
    out_folder: Path,
    *,
    rank: int,
    alpha: float,
    target_modules: list[str],
    seed: int,
    use_rslora: bool = False,
    scale: float = 0.5,
    **lora_config: object,
) -> Path:
    """Save a PEFT LoRA adapter with random, non-zero weights for the model in `base_model_folder`.

    `lora_A` (shape `(rank, in_features)`) is drawn from a normal distribution with
    standard deviation `scale / sqrt(in_features)`, and `lora_B` (shape
    `(out_features, rank)`) with `scale / sqrt(rank)`. The product `B @ A @ x` then has
    entries about `scale**2` times the root mean square of `x`, before PEFT's factor of
    `alpha / rank` (`alpha / sqrt(rank)` with `use_rslora`).

    Args:
        base_model_folder: Hugging Face model folder that the adapter is made for.
        out_folder: Where to save the adapter (`adapter_config.json` and
            `adapter_model.safetensors`); created if missing.
        rank: LoRA rank `r`.
        alpha: `lora_alpha`.
        target_modules: Names of the linear layers to adapt, e.g. `["q_proj", "v_proj"]`.
        seed: Seed of the generator that draws the weights.
        use_rslora: Scale by `alpha / sqrt(rank)` instead of `alpha / rank`.
        scale: Size of the random weights, relative to the default above.
        **lora_config: More `LoraConfig` fields (`rank_pattern`, `alpha_pattern`, ...).

    Returns:
        `out_folder`.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model_folder, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora,
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **lora_config,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:
                std = scale / math.sqrt(param.shape[1])
            elif ".lora_B." in name:
                std = scale / math.sqrt(rank)
            else:
                continue
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)
    peft_model.save_pretrained(out_folder)
    return out_folder


def peft_greedy(
    base_model_folder: Path,
    adapter_folder: Path | None,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy continuations from transformers (with PEFT's adapter, if one is given), in float32.

    Each prompt is generated on its own (batch size 1, no padding). End-of-sequence
    tokens do not stop generation and are not suppressed either, so every continuation
    has exactly `max_new_tokens` tokens, as with `ignore_eos=True` in the engine.

    Args:
        base_model_folder: Hugging Face model folder.
        adapter_folder: PEFT adapter folder, or None for the base model alone.
        prompts_token_ids: Prompts as token ids.
        max_new_tokens: Number of tokens to generate per prompt.

    Returns:
        The generated token ids per prompt, without the prompt.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(base_model_folder, dtype=torch.float32)
    # Replaces the folder's generation config, whose end-of-sequence token would stop
    # generation and whose settings (a repetition penalty, say) would change greedy
    # output. It must be the model's own: `generate` fills the fields left unset in a
    # config passed to it, `eos_token_id=None` included, from the model's.
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens)
    if adapter_folder is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_folder)
    model.eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts_token_ids:
            input_ids = torch.tensor([ids])
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
            outputs.append(out[0, len(ids):].tolist())
    return outputs
