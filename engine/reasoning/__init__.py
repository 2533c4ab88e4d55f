"""Reasoning parsers by name (vLLM's `--reasoning-parser`, whose name `deepseek_v3` is
accepted for `deepseek_v31`), and the one a model folder's tokenizer implies."""

import re
from typing import TYPE_CHECKING

from engine.reasoning.parser import Phase, ReasoningFormat, ReasoningParser, ReasoningSplit, ReasoningTracker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The one declaration of the formats, by the names vLLM gives them; detection tries them in
# this order, the most specific markers first.
_FORMATS = (
    # gpt-oss's harmony format: the analysis channel, then the final one (its header may hold a
    # constraint, `<|channel|>final <|constrain|>json<|message|>`), or the commentary channel
    # (tool calls, preambles: the `openai` tool parser reads its messages).
    ReasoningFormat("openai_gptoss", "<|channel|>analysis<|message|>", "<|channel|>final", opens_itself=True,
                    trailer="<|end|><|start|>assistant", header_end="<|message|>",
                    signature=("<|channel|>", "<|message|>"), other_ends=("<|channel|>commentary",),
                    special_tokens=("<|start|>", "<|end|>", "<|channel|>", "<|message|>"),
                    family="gpt-oss", syntax="harmony"),
    # Kimi K2's thinking models: a call section may start without `</think>`; the template's
    # `thinking` switch closes the section in the prompt when off.
    ReasoningFormat("kimi_k2", "<think>", "</think>", opens_itself=True,
                    signature=("<think>", "</think>", "<|tool_calls_section_begin|>"),
                    other_ends=("<|tool_calls_section_begin|>",)),
    # DeepSeek-V3.1: its template's `thinking` switch ends the generation prompt with `<think>`
    # (on) or `</think>` (off, the default): the prompt decides, as vLLM's `deepseek_v3`
    # delegates to R1's parser or to none by the same switch.
    ReasoningFormat("deepseek_v31", "<think>", "</think>",
                    signature=("<think>", "</think>", "<｜tool▁calls▁begin｜>"), template_switch="thinking"),
    # Qwen3: current models may go from the thinking straight into a call.
    ReasoningFormat("qwen3", "<think>", "</think>", other_ends=("<tool_call>",)),
    ReasoningFormat("deepseek_r1", "<think>", "</think>", opens_itself=True),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]"),
)
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    **{fmt.name: fmt for fmt in _FORMATS},
    "deepseek_v3": next(fmt for fmt in _FORMATS if fmt.name == "deepseek_v31"),  # vLLM's name for it
}

__all__ = ["Phase", "REASONING_FORMATS", "ReasoningFormat", "ReasoningParser", "ReasoningSplit", "ReasoningTracker",
           "detect_reasoning_parser", "reasoning_parser"]


def reasoning_parser(name: str, tokenizer: "PreTrainedTokenizerBase") -> ReasoningParser:
    """The named parser on this tokenizer.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in REASONING_FORMATS:
        raise ValueError(f"reasoning_parser={name!r} is not one of {sorted(REASONING_FORMATS)} (or None: no parsing)")
    return ReasoningParser(REASONING_FORMATS[name], tokenizer)


def detect_reasoning_parser(tokenizer: "PreTrainedTokenizerBase") -> tuple[str, str] | None:
    """The parser a tokenizer implies and why, or None: the first format (most specific
    first) whose signature tokens are tokens of the vocabulary and whose chat template uses
    the first of them (and mentions the format's on/off switch, if it has one). Of the plain
    `<think>` formats, deepseek_r1 when the template opens the section itself in the
    generation prompt (the model may then close it without ever opening it), else qwen3."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    for fmt in _FORMATS:
        if (fmt.name == "deepseek_r1" or any(t not in vocab for t in fmt.tokens)
                or fmt.tokens[0] not in template
                or (fmt.template_switch and not re.search(rf"\b{fmt.template_switch}\b", template))):
            continue
        why = f"the tokenizer has {' and '.join(fmt.tokens)} tokens and its chat template uses them"
        if fmt.template_switch:
            why += f", with a {fmt.template_switch!r} switch"
        if fmt.name == "qwen3" and _template_opens_section(tokenizer, fmt.start):
            return "deepseek_r1", why + ", opening the section in the generation prompt"
        return fmt.name, why
    return None


def _template_opens_section(tokenizer: "PreTrainedTokenizerBase", start: str) -> bool:
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                               add_generation_prompt=True)
    except Exception:  # a template that needs more than a plain user message says nothing here
        return False
    return isinstance(prompt, str) and prompt.rstrip().endswith(start)
