"""OpenAI batch files run offline (`python -m engine.run_batch`): request bodies to engine
inputs and their errors, engine outputs to response bodies, resume, and the command line on
the embedded SmolLM2 with mixed good and bad lines."""

import base64
import json
import logging
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.config import engine_settings
from engine.entrypoints.openai.batch import finished_lines, run_batch_file
from engine.entrypoints.openai.protocol import (
    CHAT_URL, COMPLETIONS_URL, DUPLICATE_CUSTOM_ID, EMBEDDINGS_URL, INVALID_JSON, INVALID_LINE, INVALID_REQUEST,
    UNSUPPORTED_FIELD, UNSUPPORTED_URL, URLS, BadLine, BatchLine, EmbeddingRequest, GenerationRequest, LineError,
    parse_lines,
)
from engine.entrypoints.openai.serving import (
    IGNORED_FIELDS, NO_OP_FIELDS, embedding_request, embedding_response_body, generation_request,
    generation_response_body, prompt_error,
)
from engine.outputs import (
    CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, FunctionCall, Logprob, RequestOutput, ToolCall,
)
from engine.entrypoints.openai.run_batch import build_parser, main
from engine.tool_parsers.abstract import MISTRAL_CALL_IDS, OPENAI_CALL_IDS
from tests.openai_batch_fuzz import named_twice

ROOT = Path(__file__).resolve().parents[2]


class FakeTokenizer:
    """Renders a conversation as the JSON of what the chat template was given, one token per character."""

    def apply_chat_template(self, messages: list, tokenize: bool, chat_template: str | None, tools: Any,
                            add_generation_prompt: bool, continue_final_message: bool, **kwargs: Any) -> str:
        if chat_template == "raise":
            raise ValueError("roles must alternate")
        return json.dumps({"messages": messages, "template": chat_template, "tools": tools,
                           "add_generation_prompt": add_generation_prompt, "continue": continue_final_message,
                           "kwargs": kwargs})

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[ord(c) % 100 for c in text])


TOKENIZER = FakeTokenizer()
USER = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> GenerationRequest | LineError:
    return generation_request(CHAT_URL, {"messages": USER, **body}, TOKENIZER)


def completion(**body: Any) -> GenerationRequest | LineError:
    return generation_request(COMPLETIONS_URL, {"prompt": "Once", **body}, TOKENIZER)


def rendered(request: GenerationRequest) -> dict:
    return json.loads(request.prompts[0]["prompt"])


# --- input lines ------------------------------------------------------------------------------


def test_input_lines_are_checked_as_envelopes_and_duplicates_refused():
    good = {"custom_id": "a", "method": "POST", "url": CHAT_URL, "body": {"messages": USER}}
    raw = [json.dumps(good), "", "not json", "[1, 2]", json.dumps({**good, "custom_id": 7}),
           json.dumps({**good, "custom_id": "b", "method": "GET"}), json.dumps({**good, "custom_id": "c", "url": "/v1/x"}),
           json.dumps({**good, "custom_id": "d", "body": "text"}), json.dumps(good),
           json.dumps({**good, "custom_id": "\ud800"})]
    lines = parse_lines([line.encode("utf-8") for line in raw] + [b"\xff\xfe"])
    assert [line.number for line in lines] == [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # the blank line 2 is not a line
    assert lines[0] == BatchLine(1, "a", CHAT_URL, {"messages": USER})
    codes = [(line.custom_id, line.error.code) for line in lines[1:]]
    assert codes == [(None, INVALID_JSON), (None, INVALID_JSON), (None, INVALID_LINE), ("b", INVALID_LINE),
                     ("c", UNSUPPORTED_URL), ("d", INVALID_LINE), ("a", DUPLICATE_CUSTOM_ID), (None, INVALID_LINE),
                     (None, INVALID_JSON)]
    assert "custom_id" in lines[3].error.message and "/v1/chat/completions" in lines[5].error.message
    assert "line 1" in lines[7].error.message


# --- bodies -> engine inputs ------------------------------------------------------------------


def test_completion_body_maps_to_sampling_params():
    request = completion(temperature=0.5, top_p=0.9, n=2, seed=3, stop="\n", presence_penalty=0.1,
                         frequency_penalty=0.2, logit_bias={"5": 200}, logprobs=2, top_k=4, min_p=0.05,
                         repetition_penalty=1.1, min_tokens=1, stop_token_ids=[9], priority=2, user="u", model="x")
    params = request.sampling_params
    assert request.prompts == [{"prompt": "Once"}] and request.priority == 2
    assert (params.temperature, params.top_p, params.n, params.seed, params.stop) == (0.5, 0.9, 2, 3, ["\n"])
    assert (params.presence_penalty, params.frequency_penalty, params.logprobs) == (0.1, 0.2, 2)
    assert params.logit_bias == {5: 100.0}  # keyed by id, clipped to OpenAI's range
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (4, 0.05, 1.1, 1)
    assert params.max_tokens == 16  # OpenAI's default for completions
    assert completion(max_tokens=None).sampling_params.max_tokens is None


@pytest.mark.parametrize(("prompt", "expected"), [
    ("a", [{"prompt": "a"}]),
    (["a", "b"], [{"prompt": "a"}, {"prompt": "b"}]),
    ([1, 2], [{"prompt_token_ids": [1, 2]}]),
    ([[1], [2, 3]], [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts == expected


def test_chat_body_renders_its_own_conversation_and_options():
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    calling = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c1", "type": "function",
                               "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    messages = [*USER, calling, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    request = generation_request(CHAT_URL, {"messages": messages, "tools": [tool], "tool_choice": "auto",
                                            "chat_template_kwargs": {"enable_thinking": False},
                                            "reasoning_effort": "low", "max_tokens": 5, "max_completion_tokens": 7,
                                            "logprobs": True, "top_logprobs": 3, "parallel_tool_calls": True},
                                 TOKENIZER)
    seen = rendered(request)
    assert seen["tools"] == [tool] and seen["kwargs"] == {"reasoning_effort": "low", "enable_thinking": False}
    assert seen["messages"][1]["content"] == ""  # a message that only calls tools
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert seen["add_generation_prompt"] is True and seen["continue"] is False
    assert request.prompts[0]["prompt_token_ids"] == [ord(c) % 100 for c in request.prompts[0]["prompt"]]
    assert request.sampling_params.max_tokens == 7  # max_completion_tokens wins over max_tokens
    assert request.sampling_params.logprobs == 3
    assert chat().sampling_params.max_tokens is None  # a chat runs to the end of the context by default
    assert chat(logprobs=True).sampling_params.logprobs == 0 and chat().sampling_params.logprobs is None
    seen = rendered(chat(add_generation_prompt=False, continue_final_message=True, chat_template="T"))
    assert (seen["add_generation_prompt"], seen["continue"], seen["template"]) == (False, True, "T")


def test_model_defaults_apply_where_the_body_is_silent():
    body = {"messages": USER, "top_p": 0.5}
    params = generation_request(CHAT_URL, body, TOKENIZER, {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64})
    assert params.sampling_params.temperature == 0.2 and params.sampling_params.top_p == 0.5
    assert params.sampling_params.max_tokens == 64


@pytest.mark.parametrize(("body", "expected"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
     ("json", {"type": "object"})),
    ({"response_format": {"type": "json_object"}}, ("json_object", True)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
    ({"guided_json": {"type": "object"}}, ("json", {"type": "object"})),
])
def test_output_constraints(body, expected):
    constraint = completion(**body).sampling_params.structured_outputs
    assert (constraint.kind, getattr(constraint, constraint.kind)) == expected
    assert completion(response_format={"type": "text"}).sampling_params.structured_outputs is None


@pytest.mark.parametrize(("body", "code", "names"), [
    ({"temperature": 3}, INVALID_REQUEST, "temperature"),
    ({"n": 2, "temperature": 0}, INVALID_REQUEST, "n: must be 1"),
    ({"frobnicate": 1, "zeal": 2}, INVALID_REQUEST, "frobnicate, zeal: not a field"),
    ({"echo": True}, UNSUPPORTED_FIELD, "echo"),
    ({"suffix": "end"}, UNSUPPORTED_FIELD, "suffix"),
    ({"stream": True}, UNSUPPORTED_FIELD, "stream"),
    ({"best_of": 2}, UNSUPPORTED_FIELD, "best_of"),
    ({"prompt": {"text": "x"}}, INVALID_REQUEST, "prompt"),
    ({"logprobs": True}, INVALID_REQUEST, "logprobs"),
    ({"model": 5}, INVALID_REQUEST, "model"),
    ({"priority": "high"}, INVALID_REQUEST, "priority"),
    ({"response_format": {"type": "json_schema"}}, INVALID_REQUEST, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, INVALID_REQUEST, "keep one"),
    ({"structured_outputs": {"jsn": {}}}, INVALID_REQUEST, "structured_outputs"),
])
def test_bad_completion_bodies_name_the_field(body, code, names):
    error = completion(**body)
    assert isinstance(error, LineError) and error.code == code and names in error.message, error


@pytest.mark.parametrize(("body", "code", "names"), [
    ({"messages": []}, INVALID_REQUEST, "messages"),
    ({"messages": [{"role": "user"}]}, INVALID_REQUEST, "message 0"),
    ({"top_logprobs": 2}, INVALID_REQUEST, "top_logprobs: needs logprobs"),
    ({"logprobs": 2}, INVALID_REQUEST, "logprobs: must be true or false"),
    ({"tool_choice": "required"}, INVALID_REQUEST, "tool_choice: 'required' needs tools"),
    ({"tool_choice": "any"}, INVALID_REQUEST, "tool_choice: must be 'auto', 'none', 'required' or a named function"),
    ({"tools": [{"name": "f"}]}, INVALID_REQUEST, "tools"),
    ({"chat_template_kwargs": [1]}, INVALID_REQUEST, "chat_template_kwargs"),
    ({"continue_final_message": True}, INVALID_REQUEST, "add_generation_prompt"),
    ({"chat_template": "raise"}, INVALID_REQUEST, "ValueError: roles must alternate"),
    ({"suffix": "x"}, INVALID_REQUEST, "suffix: not a field of /v1/chat/completions"),
    ({"audio": {"voice": "alloy"}}, UNSUPPORTED_FIELD, "audio"),
])
def test_bad_chat_bodies_name_the_field(body, code, names):
    error = chat(**body)
    assert isinstance(error, LineError) and error.code == code and names in error.message, error


@pytest.mark.parametrize(("url", "body", "message"), [
    (CHAT_URL, {"messages": []},
     "messages: expected a non-empty list of messages ({'role', 'content'} dicts), got an empty list"),
    (CHAT_URL, {"messages": "hi"},
     "messages: expected a non-empty list of messages ({'role', 'content'} dicts), got str"),
    (CHAT_URL, {"messages": [{"role": "user"}]},
     "messages: message 0: expected a dict with 'role' and 'content', got {'role': 'user'}"),
    (COMPLETIONS_URL, {"prompt": "a", "guided_json": 5}, "guided_json: a JSON schema is an object, got int"),
    (COMPLETIONS_URL, {"prompt": "a", "guided_regex": ""}, "guided_regex: must be a non-empty string, got ''"),
    (COMPLETIONS_URL, {"prompt": "a", "guided_choice": []},
     "guided_choice: must be a non-empty list of non-empty strings, got []"),
    (COMPLETIONS_URL, {"prompt": "a", "structured_outputs": {"json": 5}},
     "structured_outputs.json: a JSON schema is an object, got int"),
    (COMPLETIONS_URL, {"prompt": "a", "structured_outputs": {"jsn": {}}},
     "structured_outputs.jsn: not a key of structured_outputs: give one of json, regex, choice, grammar, json_object "
     "(and disable_any_whitespace)"),
])
def test_a_bodys_error_names_its_field_once(url, body, message):
    error = generation_request(url, body, TOKENIZER)
    assert isinstance(error, LineError) and error.message == message
    assert named_twice(error.message) is None and named_twice("messages: messages: x") == "messages"


@pytest.mark.parametrize(("url", "index", "count", "problem", "message"), [
    (COMPLETIONS_URL, 1, 2, "prompt: is empty: drop the row or give it text",
     "prompt[1]: is empty: drop the row or give it text"),
    (COMPLETIONS_URL, 0, 1, "prompt_token_ids: holds ids outside the vocabulary [0, 9): fix the ids",
     "prompt: holds ids outside the vocabulary [0, 9): fix the ids"),
    (CHAT_URL, 0, 1, "prompt: has 600 tokens, but max_model_len is 512: shorten it",
     "messages: has 600 tokens, but max_model_len is 512: shorten it"),
    (EMBEDDINGS_URL, 2, 3, "prompt: is empty", "input[2]: is empty"),
    (COMPLETIONS_URL, 0, 2, "max_tokens: lower max_tokens", "prompt[0]: max_tokens: lower max_tokens"),
    (CHAT_URL, 0, 1, "logprobs: asks for 50", "logprobs: asks for 50"),
])
def test_an_engine_problem_names_the_bodys_prompt_field_once(url, index, count, problem, message):
    """The engine calls every prompt "prompt"; the line's error names the body's own field
    (messages, prompt, input), indexed where the body holds several."""
    error = prompt_error(url, index, count, problem)
    assert error == LineError(INVALID_REQUEST, message) and named_twice(error.message) is None


def body_request(url: str, **fields: Any) -> GenerationRequest | EmbeddingRequest | LineError:
    """A minimal good body of `url` with `fields` added, as engine inputs or its error."""
    if url == EMBEDDINGS_URL:
        return embedding_request({"input": "a", **fields})
    return generation_request(url, {CHAT_URL: {"messages": USER}, COMPLETIONS_URL: {"prompt": "Once"}}[url] | fields,
                              TOKENIZER)


def other_values(value: Any) -> tuple[Any, Any]:
    """A value of the same JSON type as the no-op `value` that is not it, and one of another type."""
    if value is None:  # a field taken only when null: any object is another value of its own
        return {"voice": "alloy"}, {"voice": "alloy"}
    same = {bool: True, int: 2, str: "required", list: ["text", "audio"]}[type(value)]
    return same, ("yes" if not isinstance(value, str) else 0)


@pytest.mark.parametrize(("url", "field"), [(CHAT_URL, {"best_of": 1}), (COMPLETIONS_URL, {"modalities": ["text"]}),
                                           (EMBEDDINGS_URL, {"stream": False}), (EMBEDDINGS_URL, {"echo": False})])
def test_a_clients_defaults_run_on_every_url(url, field):
    """stream: false, echo: false, best_of: 1 and modalities: ["text"] run wherever a client
    sends them, as the docs say (these were refused on the urls OpenAI does not give them)."""
    assert not isinstance(body_request(url, **field), LineError)


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("name", [*NO_OP_FIELDS, *sorted(IGNORED_FIELDS)])
def test_each_documented_field_on_each_url(url, name):
    """Every url against every field taken at its no-op values (NO_OP_FIELDS) or ignored
    whatever its value (IGNORED_FIELDS): the no-op values and null run where the field is
    taken, another value of its type is unsupported_field, one of another type invalid_request,
    and on a url that does not take it the field is unknown."""
    if name in IGNORED_FIELDS:
        for value in ("u", 7, {"a": "b"}, [1], True, None):
            assert not isinstance(body_request(url, **{name: value}), LineError), value
        return
    field = NO_OP_FIELDS[name]
    for value in (*field.values, None):
        result = body_request(url, **{name: value})
        if url in field.urls:
            assert not isinstance(result, LineError), (value, result)
        else:
            assert result == LineError(INVALID_REQUEST, f"{name}: not a field of {url} (OpenAI's or vLLM's): remove it "
                                                        "or fix its spelling")
    if url not in field.urls:
        return
    same, other = other_values(field.values[0] if field.values else None)
    refused = body_request(url, **{name: same})
    assert refused.code == UNSUPPORTED_FIELD and refused.message.startswith(f"{name}: {json.dumps(same)} is not "
                                                                            f"supported ({field.reason}): drop {name}")
    wrong_type = body_request(url, **{name: other})
    assert wrong_type.code == (INVALID_REQUEST if field.values else UNSUPPORTED_FIELD)
    assert wrong_type.message.startswith(f"{name}: ") and f"drop {name}" in wrong_type.message


@pytest.mark.parametrize(("body", "code", "message"), [
    ({"stream": 0}, INVALID_REQUEST, 'stream: must be false here (a batch writes whole responses), got 0: drop stream '
                                     'or set it to false'),
    ({"best_of": True}, INVALID_REQUEST, "best_of: must be 1 here"),
    ({"best_of": 1.0}, INVALID_REQUEST, "best_of: must be 1 here"),
    ({"best_of": 3}, UNSUPPORTED_FIELD, "best_of: 3 is not supported (each choice is one completion: ask for n "
                                        "completions with logprobs and keep the best): drop best_of or set it to 1"),
    ({"modalities": "text"}, INVALID_REQUEST, 'modalities: must be ["text"] here'),
    ({"modalities": ["text", "audio"]}, UNSUPPORTED_FIELD, 'modalities: ["text", "audio"] is not supported'),
    ({"echo": "\ud800"}, INVALID_REQUEST, 'echo: must be false here (the prompt is not repeated in the output; it is '
                                         'in the input file), got "\\ud800": drop echo'),
])
def test_a_no_op_field_is_taken_at_its_value_and_type_only(body, code, message):
    """JSON's types are kept apart (0 is not false, true not 1), as a typed OpenAI client would;
    the value is quoted as JSON, a lone surrogate escaped (the error is written to a UTF-8 file)."""
    error = completion(**body)
    assert error.code == code and error.message.startswith(message), error
    error.message.encode("utf-8")


def test_the_docs_table_of_no_op_fields_is_the_declaration():
    rows = ["| field | on | accepted and ignored | any other value is refused because |", "| --- | --- | --- | --- |"]
    for name, field in NO_OP_FIELDS.items():
        urls = "every url" if field.urls == URLS else ", ".join(f"`{url}`" for url in field.urls)
        values = ", ".join(f"`{json.dumps(value)}`" for value in (*field.values, None))
        rows.append(f"| `{name}` | {urls} | {values} | {field.reason} |")
    table = "\n".join(rows)
    docs = (ROOT / "docs" / "openai-batch.md").read_text()
    assert table in docs, f"docs/openai-batch.md: replace the table of no-op fields with\n{table}"
    assert all(f"`{name}`" in docs.partition("Accepted and ignored on every url")[2][:400]
               for name in IGNORED_FIELDS)


def test_embedding_bodies():
    assert embedding_request({"input": "a"}) == EmbeddingRequest(["a"], "float")
    assert embedding_request({"input": ["a", "b"], "encoding_format": "base64", "user": "u"}).prompts == ["a", "b"]
    assert embedding_request({"input": [[1, 2], [3]]}).prompts == [{"prompt_token_ids": [1, 2]},
                                                                   {"prompt_token_ids": [3]}]
    assert embedding_request({"input": "a", "dimensions": 8}, hidden_size=8).prompts == ["a"]
    for body, code, names in [({"input": "a", "dimensions": 4}, UNSUPPORTED_FIELD, "dimensions: this model's "
                                                                                   "embeddings have 8"),
                              ({"input": "a", "encoding_format": "int8"}, INVALID_REQUEST, "encoding_format"),
                              ({"input": []}, INVALID_REQUEST, "input"),
                              ({"input": "a", "temperature": 0}, INVALID_REQUEST, "temperature: not a field")]:
        error = embedding_request(body, hidden_size=8)
        assert isinstance(error, LineError) and error.code == code and names in error.message, error


# --- engine outputs -> response bodies --------------------------------------------------------


def completion_output(index: int = 0, text: str = "hi", **fields: Any) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=[1, 2], finish_reason="stop", **fields)


def test_chat_body_carries_tool_calls_reasoning_and_usage():
    call = ToolCall("call_1", FunctionCall("weather", '{"city": "Paris"}'))
    outputs = [RequestOutput("0", "p", [5, 6, 7], [
        completion_output(0, "", tool_calls=[call], reasoning="think", num_reasoning_tokens=4),
        completion_output(1, "plain")], finished=True)]
    request = GenerationRequest(CHAT_URL, [{"prompt": "p"}], SamplingParams())
    body = generation_response_body(request, outputs, "m")
    assert body["object"] == "chat.completion" and body["model"] == "m" and body["id"].startswith("chatcmpl-")
    first, second = body["choices"]
    assert first == {"index": 0, "logprobs": None, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": None, "reasoning": "think",
                                 "tool_calls": [{"id": "call_1", "type": "function",
                                                 "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}}
    assert second["message"] == {"role": "assistant", "content": "plain"} and second["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "completion_tokens_details": {"reasoning_tokens": 4}}


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "weather"}}


@pytest.mark.parametrize(("tool_choice", "constraint"), [
    ("required", {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["weather"]}, "parameters": TOOL["function"]["parameters"]},
         "required": ["name", "parameters"]}]}}),
    (NAMED, TOOL["function"]["parameters"]),
    ("auto", None),
    ("none", None),
    (None, None),
])
def test_a_forced_tool_choice_constrains_the_answer_to_its_calls(tool_choice, constraint):
    request = chat(tools=[TOOL], tool_choice=tool_choice)
    assert rendered(request)["tools"] == [TOOL]  # "none" too: the model knows the tools, as in vLLM
    given = request.sampling_params.structured_outputs
    assert (given and given.json) == constraint and request.tool_choice.mode == (tool_choice or "auto") if isinstance(
        tool_choice, str | None) else request.tool_choice.name == "weather"


@pytest.mark.parametrize(("body", "message"), [
    ({"tool_choice": NAMED, "guided_json": {"type": "object"}},
     "tool_choice: {'function': {'name': 'weather'}} makes the answer tool calls, and guided_json also constrains it "
     "(json): keep one of them"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "and response_format also constrains"),
    ({"tool_choice": {"type": "function", "function": {"name": "wether"}}},
     "tool_choice.function.name: 'wether' is none of the tools ('weather'): name one of them, or add its tool"),
])
def test_a_forced_tool_choice_beside_another_constraint_or_naming_no_tool_is_refused(body, message):
    error = chat(tools=[TOOL], **body)
    assert error.code == INVALID_REQUEST and message in error.message, error
    assert not isinstance(chat(tools=[TOOL], tool_choice="auto", response_format={"type": "json_object"}), LineError)


class CharTokenizer:
    """Decodes each id as the character of that code point."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize(("tool_choice", "answer", "finish_reason"), [
    ("required", '[{"name": "weather", "parameters": {"city": "Oslo"}}]', "tool_calls"),
    (NAMED, '{"city": "Oslo"}', "stop"),
])
def test_a_forced_tool_choices_calls_are_read_from_the_answer_tokens(tool_choice, answer, finish_reason):
    """The calls come from the tokens the grammar made, whatever the engine's tool parser
    made of the text; a named choice finishes with "stop", as OpenAI and vLLM answer it."""
    request = chat(tools=[TOOL], tool_choice=tool_choice)
    output = RequestOutput("0", "p", [1], [CompletionOutput(0, "(the tool parser's text)", [ord(c) for c in answer],
                                                            finish_reason="stop")], finished=True)
    [choice] = generation_response_body(request, [output], "m", CharTokenizer())["choices"]
    [call] = choice["message"].pop("tool_calls")
    assert choice["message"] == {"role": "assistant", "content": None} and choice["finish_reason"] == finish_reason
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'} and call["type"] == "function"
    with pytest.raises(ValueError, match="needs the tokenizer to read its calls"):
        generation_response_body(request, [output], "m")
    [choice] = generation_response_body(request, [output], "m", CharTokenizer(), MISTRAL_CALL_IDS)["choices"]
    assert re.fullmatch("[A-Za-z0-9]{9}", choice["message"]["tool_calls"][0]["id"])  # the model's tool parser's style


def test_logprobs_in_both_shapes():
    steps = [{1: Logprob(-0.5, 1, "He"), 3: Logprob(-1.0, 2, "We")}, {4: Logprob(-0.1, 1, "y"),
                                                                     2: Logprob(float("-inf"), 9, "llo")}]
    output = RequestOutput("0", "p", [5], [CompletionOutput(0, "Hello", [1, 2], logprobs=steps, finish_reason="length")],
                           finished=True)
    chat_body = generation_response_body(GenerationRequest(CHAT_URL, [{}], SamplingParams(logprobs=1)), [output], "m")
    content = chat_body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "He", "logprob": -0.5, "bytes": [72, 101],
                          "top_logprobs": [{"token": "He", "logprob": -0.5, "bytes": [72, 101]}]}
    assert content[1]["logprob"] == -9999.0 and content[1]["top_logprobs"][0]["token"] == "y"
    text_body = generation_response_body(GenerationRequest(COMPLETIONS_URL, [{}], SamplingParams(logprobs=1)),
                                         [output], "m")
    assert text_body["choices"][0]["logprobs"] == {"tokens": ["He", "llo"], "token_logprobs": [-0.5, -9999.0],
                                                   "top_logprobs": [{"He": -0.5}, {"y": -0.1, "llo": -9999.0}],
                                                   "text_offset": [0, 2]}
    json.dumps(chat_body, allow_nan=False)


def test_completion_choices_of_several_prompts_are_numbered_across_them():
    outputs = [RequestOutput(str(i), "p", [1] * (i + 1), [completion_output(j, f"{i}{j}") for j in range(2)], True)
               for i in range(2)]
    body = generation_response_body(GenerationRequest(COMPLETIONS_URL, [{}, {}], SamplingParams()), outputs, "m")
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "00"), (1, "01"), (2, "10"), (3, "11")]
    assert body["object"] == "text_completion" and body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["total_tokens"] == 11


def test_embedding_body_as_floats_and_base64():
    outputs = [EmbeddingRequestOutput(str(i), EmbeddingOutput([0.5, -1.25 * i]), [1, 2]) for i in range(2)]
    floats = embedding_response_body(EmbeddingRequest(["a", "b"]), outputs, "m")
    assert floats == {"object": "list", "model": "m", "usage": {"prompt_tokens": 4, "total_tokens": 4},
                      "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.0]},
                               {"object": "embedding", "index": 1, "embedding": [0.5, -1.25]}]}
    encoded = embedding_response_body(EmbeddingRequest(["a", "b"], "base64"), outputs, "m")["data"][1]["embedding"]
    assert list(struct.unpack("<2f", base64.b64decode(encoded))) == [0.5, -1.25]


# --- resume and the command line without a model -----------------------------------------------


def test_finished_lines_cut_a_torn_line_and_keep_a_duplicates_first_id_open(tmp_path, caplog):
    out = tmp_path / "out.jsonl"
    records = [{"custom_id": "a", "response": {}, "error": None},
               {"custom_id": "b", "response": None, "error": {"code": DUPLICATE_CUSTOM_ID, "line": 4}},
               {"custom_id": None, "response": None, "error": {"code": INVALID_JSON, "line": 5}}]
    torn = '{"custom_id": "c", "resp'
    out.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)
    with caplog.at_level(logging.WARNING, logger="engine.entrypoints.openai.batch"):
        done = finished_lines(out)
    assert out.read_text().endswith("}\n") and len(out.read_text().splitlines()) == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"{out}: dropped a torn last line ({len(torn)} bytes); its request runs again"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.entrypoints.openai.batch"):
        assert finished_lines(out) == done  # whole lines only now: nothing dropped, nothing said
    assert not caplog.records
    assert done.covers(BatchLine(1, "a", CHAT_URL, {})) and not done.covers(BatchLine(2, "b", CHAT_URL, {}))
    assert done.covers(BadLine(4, "b", LineError(DUPLICATE_CUSTOM_ID, "")))
    assert done.covers(BadLine(5, None, LineError(INVALID_JSON, "")))
    assert not done.covers(BatchLine(6, "c", CHAT_URL, {}))


class FakeLLM:
    """An engine that upper-cases each prompt, finishing the last prompt first; it refuses
    empty prompts, and fails after `crash_after` outputs."""

    task = "generate"

    def __init__(self, crash_after: int | None = None) -> None:
        self.crash_after = crash_after

    def __enter__(self) -> "FakeLLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def get_tokenizer(self) -> FakeTokenizer:
        return TOKENIZER

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    tool_call_ids = OPENAI_CALL_IDS

    def structured_output_problem(self, params: Any) -> None:
        return None

    def validate(self, prompts: list, sampling_params: list, priority: list) -> list[str | None]:
        return ["prompt: is empty" if p["prompt"] == "" else None for p in prompts]

    def generate_as_completed(self, prompts: list, sampling_params: list, priority: list, use_tqdm: Any = True):
        for count, i in enumerate(reversed(range(len(prompts)))):
            if count == self.crash_after:
                raise RuntimeError("the device fell over")
            text = prompts[i]["prompt"]
            yield i, RequestOutput(str(i), text, [1], [completion_output(0, text.upper())], finished=True)


def test_lines_are_written_as_they_finish_and_a_rerun_after_a_crash_completes_them(tmp_path, monkeypatch):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = {"two": ["b", "c"], "refused": ["d", ""], "one": "e", "last": "f"}
    source.write_text("".join(json.dumps({"custom_id": cid, "url": COMPLETIONS_URL, "body": {"prompt": prompt}}) + "\n"
                              for cid, prompt in bodies.items()))
    monkeypatch.setattr("engine.entrypoints.openai.batch._load", lambda model, settings: FakeLLM(crash_after=2))
    with pytest.raises(RuntimeError):
        run_batch_file(str(source), str(out))
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["custom_id"], r["error"] and r["error"]["message"]) for r in written] == [
        ("refused", "line 2: prompt[1]: is empty"), ("last", None), ("one", None)]
    monkeypatch.setattr("engine.entrypoints.openai.batch._load", lambda model, settings: FakeLLM())
    summary = run_batch_file(str(source), str(out))
    assert (summary.ok, summary.errors, summary.skipped) == (1, 0, 3)
    two = json.loads(out.read_text().splitlines()[-1])
    assert two["custom_id"] == "two"
    assert [c["text"] for c in two["response"]["body"]["choices"]] == ["B", "C"]  # in prompt order


def test_lines_the_fuzz_found_are_each_their_error_and_the_run_goes_on(tmp_path, monkeypatch):
    """What tests/engine/test_openai_batch_fuzz.py found first, each now its line's error
    (or its answer) beside a good line: a field named with a lone surrogate (its error could
    not be written: UnicodeEncodeError stopped the run), JSON nested past Python's parser
    (RecursionError) or past MAX_DEPTH, a lone surrogate in a value the engine would read
    (xgrammar raised on it), an unknown field whose name is no name, and a custom_id holding
    U+2028, which str.splitlines() once split the output line at."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = {"url": COMPLETIONS_URL, "body": {"prompt": "ok"}}
    lines = [json.dumps({"custom_id": "surrogate-name", **good, "body": {"prompt": "a", "\ud800": 1}}),
             "[" * 5000 + "]" * 5000,
             json.dumps({"custom_id": "deep", **good, "body": {"prompt": "a", "stop": "X"}}).replace(
                 '"X"', "[" * 150 + "]" * 150),
             json.dumps({"custom_id": "surrogate-choice", **good,
                         "body": {"prompt": "a", "guided_choice": ["\ud800"]}}),
             json.dumps({"custom_id": "odd-name", **good, "body": {"prompt": "a", "": 1, "a: b": 2}}),
             json.dumps({"custom_id": "line\u2028break", **good}, ensure_ascii=False),
             json.dumps({"custom_id": "good", **good})]
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setattr("engine.entrypoints.openai.batch._load", lambda model, settings: FakeLLM())
    summary = run_batch_file(str(source), str(out))
    assert (summary.ok, summary.errors) == (2, 5)
    records = {r["custom_id"] or r["error"]["line"]: r for r in map(json.loads, out.read_text("utf-8").splitlines())}
    messages = {key: r["error"] and r["error"]["message"].split(" (")[0].split(", which")[0]
                for key, r in records.items()}
    assert messages == {
        "surrogate-name": 'line 1: "\\ud800": not a field of /v1/completions',
        2: "line 2: is nested more than 100 levels deep: flatten it",
        "deep": "line 3: body.stop: is nested more than 100 levels deep: flatten it",
        "surrogate-choice": "line 4: guided_choice[0]: holds a lone surrogate '\\ud800' at character 0",
        "odd-name": 'line 5: "", "a: b": not a field of /v1/completions',
        "line\u2028break": None, "good": None}


def test_every_engine_setting_is_a_flag():
    parser = build_parser()
    usage = parser.format_help()
    assert all(f"--{setting.name.replace('_', '-')} " in usage for setting in engine_settings())
    args = vars(parser.parse_args(["-i", "a", "-o", "b", "--enforce-eager", "--enable-prefix-caching", "false",
                                   "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--quantization",
                                   "none", "--limit-mm-per-prompt", '{"image": 2}', "--async-scheduling", "true"]))
    assert args == {"input_file": "a", "output_file": "b", "embedding_model": None, "enforce_eager": True,
                    "enable_prefix_caching": False, "max_num_seqs": 8, "gpu_memory_utilization": 0.5,
                    "quantization": None, "limit_mm_per_prompt": {"image": 2}, "async_scheduling": True}
    for bad in (["--max-num-seqs", "x"], ["--enforce-eager", "yes"], ["--limit-mm-per-prompt", "[1]"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["-i", "a", "-o", "b", *bad])


def test_a_file_of_bad_lines_runs_without_a_model_from_an_fsspec_url_to_stdout(capsys):
    import fsspec

    with fsspec.open("memory://run_batch/in.jsonl", "w") as stream:
        stream.write('oops\n{"custom_id": "x", "url": "/v1/images", "body": {}}\n')
    assert main(["-i", "memory://run_batch/in.jsonl", "-o", "-"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["error"]["code"] for line in out.splitlines()] == [INVALID_JSON, UNSUPPORTED_URL]
    assert "0 lines ok, 2 errors, 0 skipped" in err


def test_unusable_files_exit_with_2(tmp_path, capsys):
    assert main(["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")]) == 2
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("oops\n")
    out.write_text("not an output line\n")
    assert main(["-i", str(source), "-o", str(out)]) == 2
    assert "is not an output line" in capsys.readouterr().err


# --- end to end on the embedded model ----------------------------------------------------------

MAX_TOKENS = 8
# No int8 calibration at load (two loads per run): the same outputs to compare, sooner.
SETTINGS = {"kv_cache_memory": 64 << 20, "max_model_len": 512, "quantization": None}
CHATS = {"chat-a": [{"role": "user", "content": "What is the capital of France?"}],
         "chat-b": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]}
COMPLETION_PROMPTS = ["The capital of France is", "1, 2, 3,"]


def batch_input() -> list[dict]:
    """Good chat, completion and embedding lines among bad ones; a bad line's custom_id starts with "bad"."""
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS}
    lines = [{"custom_id": cid, "method": "POST", "url": CHAT_URL,
              "body": {"model": "gpt-4o-mini", "messages": messages, **greedy}} for cid, messages in CHATS.items()]
    lines += [
        {"custom_id": "cmpl", "method": "POST", "url": COMPLETIONS_URL,
         "body": {"prompt": COMPLETION_PROMPTS, "logprobs": 2, **greedy}},
        {"custom_id": "chat-logprobs", "method": "POST", "url": CHAT_URL,
         "body": {"messages": CHATS["chat-a"], "logprobs": True, "top_logprobs": 2, "n": 2, "seed": 1,
                  "max_completion_tokens": 4}},
        {"custom_id": "emb-float", "method": "POST", "url": EMBEDDINGS_URL, "body": {"input": ["hello", "world"]}},
        {"custom_id": "emb-b64", "method": "POST", "url": EMBEDDINGS_URL,
         "body": {"input": "world", "encoding_format": "base64"}},
        {"custom_id": "bad-field", "method": "POST", "url": CHAT_URL, "body": {"messages": USER, "temprature": 0}},
        {"custom_id": "bad-echo", "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": "a", "echo": True}},
        {"custom_id": "bad-logprobs", "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": "a", "logprobs": 50}},
        {"custom_id": "bad-empty", "method": "POST", "url": EMBEDDINGS_URL, "body": {"input": ""}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/moderations", "body": {"input": "a"}},
        {"custom_id": "chat-a", "method": "POST", "url": CHAT_URL, "body": {"messages": USER}},
        {"method": "POST", "url": CHAT_URL, "body": {"messages": USER}},
    ]
    return lines


def run_batch(source: Path, out: Path) -> subprocess.CompletedProcess:
    flags = [f"--{name.replace('_', '-')}={'none' if value is None else value}" for name, value in SETTINGS.items()]
    result = subprocess.run([sys.executable, "-m", "engine.run_batch", "-i", str(source), "-o", str(out), *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def check_output_line(record: dict) -> None:
    """One output line against OpenAI's batch output schema."""
    assert set(record) == {"id", "custom_id", "response", "error"} and record["id"].startswith("batch_req_")
    if record["response"] is None:
        assert set(record["error"]) == {"code", "message", "line"}
        assert record["error"]["message"].startswith(f"line {record['error']['line']}: ")
        return
    assert record["error"] is None and record["response"]["status_code"] == 200
    assert isinstance(record["response"]["request_id"], str)
    body = record["response"]["body"]
    usage = body["usage"]
    if body["object"] == "list":
        assert set(body) == {"object", "data", "model", "usage"} and usage["prompt_tokens"] == usage["total_tokens"] > 0
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        assert all(d["object"] == "embedding" for d in body["data"])
        return
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] in ("chat.completion", "text_completion") and body["model"] == "smollm2-135m-instruct"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 600
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length")
        if body["object"] == "chat.completion":
            assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and isinstance(choice["text"], str)


def test_run_batch_end_to_end_and_resume(tmp_path):
    """The command runs every good line and writes an error for each bad one only; a rerun
    on a cut output file skips the whole lines, reruns the torn one and keeps each id once;
    greedy lines equal LLM.chat and LLM.generate."""
    source, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    lines = batch_input()
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    first = run_batch(source, out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record in records:
        check_output_line(record)
    good = {line["custom_id"] for line in lines[:6]}
    by_id = {r["custom_id"]: r for r in records if r["response"] is not None}
    assert set(by_id) == good and sum(r["response"] is not None for r in records) == len(good)
    errors = {(r["custom_id"], r["error"]["code"], r["error"]["line"]) for r in records if r["error"]}
    assert errors == {("bad-field", INVALID_REQUEST, 7), ("bad-echo", UNSUPPORTED_FIELD, 8),
                      ("bad-logprobs", INVALID_REQUEST, 9), ("bad-empty", INVALID_REQUEST, 10),
                      ("bad-url", UNSUPPORTED_URL, 11), ("chat-a", DUPLICATE_CUSTOM_ID, 12),
                      (None, INVALID_LINE, 13), (None, INVALID_JSON, 14)}
    assert "6 lines ok, 8 errors, 0 skipped" in first.stderr and "gpt-4o-mini" in first.stderr

    with LLM(**SETTINGS) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        for cid, messages in CHATS.items():
            [expected] = llm.chat(messages, greedy, use_tqdm=False)
            assert by_id[cid]["response"]["body"]["choices"][0]["message"]["content"] == expected.outputs[0].text
            assert by_id[cid]["response"]["body"]["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        expected = llm.generate(COMPLETION_PROMPTS, greedy, use_tqdm=False)
        assert [c["text"] for c in by_id["cmpl"]["response"]["body"]["choices"]] == [o.outputs[0].text for o in expected]
    sampled = by_id["chat-logprobs"]["response"]["body"]["choices"]
    assert len(sampled) == 2 and all(len(c["logprobs"]["content"]) == 4 for c in sampled)
    assert all(len(token["top_logprobs"]) == 2 for c in sampled for token in c["logprobs"]["content"])
    floats = by_id["emb-float"]["response"]["body"]["data"]
    encoded = by_id["emb-b64"]["response"]["body"]["data"][0]["embedding"]
    vector = struct.unpack(f"<{len(floats[1]['embedding'])}f", base64.b64decode(encoded))
    assert len(vector) == 576 and vector == pytest.approx(floats[1]["embedding"], abs=1e-6)
    assert sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-3)

    # Resume: keep the whole lines before the first embedding (every chat and completion), then half of
    # that one, so that the rerun loads the pooling model only.
    kept = next(i for i, r in enumerate(records) if r["response"] and r["response"]["body"]["object"] == "list")
    text_lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text_lines[:kept]) + text_lines[kept][: len(text_lines[kept]) // 2])
    second = run_batch(source, out)
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_text().splitlines(keepends=True)[:kept] == text_lines[:kept]  # not rerun
    for record in resumed:
        check_output_line(record)
    assert sorted(r["custom_id"] or "" for r in resumed) == sorted(r["custom_id"] or "" for r in records)
    assert len(resumed) == len(records) and f"{kept} skipped" in second.stderr
