"""Tool-call parsers: the calls a model writes in its answer, read into OpenAI-shaped
`ToolCall`s, one parser per format (vLLM's `--tool-call-parser`).

`TOOL_CALL_PARSERS` is the one declaration of the names; `tool_parser` builds one by name
and `detect_tool_parser` names the one a model's tokenizer implies. Importing this package
loads no model code (no torch, no transformers).
"""

from typing import TYPE_CHECKING

from engine.tool_parsers import deepseek_v31, hermes, kimi_k2, llama3_json, mistral, openai, qwen3_coder
from engine.tool_parsers.abstract import ToolCallResult, ToolParser, single_token_id
from engine.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from engine.tool_parsers.deepseek_v31 import DeepSeekV31ToolParser
from engine.tool_parsers.hermes import HermesToolParser
from engine.tool_parsers.kimi_k2 import KimiK2ToolParser
from engine.tool_parsers.llama3_json import Llama3JsonToolParser
from engine.tool_parsers.mistral import MistralToolParser
from engine.tool_parsers.openai import OpenAIToolParser
from engine.tool_parsers.pythonic import PythonicToolParser
from engine.tool_parsers.qwen3_coder import Qwen3CoderToolParser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TOOL_CALL_PARSERS", "ToolCallResult", "ToolParser", "detect_tool_parser", "tool_parser"]

TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                       PythonicToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                                       OpenAIToolParser, Qwen3CoderToolParser, KimiK2ToolParser)
}


def tool_parser(name: str, tokenizer: "PreTrainedTokenizerBase | None") -> ToolParser:
    """The parser called `name`, for the model whose tokenizer is `tokenizer`."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not one of {sorted(TOOL_CALL_PARSERS)} "
                         "(or None: the calls stay in the text)")
    return TOOL_CALL_PARSERS[name](tokenizer)


def _chat_template_text(tokenizer: "PreTrainedTokenizerBase") -> str:
    """The tokenizer's chat template, its named templates joined when it has several."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def detect_tool_parser(tokenizer: "PreTrainedTokenizerBase") -> str | None:
    """The parser a model's tokenizer implies, or None: its marker tokens, single tokens of
    the vocabulary, name the format. gpt-oss's harmony tokens (`<|call|>`, `<|constrain|>`)
    and DeepSeek's call markers come first (the most specific: a vocabulary with them may
    hold another format's tokens too; deepseek_v31 when the chat template writes V3.1's calls,
    their arguments bare after the separator where V3's fence them in ```json); then Kimi K2's
    section and call markers; then hermes (`<tool_call>`, `</tool_call>`; qwen3_coder when the
    chat template writes the calls as XML, `<function=` and `<parameter=`), mistral
    (`[TOOL_CALLS]`), and llama3_json (`<|python_tag|>` with a chat template that takes tools).
    Pythonic calls have no marker of their own and are never detected."""
    def has(*tokens: str) -> bool:
        return all(single_token_id(tokenizer, token) is not None for token in tokens)

    if has(openai.CALL, openai.CONSTRAIN):
        return OpenAIToolParser.name
    if has(deepseek_v31.CALLS_BEGIN, deepseek_v31.CALL_BEGIN):
        template = _chat_template_text(tokenizer)
        v31 = deepseek_v31.SEP in template and "```json" not in template
        return DeepSeekV31ToolParser.name if v31 else DeepSeekV3ToolParser.name
    if has(kimi_k2.SECTION_BEGIN, kimi_k2.CALL_BEGIN):
        return KimiK2ToolParser.name
    if has(hermes.OPEN, hermes.CLOSE):
        template = _chat_template_text(tokenizer)
        xml = qwen3_coder.FUNCTION in template and qwen3_coder.PARAMETER in template
        return Qwen3CoderToolParser.name if xml else HermesToolParser.name
    if has(mistral.TOOL_CALLS):
        return MistralToolParser.name
    if has(llama3_json.PYTHON_TAG) and "tools" in _chat_template_text(tokenizer):
        return Llama3JsonToolParser.name
    return None
