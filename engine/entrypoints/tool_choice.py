"""OpenAI's `tool_choice`, as vLLM's server serves it: "auto" (the model decides, the tool
parser reads its calls), "none" (no call is asked for: one the model writes anyway stays in
the text, as vLLM leaves it), "required" (at least one call) and a
named function (`{"type": "function", "function": {"name": ...}}`: exactly one call of it).

A forced choice (required or named) is made exact by a structured output (`grammar`): for
a named function its parameters' JSON schema, the whole answer being the arguments; for
"required" a non-empty JSON array of `{"name": <a tool's name>, "parameters": <its
arguments>}` items. The grammar applies once the reasoning ends (`ReasoningTracker`), and
`apply_tool_choice` reads the calls from what it made. `LLM.chat`, the OpenAI batch runner
and the Dagster assets all go through these functions.
"""

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from engine.tool_parsers.abstract import OPENAI_CALL_IDS, CallIds, MalformedCall, json_value, tool_call

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

AUTO, NONE, REQUIRED, FUNCTION = "auto", "none", "required", "function"
_NAMED_EXAMPLE = '{"type": "function", "function": {"name": "get_weather"}}'
# A tool without parameters takes none (OpenAI's default, as vLLM reads it).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    """A tool choice that cannot run with its tools; the message starts with the field
    ("tool_choice: ...", "tools[1].function.parameters: ...") and says the fix."""


@dataclass(frozen=True)
class ToolChoice:
    """A checked tool choice: `mode` is AUTO, NONE, REQUIRED or FUNCTION (`name` the
    function's), `tools` the OpenAI function tools it chooses among (None: no tools)."""

    mode: str = AUTO
    name: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None

    @property
    def forced(self) -> bool:
        """Whether the answer must be tool calls (required, or a named function)."""
        return self.mode in (REQUIRED, FUNCTION)

    @property
    def described(self) -> str:
        """The choice as a message quotes it."""
        return f"{{'function': {{'name': {self.name!r}}}}}" if self.mode == FUNCTION else repr(self.mode)

    def grammar(self) -> StructuredOutputsParams | None:
        """The structured output that makes a forced choice exact (None for auto and none).
        Its JSON has no free whitespace: a small model cannot pad it, and the arguments are
        written compact anyway.

        Raises:
            ToolChoiceError: two tools define one `$defs` name differently (the array's
                items share one `$defs`).
        """
        if not self.forced:
            return None
        if self.mode == FUNCTION:
            schema = _parameters(self.tools[self.index(self.name)])
        else:
            schema = _calls_schema(self.tools)
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    @property
    def callable_tools(self) -> list[int]:
        """The positions of the tools a forced choice may call: every tool under "required",
        the named one's otherwise (assumes a forced choice)."""
        return list(range(len(self.tools))) if self.mode == REQUIRED else [self.index(self.name)]

    def index(self, name: str) -> int:
        """The position of the tool called `name` (assumes it is one of `tools`)."""
        return next(i for i, tool in enumerate(self.tools) if tool["function"]["name"] == name)


def resolve_tool_choice(value: Any, tools: Sequence[dict[str, Any]] | None) -> ToolChoice:
    """`value` (OpenAI's tool_choice; None: "auto") checked against `tools` (a list of
    OpenAI function tools, each with a string name; None or []: no tools).

    Raises:
        ToolChoiceError: not a tool choice, a forced choice without tools, a name that is
            none of the tools', or a tool whose parameters are not a JSON schema object.
    """
    tools = tuple(tools) if tools else None
    if value is None or value == AUTO:
        return ToolChoice(AUTO, tools=tools)
    if value == NONE:
        return ToolChoice(NONE, tools=tools)
    if value == REQUIRED:
        choice = ToolChoice(REQUIRED, tools=tools)
    elif isinstance(value, dict) and value.get("type", FUNCTION) == FUNCTION and isinstance(value.get("function"), dict):
        choice = ToolChoice(FUNCTION, _function_name(value["function"]), tools)
    else:
        raise ToolChoiceError(f"tool_choice: must be 'auto', 'none', 'required' or a named function {_NAMED_EXAMPLE}, "
                              f"got {json.dumps(value, default=repr)[:80]}")
    if tools is None:
        raise ToolChoiceError(f"tool_choice: {choice.described} needs tools to call: give tools, or drop tool_choice")
    names = _tool_names(tools)
    if choice.mode == FUNCTION and choice.name not in names:
        raise ToolChoiceError(f"tool_choice.function.name: {choice.name!r} is none of the tools "
                              f"({', '.join(map(repr, names))}): name one of them, or add its tool")
    for i in choice.callable_tools:
        parameters = tools[i]["function"].get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters: must be a JSON schema (an object) for "
                                  f"tool_choice {choice.described}, got {type(parameters).__name__}")
    choice.grammar()  # a $defs clash is the request's problem, found before anything runs
    return choice


def _tool_names(tools: Sequence[Any]) -> list[str]:
    """The tools' function names.

    Raises:
        ToolChoiceError: a tool that is not {"type": "function", "function": {"name": str, ...}}.
    """
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolChoiceError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, "
                                  f"'parameters': {{...}}}}}}, got {json.dumps(tool, default=repr)[:80]}")
        names.append(function["name"])
    return names


def _function_name(function: dict[str, Any]) -> str:
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolChoiceError(f"tool_choice.function.name: give the name of the function to call, as in "
                              f"{_NAMED_EXAMPLE}, got {json.dumps(name, default=repr)[:80]}")
    return name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _NO_PARAMETERS


def _calls_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of a non-empty array of calls of `tools`: each item one tool's name
    and parameters; the tools' `$defs` gathered at the top, where their `$ref`s point."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        parameters = copy.deepcopy(_parameters(tool))
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise ToolChoiceError(f"tools[{i}].function.parameters.$defs.{name}: an earlier tool defines "
                                      f"{name!r} otherwise, and tool_choice 'required' puts every tool's $defs "
                                      "in one schema: rename one of them")
            defs[name] = definition
        items.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def grammar_problem(choice: ToolChoice, compile_problem: Callable[[StructuredOutputsParams], str | None]
                    ) -> str | None:
    """Why the engine cannot run a forced choice's grammar (`compile_problem`: the engine's
    check of a constraint, `LLM.structured_output_problem`), naming the first tool whose
    parameters do not compile on their own; None when it compiles (or nothing is forced)."""
    grammar = choice.grammar()
    if grammar is None or (problem := compile_problem(grammar)) is None:
        return None
    for i in choice.callable_tools:
        own = compile_problem(StructuredOutputsParams(json=_parameters(choice.tools[i]), disable_any_whitespace=True))
        if own is not None:
            return (f"tools[{i}].function.parameters: {own.removeprefix('the json constraint ')}: tool_choice "
                    f"{choice.described} constrains the answer to it; fix the schema, or use tool_choice 'auto'")
    return (f"tool_choice: {problem.removeprefix('the json constraint ')} (the schema of the calls of "
            f"{choice.described}): use tool_choice 'auto'")


def constrained(params: SamplingParams, choice: ToolChoice, where: str = "sampling_params") -> SamplingParams:
    """`params` with a forced choice's grammar as their structured output (`params` itself
    when nothing is forced).

    Raises:
        ToolChoiceError: `params` constrain the output already (`where` names them): a
            forced call and another constraint cannot both hold.
    """
    if not choice.forced:
        return params
    if params.structured_outputs is not None:
        raise ToolChoiceError(f"tool_choice: {choice.described} makes the answer tool calls, and {where} also "
                              f"constrains it ({params.structured_outputs.kind}): keep one of them")
    return dataclasses.replace(params, structured_outputs=choice.grammar())


def apply_tool_choice(output: RequestOutput, choice: ToolChoice, tokenizer: "PreTrainedTokenizerBase",
                      call_ids: CallIds = OPENAI_CALL_IDS) -> RequestOutput:
    """The output as a forced choice makes it (in place): each completion's calls read
    from the grammar's JSON (`forced_calls`), their ids in the style `call_ids` (the engine's
    tool parser's, `LLM.tool_call_ids`). Other choices leave it as the engine made it (under
    "none" the engine's tool parser left the calls in the text: `RequestTools`)."""
    if choice.forced:
        for completion in output.outputs:
            forced_calls(completion, choice, tokenizer, call_ids)
    return output


def forced_calls(completion: CompletionOutput, choice: ToolChoice, tokenizer: "PreTrainedTokenizerBase",
                 call_ids: CallIds = OPENAI_CALL_IDS) -> None:
    """Reads a forced choice's calls from the completion's answer tokens (those after the
    reasoning, which the grammar made; the engine's tool parser may have read them
    otherwise): `tool_calls` with `text` empty, as vLLM answers; or, where the JSON does not
    parse (the completion was cut by max_tokens or a stop string), no calls, the JSON as
    `text` and the reason in `tool_call_error`. A completion whose reasoning did not end
    has no answer to read."""
    if completion.reasoning_ended is False:
        completion.tool_calls = completion.tool_call_error = None
        return
    text = tokenizer.decode(completion.token_ids[completion.num_reasoning_tokens:], skip_special_tokens=True)
    try:
        completion.tool_calls = _calls(text.strip(), choice, call_ids)
        completion.text, completion.tool_call_error = "", None
    except MalformedCall as error:
        completion.text, completion.tool_calls, completion.tool_call_error = text, None, str(error)
    except RecursionError:  # arguments nested deeper than Python's parser goes
        completion.text, completion.tool_calls = text, None
        completion.tool_call_error = "tool calls: nested too deeply to read"


def _calls(text: str, choice: ToolChoice, call_ids: CallIds) -> list:
    if choice.mode == FUNCTION:
        arguments = json_value(text, 1, "the arguments object")
        return [tool_call(text, 1, {"name": choice.name, "arguments": arguments}, call_ids)]
    calls = json_value(text, 1, "the array of calls")
    if not isinstance(calls, list) or not calls:
        raise MalformedCall(1, f"expected a non-empty JSON array of calls, got {text[:80]!r}")
    return [tool_call(text, index, call, call_ids) for index, call in enumerate(calls, 1)]
