"""OpenAI request bodies turned into engine inputs and engine outputs into response bodies, as
vLLM's `serving_chat.py`, `serving_completion.py` and `serving_embedding.py` do for its server: each
body field checked against the fields a url reads (`KNOWN_FIELDS`, `NO_OP_FIELDS`, `IGNORED_FIELDS`),
a body made into prompts and SamplingParams or its `LineError` (`generation_request`,
`embedding_request`), an engine's problem with a prompt named by its body field (`prompt_error`),
and the engine's outputs made into the chat, completion and embedding response bodies.

These functions take and give plain dicts, so that a Dagster asset runs them on a table of request
bodies and `engine.entrypoints.openai.batch` on a file's lines. Importing this module loads neither
torch nor the model code.
"""

import base64
import json
import re
import struct
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from engine.entrypoints.chat_utils import chat_messages_problem, invalid_unicode_problem, render_chat
from engine.entrypoints.openai.protocol import (
    CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, INVALID_REQUEST, PROMPT_FIELDS, UNSUPPORTED_FIELD, URLS,
    EmbeddingRequest, GenerationRequest, LineError, field_label, shown_value,
)
from engine.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput, ToolCall
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from engine.entrypoints.tool_choice import (
    FUNCTION, ToolChoice, ToolChoiceError, apply_tool_choice, constrained, grammar_problem, resolve_tool_choice,
)
from engine.tool_parsers.abstract import OPENAI_CALL_IDS, CallIds

if TYPE_CHECKING:
    from engine.entrypoints.llm import LLM

# OpenAI's log-probability for tokens the model rules out: JSON has no -Infinity (vLLM's choice).
MIN_LOGPROB = -9999.0

# Documented by OpenAI but meaningless offline: accepted and ignored, whatever their value, on every url.
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "stream_options", "parallel_tool_calls",
                            "prompt_cache_key", "safety_identifier"})


@dataclass(frozen=True)
class NoOpField:
    """A documented field this runner takes only at the values that change nothing here
    (null always among them): on `urls` those are accepted and ignored, any other value is
    an error that gives `reason` and the fix; on other urls the field is not a field."""

    values: tuple[Any, ...]
    reason: str
    urls: tuple[str, ...] = URLS

    def takes(self, value: Any) -> bool:
        """Whether `value` is one of the no-op values, of the same JSON type (`0` is not `false`)."""
        return value is None or any(type(value) is type(v) and value == v for v in self.values)

    def problem(self, name: str, value: Any) -> LineError:
        """The error of a body whose field holds another value: unsupported_field where it
        is a value of the field's type, invalid_request where it is not even that."""
        taken = " or ".join(json.dumps(v) for v in self.values)
        fix = f"drop {name}" + (f" or set it to {taken}" if taken else "")
        if any(type(value) is type(v) for v in self.values) or not self.values:
            return LineError(UNSUPPORTED_FIELD, f"{name}: {shown_value(value)} is not supported ({self.reason}): {fix}")
        return LineError(INVALID_REQUEST,
                         f"{name}: must be {taken} here ({self.reason}), got {shown_value(value)}: {fix}")


# The one declaration of the documented fields taken only at their no-op values (docs/openai-batch.md's table
# derives from it, tests/engine/test_run_batch.py checks). OpenAI defines stream on chat and completions, echo,
# best_of and suffix on completions, modalities on chat; clients send their defaults everywhere, and vLLM's server
# ignores a field its request lacks, so those four are taken on every url.
NO_OP_FIELDS: dict[str, NoOpField] = {
    "stream": NoOpField((False,), "a batch writes whole responses"),
    "echo": NoOpField((False,), "the prompt is not repeated in the output; it is in the input file"),
    "best_of": NoOpField((1,), "each choice is one completion: ask for n completions with logprobs and keep the best"),
    "modalities": NoOpField((["text"],), "the output is text only"),
    "suffix": NoOpField(("",), "text after the insertion point is not implemented", (COMPLETIONS_URL,)),
    "audio": NoOpField((), "the output is text only", (CHAT_URL,)),
    "prediction": NoOpField((), "predicted outputs are not implemented", (CHAT_URL,)),
    "web_search_options": NoOpField((), "there is no web search offline", (CHAT_URL,)),
    "functions": NoOpField((), "the deprecated form of tools: give them as tools", (CHAT_URL,)),
    "function_call": NoOpField((), "the deprecated form of tool_choice, with functions: give tools", (CHAT_URL,)),
}

# Body fields that are SamplingParams fields of the same name: OpenAI's, then vLLM's extra ones.
SAMPLING_FIELDS = ("temperature", "top_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
                   "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
                   "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "bad_words",
                   "allowed_token_ids")
# A SamplingParams problem, "temperature must be ...", to be written as the body's "temperature: must be ...".
_SAMPLING_PROBLEM = re.compile(r"(^|; )(%s) must" % "|".join(f.name for f in fields(SamplingParams)))
# Where a body constrains its output: OpenAI's response_format, vLLM's structured_outputs and guided_* fields.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)

_GENERATION_FIELDS = frozenset({"model", "max_tokens", "priority", *SAMPLING_FIELDS, *STRUCTURED_FIELDS})
# The fields each url reads, besides IGNORED_FIELDS and the NO_OP_FIELDS it takes.
KNOWN_FIELDS: dict[str, frozenset[str]] = {
    CHAT_URL: _GENERATION_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                    "chat_template", "chat_template_kwargs", "add_generation_prompt",
                                    "continue_final_message", "reasoning_effort", "tool_choice"},
    COMPLETIONS_URL: _GENERATION_FIELDS | {"prompt", "logprobs"},
    EMBEDDINGS_URL: frozenset({"model", "input", "encoding_format", "dimensions"}),
}


class _BodyError(Exception):
    """Raised inside the body checks; the public functions return its `error`."""

    def __init__(self, name: str | None, reason: str, code: str = INVALID_REQUEST) -> None:
        super().__init__(reason)
        self.error = LineError(code, reason if name is None else f"{name}: {reason}")


class _LineFailure(_BodyError):
    """A _BodyError whose LineError is already made."""

    def __init__(self, error: LineError) -> None:
        Exception.__init__(self, error.message)
        self.error = error


# ---------------------------------------------------------------------------------------------
# Request bodies -> engine inputs


def generation_request(url: str, body: Mapping[str, Any], tokenizer: Any,
                       defaults: Mapping[str, Any] | None = None,
                       compile_problem: Callable[[StructuredOutputsParams], str | None] | None = None
                       ) -> GenerationRequest | LineError:
    """A /v1/chat/completions or /v1/completions body as engine inputs, or its error.

    `tokenizer` renders a chat's conversation (`LLM.get_tokenizer()`); `defaults` are the
    model's sampling defaults (`model_sampling_defaults`), which the body's fields override;
    `compile_problem` (`LLM.structured_output_problem`) checks the grammar of a forced
    tool_choice, so that a tool schema the engine cannot compile is named in the line's error.
    """
    choice = ToolChoice()
    try:
        _check_fields(url, body)
        if url == CHAT_URL:
            choice = _tool_choice(body, compile_problem)
            prompts = [_chat_prompt(body, tokenizer, choice)]
            logprobs, max_tokens = _chat_logprobs(body), first_set(body, "max_completion_tokens", "max_tokens")
        else:
            prompts = _completion_prompts(body.get("prompt"))
            logprobs, max_tokens = _completion_logprobs(body), body.get("max_tokens", 16)  # OpenAI's default
        params = _sampling_params(body, defaults, max_tokens, logprobs)
        params = constrained(params, choice, " and ".join(_constraint_fields(body)))
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise _BodyError("priority", f"must be an integer (lower runs first), got {priority!r}")
    except ToolChoiceError as exc:
        return LineError(INVALID_REQUEST, str(exc))
    except _BodyError as exc:
        return exc.error
    return GenerationRequest(url, prompts, params, priority, choice)


def embedding_request(body: Mapping[str, Any], hidden_size: int | None = None) -> EmbeddingRequest | LineError:
    """A /v1/embeddings body as engine inputs, or its error. `hidden_size` is the embedding
    model's width, which `dimensions` must equal (None: not checked)."""
    try:
        _check_fields(EMBEDDINGS_URL, body)
        prompts = _embedding_prompts(body.get("input"))
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise _BodyError("encoding_format", f"must be 'float' or 'base64', got {encoding!r}")
        dimensions = body.get("dimensions")
        if dimensions is not None and hidden_size is not None and dimensions != hidden_size:
            raise _BodyError("dimensions", f"this model's embeddings have {hidden_size} dimensions and are not "
                                           f"shortened: drop dimensions or set it to {hidden_size}", UNSUPPORTED_FIELD)
    except _BodyError as exc:
        return exc.error
    return EmbeddingRequest(prompts, encoding)


def model_sampling_defaults(llm: "LLM") -> dict[str, Any]:
    """The sampling settings the model's generation_config.json sets (temperature, top_p,
    ...), which vLLM's OpenAI server applies to requests that leave them unset."""
    model, base = llm.get_default_sampling_params(), SamplingParams()
    return {f.name: getattr(model, f.name) for f in fields(SamplingParams)
            if getattr(model, f.name) != getattr(base, f.name)}


def _check_fields(url: str, body: Mapping[str, Any]) -> None:
    """Refuses fields no API of `url` has, those it cannot honour, and a model that is not a name."""
    no_op = {name: field for name, field in NO_OP_FIELDS.items() if url in field.urls}
    unknown = sorted(set(body) - KNOWN_FIELDS[url] - IGNORED_FIELDS - set(no_op), key=str)
    if unknown:
        raise _BodyError(", ".join(map(field_label, unknown)), f"not a field of {url} (OpenAI's or vLLM's): remove "
                                                               "it or fix its spelling")
    for name, field in no_op.items():
        if name in body and not field.takes(body[name]):
            raise _LineFailure(field.problem(name, body[name]))
    for name in [name for name in body if name not in IGNORED_FIELDS]:
        if (found := _lone_surrogate(body[name])) is not None:  # no text it reaches could encode it
            raise _BodyError(None, invalid_unicode_problem(found[1], name + found[0]))
    if not isinstance(body.get("model", ""), str):
        raise _BodyError("model", f"must be a string, got {body['model']!r}")


def _lone_surrogate(value: Any) -> tuple[str, str] | None:
    """The first text in a body value (a string, or a key or value within its lists and
    objects) that holds a lone surrogate: where it is ("[0].content", "" for the value
    itself, a key's own place for a key) and the text; None when there is none."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and invalid_unicode_problem(item) is not None:
            return path, item
        if isinstance(item, dict):
            bad_key = next((k for k in item if isinstance(k, str) and invalid_unicode_problem(k) is not None), None)
            if bad_key is not None:
                return f"{path}.{field_label(bad_key)}", bad_key
            stack.extend((v, f"{path}.{field_label(k)}") for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def _sampling_params(body: Mapping[str, Any], defaults: Mapping[str, Any] | None, max_tokens: Any,
                     logprobs: int | None) -> SamplingParams:
    values = {**(defaults or {}), **{name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}}
    if max_tokens is not None or "max_tokens" not in values:
        values["max_tokens"] = max_tokens
    values.update(logprobs=logprobs, structured_outputs=_structured_outputs(body))
    try:
        return SamplingParams.from_optional(**values)
    except ValueError as exc:  # VLLMValidationError, ParameterTypeError included; each problem names its field
        problems = str(exc).removeprefix("Invalid SamplingParams: ")
        raise _BodyError(None, _SAMPLING_PROBLEM.sub(r"\1\2: must", problems)) from exc


def first_set(body: Mapping[str, Any], *names: str) -> Any:
    """The value of the first of `names` that `body` holds and is not null (None: none is)."""
    return next((body[name] for name in names if body.get(name) is not None), None)


def _constraint_fields(body: Mapping[str, Any]) -> list[str]:
    """The body's fields that constrain its output (a response_format of type text does not)."""
    response_format = body.get("response_format")
    text = isinstance(response_format, dict) and response_format.get("type") == "text"
    return [name for name in STRUCTURED_FIELDS
            if body.get(name) is not None and not (name == "response_format" and text)]


def _structured_outputs(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The one output constraint the body gives, from whichever field gives it."""
    given = _constraint_fields(body)
    if not given:
        return None
    if len(given) > 1:
        raise _BodyError(given[0], f"the body constrains its output with {', '.join(given)}: keep one")
    name = given[0]
    response_format = body.get("response_format")
    try:
        if name == "response_format":
            return _response_format(response_format)
        if name == "structured_outputs":
            if not isinstance(body[name], dict):
                raise _BodyError(name, f"expected an object such as {{'json': schema}}, got {body[name]!r:.80}")
            if unknown := sorted(set(body[name]) - {f.name for f in fields(StructuredOutputsParams)}, key=str):
                raise _BodyError(f"{name}.{field_label(unknown[0])}", "not a key of structured_outputs: give one of "
                                 "json, regex, choice, grammar, json_object (and disable_any_whitespace)")
            return StructuredOutputsParams(**body[name])
        return StructuredOutputsParams(**{GUIDED_FIELDS[name]: body[name]})
    except (TypeError, ValueError) as exc:  # an unknown key, or a constraint of the wrong form
        raise _BodyError(*_nested_problem(name, str(exc).removeprefix("Invalid StructuredOutputsParams: "))) from exc


def _nested_problem(name: str, problem: str) -> tuple[str, str]:
    """A StructuredOutputsParams problem ("json: reason") as the body's field and reason:
    `structured_outputs.json` for a key of structured_outputs, the guided_* field itself
    for its own kind (its key is not the body's: "guided_json: json: ..." would name it twice)."""
    key, sep, reason = problem.partition(": ")
    if not sep or " " in key:
        return name, problem
    if name in GUIDED_FIELDS:
        return name, reason if key == GUIDED_FIELDS[name] else problem
    return f"{name}.{key}", reason


def _response_format(value: Any) -> StructuredOutputsParams:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = value.get("json_schema") if kind == "json_schema" else None
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise _BodyError("response_format", "expected {'type': 'text'}, {'type': 'json_object'} or {'type': "
                                            f"'json_schema', 'json_schema': {{'name': ..., 'schema': {{...}}}}}}, "
                                            f"got {value!r:.200}")
    return StructuredOutputsParams(json=schema["schema"])


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """The number of top logprobs per token a chat body asks for (None: no logprobs)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise _BodyError("logprobs", f"must be true or false in a chat (top_logprobs gives the count), got {wanted!r}")
    if top is not None and not wanted:
        raise _BodyError("top_logprobs", "needs logprobs: true: set it, or drop top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
        raise _BodyError("top_logprobs", f"must be a non-negative integer, got {top!r}")
    return (top or 0) if wanted else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    value = body.get("logprobs")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise _BodyError("logprobs", f"must be a non-negative integer (the top logprobs per token), got {value!r}")
    return value


def _chat_prompt(body: Mapping[str, Any], tokenizer: Any, choice: ToolChoice) -> dict[str, Any]:
    """The body's conversation rendered with the model's chat template (or the body's own),
    under its checked tool choice."""
    messages = _template_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _BodyError("chat_template_kwargs", f"expected an object of template variables, got {kwargs!r:.80}")
    if body.get("reasoning_effort") is not None:  # templates that read it (gpt-oss's) take it as a variable
        kwargs = {"reasoning_effort": body["reasoning_effort"], **kwargs}
    flags = {name: body.get(name, default) for name, default in
             (("add_generation_prompt", True), ("continue_final_message", False))}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise _BodyError(name, f"must be true or false, got {value!r}")
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise _BodyError("continue_final_message", "needs add_generation_prompt: false (the last message is "
                                                   "continued, not answered): set it")
    template, tools = body.get("chat_template"), _tools(body.get("tools"))
    if template is not None and not isinstance(template, str):
        raise _BodyError("chat_template", f"must be a Jinja template string, got {type(template).__name__}")
    try:
        return render_chat(tokenizer, messages, chat_template=template, tools=tools, chat_template_kwargs=kwargs,
                           tool_choice=choice.mode, **flags)
    except Exception as exc:  # the chat template is the model's program: whatever it raises is this line's
        raise _BodyError("messages", f"the chat template cannot render this conversation ({type(exc).__name__}: "
                                     f"{exc}): fix the messages, or give a chat_template") from exc


def _template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates read them: an assistant message that only calls
    tools has content "" (not null), and each call's arguments are an object, not JSON text."""
    if isinstance(messages, list):
        messages = [_template_message(m) if isinstance(m, dict) and isinstance(m.get("tool_calls"), list) else m
                    for m in messages]
    if (problem := chat_messages_problem(messages)) is not None:
        raise _BodyError("messages", problem)
    return messages


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
            except ValueError:
                pass  # left as the text it is
        calls.append(call)
    return {**message, "content": "" if message.get("content") is None else message["content"], "tool_calls": calls}


def _tool_choice(body: Mapping[str, Any],
                 compile_problem: Callable[[StructuredOutputsParams], str | None] | None) -> ToolChoice:
    """The body's tool_choice checked against its tools (and, given `compile_problem`, its
    grammar against the engine)."""
    choice = resolve_tool_choice(body.get("tool_choice"), _tools(body.get("tools")))
    if compile_problem is not None and (problem := grammar_problem(choice, compile_problem)) is not None:
        raise _BodyError(None, problem)
    return choice


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise _BodyError("tools", "expected a list of {'type': 'function', 'function': {'name': str, "
                                  f"'description': str, 'parameters': {{...}}}}}}, got {tools!r:.200}")
    return tools


def _completion_prompts(prompt: Any) -> list[dict[str, Any]]:
    """A completion's prompt: a string, token ids, or a list of either (one prompt each)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if _is_token_ids(prompt):
        return [{"prompt_token_ids": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if isinstance(prompt, list) and prompt and all(_is_token_ids(p) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise _BodyError("prompt", "expected a string, a list of strings, a list of token ids or a list of lists of "
                               f"token ids, got {prompt!r:.80}")


def _embedding_prompts(value: Any) -> list[str | dict[str, Any]]:
    """An embeddings input: a string, token ids, or a list of either (one vector each)."""
    if isinstance(value, str):
        return [value]
    if _is_token_ids(value):
        return [{"prompt_token_ids": value}]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(_is_token_ids(v) for v in value):
        return [{"prompt_token_ids": v} for v in value]
    raise _BodyError("input", "expected a string, a list of strings, a list of token ids or a list of lists of "
                              f"token ids, got {value!r:.80}")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


# ---------------------------------------------------------------------------------------------
# Engine outputs -> response bodies


def generation_response_body(request: GenerationRequest, outputs: list[RequestOutput], model: str,
                             tokenizer: Any = None, call_ids: CallIds = OPENAI_CALL_IDS) -> dict[str, Any]:
    """The OpenAI response body of a chat or completion request from its prompts' outputs
    (in the order of `request.prompts`); `model` is the name the body reports. A forced
    tool_choice's calls are read from the outputs with `tokenizer` (`LLM.get_tokenizer()`,
    which such a request needs), their ids in the style `call_ids` (`LLM.tool_call_ids`)."""
    if request.url == CHAT_URL:
        choice = request.tool_choice
        if choice.forced:
            if tokenizer is None:
                raise ValueError(f"generation_response_body: tool_choice {choice.described} needs the tokenizer to "
                                 "read its calls: pass tokenizer=llm.get_tokenizer()")
            apply_tool_choice(outputs[0], choice, tokenizer, call_ids)
        return chat_completion_body(outputs[0], model, request.sampling_params.logprobs, choice)
    return text_completion_body(outputs, model, request.sampling_params.logprobs)


def chat_completion_body(output: RequestOutput, model: str, top_logprobs: int | None = None,
                         tool_choice: ToolChoice = ToolChoice()) -> dict[str, Any]:
    """A chat.completion object: one choice per completion, with its tool calls, reasoning
    and logprobs (each token's and its `top_logprobs` most likely ones)."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [_chat_choice(c, top_logprobs, tool_choice) for c in output.outputs],
            "usage": _usage(len(output.prompt_token_ids), output.outputs)}


def text_completion_body(outputs: list[RequestOutput], model: str, top_logprobs: int | None = None) -> dict[str, Any]:
    """A text_completion object: the completions of every prompt, prompt i's j-th at index i * n + j."""
    choices = [{"index": i * len(output.outputs) + c.index, "text": c.text,
                "logprobs": _completion_logprobs_body(c, top_logprobs), "finish_reason": c.finish_reason}
               for i, output in enumerate(outputs) for c in output.outputs]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": _usage(sum(len(o.prompt_token_ids) for o in outputs), [c for o in outputs for c in o.outputs])}


def embedding_response_body(request: EmbeddingRequest, outputs: list[EmbeddingRequestOutput],
                            model: str) -> dict[str, Any]:
    """An embeddings list: one vector per input, as floats or as base64 of little-endian float32."""
    data = [{"object": "embedding", "index": i, "embedding": _encoded(o.outputs.embedding, request.encoding_format)}
            for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _usage(prompt_tokens: int, completions: list[CompletionOutput]) -> dict[str, Any]:
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated,
            "completion_tokens_details": {"reasoning_tokens": sum(c.num_reasoning_tokens for c in completions)}}


def _chat_choice(completion: CompletionOutput, top_logprobs: int | None, tool_choice: ToolChoice) -> dict[str, Any]:
    """One choice: its message (vLLM's `reasoning` beside OpenAI's fields) and finish_reason,
    "tool_calls" where the model called tools but for a named tool_choice ("stop", as OpenAI
    and vLLM answer a call they forced by name)."""
    calls = [_tool_call(call) for call in completion.tool_calls or []]
    message: dict[str, Any] = {"role": "assistant", "content": completion.text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if completion.reasoning is not None:
        message["reasoning"] = completion.reasoning
    called = bool(calls) and tool_choice.mode != FUNCTION
    return {"index": completion.index, "message": message, "logprobs": _chat_logprobs_body(completion, top_logprobs),
            "finish_reason": "tool_calls" if called else completion.finish_reason}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": call.function.arguments}}


def _chat_logprobs_body(completion: CompletionOutput, top: int | None) -> dict[str, Any] | None:
    if completion.logprobs is None or top is None:
        return None
    content = [{**_token_logprob(candidates[token_id]),
                "top_logprobs": [_token_logprob(lp) for lp in _top_ranked(candidates, top)]}
               for token_id, candidates in zip(completion.token_ids, completion.logprobs)]
    return {"content": content, "refusal": None}


def _completion_logprobs_body(completion: CompletionOutput, top: int | None) -> dict[str, Any] | None:
    """The legacy completions shape: tokens, their logprobs, the top ones of each step
    (the sampled token among them, as vLLM's) and each token's offset in the text."""
    if completion.logprobs is None or top is None:
        return None
    tokens, offsets, offset = [], [], 0
    for token_id, candidates in zip(completion.token_ids, completion.logprobs):
        tokens.append(candidates[token_id].decoded_token or "")
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens,
            "token_logprobs": [_clamped(c[t].logprob) for t, c in zip(completion.token_ids, completion.logprobs)],
            "top_logprobs": [{lp.decoded_token or "": _clamped(lp.logprob)
                              for lp in [*_top_ranked(candidates, top), candidates[token_id]]}
                             for token_id, candidates in zip(completion.token_ids, completion.logprobs)],
            "text_offset": offsets}


def _top_ranked(candidates: dict[int, Logprob], top: int) -> list[Logprob]:
    ranked = sorted((lp for lp in candidates.values() if lp.rank is not None and lp.rank <= top),
                    key=lambda lp: lp.rank)
    return ranked[:top]


def _token_logprob(logprob: Logprob) -> dict[str, Any]:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": _clamped(logprob.logprob), "bytes": list(token.encode("utf-8"))}


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def prompt_error(url: str, index: int, count: int, problem: str, body: Mapping[str, Any] | None = None) -> LineError:
    """The engine's problem with prompt `index` of a line's `count` prompts (`LLM.validate`'s
    "prompt: reason") as the line's error, naming the body field that holds the prompt once:
    "prompt[1]: is empty", "messages: has 600 tokens", "input: ..."; other fields' problems
    keep their own name ("max_tokens: ..."), after the prompt's index when there are several;
    a constraint's problem names the `body` field that gave it (guided_regex, response_format...)."""
    where = PROMPT_FIELDS[url] + (f"[{index}]" if count > 1 else "")
    for name in ("prompt: ", "prompt_token_ids: "):
        if problem.startswith(name):
            return LineError(INVALID_REQUEST, f"{where}: {problem.removeprefix(name)}")
    given = [name for name in STRUCTURED_FIELDS if (body or {}).get(name) is not None]
    if problem.startswith("structured_outputs: ") and len(given) == 1:
        problem = given[0] + problem.removeprefix("structured_outputs")
    return LineError(INVALID_REQUEST, f"{where}: {problem}" if count > 1 else problem)
