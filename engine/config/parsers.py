"""How a completion is read apart (`ParserSettings`): the reasoning parser (vLLM keeps its
`reasoning_parser` in `config/structured_outputs.py`, as a structured output's grammar starts
after the reasoning) and the tool-call parser (vLLM's `--tool-call-parser`)."""

from dataclasses import dataclass

from engine.config.utils import OUTPUT, SettingsGroup, _setting


@dataclass
class ParserSettings(SettingsGroup):
    """Which parsers find a completion's reasoning section and its tool calls."""

    reasoning_parser: str | None = _setting("auto", "How to find the reasoning section of a reasoning model's "
                                                    "completions (vLLM's reasoning_parser): 'qwen3', 'deepseek_r1', "
                                                    "'mistral' or 'openai_gptoss' (harmony's analysis channel); None: "
                                                    "no parsing; 'auto': the one the tokenizer implies (its <think> "
                                                    "and </think>, or harmony's, tokens used by its chat template), "
                                                    "else none. The reasoning goes to "
                                                    "CompletionOutput.reasoning, the answer to text, and a structured "
                                                    "output's grammar starts after the reasoning.", OUTPUT)
    tool_call_parser: str | None = _setting("auto", "How to find tool calls in completions (vLLM's "
                                                    "tool_call_parser): 'hermes', 'llama3_json', 'mistral', "
                                                    "'pythonic', ...; None: no parsing; 'auto': the one the "
                                                    "tokenizer's call markers imply (<tool_call>: hermes, "
                                                    "[TOOL_CALLS]: mistral, <|python_tag|>: llama3_json), else none. "
                                                    "Calls go to CompletionOutput.tool_calls.", OUTPUT)

    def problems(self) -> list[str]:
        """A parser name that is neither 'auto', None nor a known one (the known names are
        read from the parsers' registries, imported here and not at this module's import)."""
        from engine.reasoning import REASONING_FORMATS
        from engine.tool_parsers import TOOL_CALL_PARSERS

        problems = []
        for name, known in (("reasoning_parser", REASONING_FORMATS), ("tool_call_parser", TOOL_CALL_PARSERS)):
            value = getattr(self, name)
            if value not in (None, "auto", *known):
                problems.append(f"{name} must be 'auto', None or one of {sorted(known)}, got {value!r}")
        return problems
