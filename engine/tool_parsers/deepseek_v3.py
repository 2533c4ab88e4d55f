"""DeepSeek V3 (and R1) calls, each between its own markers inside a section of calls, its
type and name, then its arguments in a JSON code fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The section is read as `deepseek_v31` reads it. V3.1's calls (`name<｜tool▁sep｜>{...}`, no
type, no fence) read here too: the two forms cannot be taken for each other (V3's starts with
its type), so a V3.1 model run with `deepseek_v3` keeps its calls.
"""

import re

from engine.tool_parsers.abstract import MalformedCall, WrittenCall, quoted
from engine.tool_parsers.deepseek_v31 import SEP, DeepSeekV31ToolParser, v31_call

# The arguments in a code fence, ```json or bare.
_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)


class DeepSeekV3ToolParser(DeepSeekV31ToolParser):
    """DeepSeek's section of calls, each call `function<｜tool▁sep｜>name` then its fenced
    arguments (or V3.1's `name<｜tool▁sep｜>{...}`)."""

    name = "deepseek_v3"

    def read_call(self, body: str, index: int) -> WrittenCall:
        head, sep, rest = body.partition(SEP)
        if not sep:
            raise MalformedCall(index, f"expected type{SEP}name or name{SEP}arguments, got {quoted(body)}")
        if head.strip() != "function":
            return v31_call(body, index)
        name, _, arguments = rest.strip().partition("\n")
        arguments = arguments.strip()
        if (fenced := _FENCE.match(arguments)) is not None:
            arguments = fenced.group(1)
        return WrittenCall(name, arguments)
