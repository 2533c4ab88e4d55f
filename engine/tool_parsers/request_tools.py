"""The tools a request declares, as the call formats that depend on them read them.

A chat's `tools` (`LLM.chat(tools=...)`, a batch line's `tools`) reach the tool parser with
the request (`render_chat` puts them in the prompt, the engine keeps them on the sequence):
qwen3_coder converts each parameter's text by its JSON schema, kimi_k2 tells which function
a call numbered only by a counter calls. A completion of a plain prompt has none.
"""

from typing import Any

# OpenAI's function tools: [{"type": "function", "function": {"name": ..., "parameters": {JSON
# schema}}}] (the Responses API's flat {"type": "function", "name": ..., "parameters": ...}
# reads the same); None: the request declared none.
Tools = list[dict[str, Any]] | None


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
