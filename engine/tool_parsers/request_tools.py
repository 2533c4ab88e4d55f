"""The tools a request declares, as the call formats that depend on them read them.

A chat's `tools` (`LLM.chat(tools=...)`, a batch line's `tools`) reach the tool parser with
the request (`render_chat` puts them in the prompt, the engine keeps them on the sequence):
qwen3_coder converts each parameter's text by its JSON schema, kimi_k2 tells which function
a call numbered only by a counter calls. A completion of a plain prompt has none.
"""

from dataclasses import dataclass
from typing import Any

# OpenAI's function tools: [{"type": "function", "function": {"name": ..., "parameters": {JSON
# schema}}}] (the Responses API's flat {"type": "function", "name": ..., "parameters": ...}
# reads the same); None: the request declared none.
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class RequestTools:
    """What a chat request says of tools, as the engine's end-of-completion parse reads it:
    the `tools` it declared, and whether the engine's tool parser reads the answer's calls:
    under OpenAI's tool_choice "auto" only. Under "none" a call the model writes anyway stays
    in the text, as vLLM leaves it; under a forced choice ("required", a named function) the
    entry point reads the calls from the JSON its grammar made (`engine.entrypoints.tool_choice`)."""

    tools: Tools = None
    read_calls: bool = True

    @classmethod
    def of_prompt(cls, prompt: object) -> "RequestTools | None":
        """The record a prompt dict carries (`render_chat`'s "tools" and "tool_choice" keys),
        None for a prompt without either (the tool parser reads its calls, without tools)."""
        if not isinstance(prompt, dict) or ("tools" not in prompt and "tool_choice" not in prompt):
            return None
        return cls(prompt.get("tools"), prompt.get("tool_choice", "auto") == "auto")


def parameter_schemas(tools: Tools) -> dict[str, dict[str, Any]]:
    """Each declared function's parameter schemas by parameter name (its `parameters`'
    "properties"; {} when it gives none), by function name, the first of a repeated name
    winning. Entries of another shape are skipped: the tools come from users."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found.setdefault(name, properties if isinstance(properties, dict) else {})
    return found
