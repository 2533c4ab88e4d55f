"""`LLM`: vLLM's offline entry point, over our engine."""

import gc
import itertools
import time
from collections.abc import Callable, Iterator, Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig, engine_settings
from engine.hardware import release_freed_memory
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.model_loader import weights_fingerprint
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, logprobs_count

PromptType = str | dict[str, Any]


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    lora_request: LoRARequest | None


class LLM:
    """Generates text for batches of prompts with continuous batching and a paged KV cache.

    `LLM(model, **settings)` takes the model folder (or "smollm2-135m-instruct", the
    default) and any `EngineConfig` setting by name (dtype, device, max_num_seqs,
    kv_cache_memory, enable_lora, attention_backend, ...); `help(LLM.__init__)` lists them
    with their meaning.

    Examples:
        >>> from engine import LLM, SamplingParams
        >>> with LLM() as llm:
        ...     outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
        ...     print(outputs[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        known = {f.name for f in engine_settings()}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown setting(s) {unknown}; the settings are {sorted(known - {'model'})}")
        config = EngineConfig(model=model, **settings)
        self.llm_engine: LLMEngine | None = LLMEngine(config)
        self._request_ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        if self.llm_engine is None:
            raise RuntimeError("this LLM was closed; create a new one")
        return self.llm_engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults: SamplingParams(), with the sampling fields that the model's
        generation_config.json sets (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens)."""
        return SamplingParams(**self.engine.model_config.sampling_defaults)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        priority: int | SequenceABC[int] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, rendered with the
        model's chat template (or `chat_template`), with vLLM's arguments.

        A message's content is a string or OpenAI's list of text parts
        ([{"type": "text", "text": ...}], joined by newlines as vLLM does for templates
        that render strings). `continue_final_message` renders the last message open, for
        the model to carry on (it needs add_generation_prompt=False); `tools` and
        `chat_template_kwargs` go to the template. The rendered text is tokenized without
        adding special tokens, because the template already holds any BOS token: a second
        one would change the output.

        Raises:
            ValueError: before any work starts, listing every bad conversation.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("chat: add_generation_prompt and continue_final_message cannot both be True: "
                             "set add_generation_prompt=False to continue the final message")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        problems = [f"conversation {i}, {problem}" for i, conversation in enumerate(conversations)
                    if (problem := chat_messages_problem(conversation)) is not None]
        if problems:
            raise ValueError(f"{len(problems)} invalid conversation(s); nothing was run:\n  " + "\n  ".join(problems))
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(text_messages(conversation), tokenize=False,
                                                 chat_template=chat_template, tools=tools,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority)

    @property
    def model_path(self) -> Path:
        """The local model folder the weights were loaded from."""
        return self.engine.model_config.path

    @property
    def model_fingerprint(self) -> str:
        """sha256 of the weight files: what changes when the weights do."""
        return weights_fingerprint(self.engine.model_config.path)

    def add_lora(self, lora_request: LoRARequest) -> str:
        """Reads an adapter into host memory and checks it against the model, as
        `generate` would; returns its fingerprint (sha256 of its config and weights).

        Raises:
            ValueError: the LLM was created without enable_lora, or the adapter cannot
                run (the message names it, the problem and the fix).
        """
        manager = self.engine.lora_manager
        if manager is None:
            raise ValueError("adapters need LLM(enable_lora=True, max_lora_rank=...)")
        return manager.check(lora_request).digest

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        priority: int | SequenceABC[int] | None = None,
    ) -> list[RequestOutput]:
        """Completes every prompt and returns one `RequestOutput` per prompt, in input order.

        A prompt is a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}.
        `sampling_params`, `lora_request` and `priority` are one value for all prompts or
        one per prompt; a None adapter runs the base model. Requests with different
        adapters run in the same steps. A priority orders requests (lower first) under
        `scheduling_policy="priority"` and is ignored under "fcfs", as in vLLM.

        Raises:
            ValueError: before any work starts, listing every bad row (index, field,
                reason and what to do).
        """
        finished = self.generate_as_completed(prompts, sampling_params, use_tqdm=use_tqdm,
                                              lora_request=lora_request, priority=priority)
        outputs: list[RequestOutput | None] = [None] * len(finished)
        for index, output in finished:
            outputs[index] = output
        return outputs

    def generate_as_completed(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        priority: int | SequenceABC[int] | None = None,
    ) -> "CompletedRequests":
        """Like `generate`, but hands each request's output over as soon as it finishes.

        Validates every row at once before anything runs (raising as `generate` does) and
        returns an iterable of `(index, RequestOutput)` pairs, `index` being the prompt's
        position, in the order the requests finish; `len()` of it is the number of
        prompts. Requests are queued when iteration starts; stopping early (closing the
        iterator, or an exception in the progress callback) aborts those still queued or
        running, and their KV blocks return to the cache.
        """
        requests = self._validate(prompts, sampling_params, lora_request, priority)
        return CompletedRequests(self._run(requests, use_tqdm), len(requests))

    def _run(self, requests: list[_Request], use_tqdm: bool | Callable[..., Any]) -> Iterator[tuple[int, RequestOutput]]:
        if not requests:
            return
        engine = self.engine
        seqs = [
            engine.add_request(str(next(self._request_ids)), r.prompt, r.prompt_token_ids,
                               r.sampling_params, r.priority, r.lora_request)
            for r in requests
        ]
        index_of = {seq.request_id: i for i, seq in enumerate(seqs)}
        progress = _Progress(use_tqdm, len(seqs))
        try:
            while engine.has_unfinished_requests():
                # Completions of one request may finish in the same step: count it once.
                done = list({s.group[0] for s in engine.step() if s.request_finished})
                progress.update(done)
                for seq in done:
                    yield index_of[seq.request_id], engine.request_output(seq)
        except BaseException:  # GeneratorExit included: the caller stopped early
            engine.abort_all()
            raise
        finally:
            progress.close()

    def validate(
        self,
        prompts: SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        priority: int | SequenceABC[int] | None = None,
    ) -> list[str | None]:
        """Checks requests without running them: for each row, its problems as one line
        ("field: reason and what to do"; several joined by "; "), or None when it is fine.

        Raises:
            ValueError: when the arguments as a whole do not fit (list lengths).
        """
        rows = self._check_rows(prompts, sampling_params, lora_request, priority)
        return [None if isinstance(row, _Request) else row for row in rows]

    def _validate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None,
        priority: int | SequenceABC[int] | None,
    ) -> list[_Request]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        rows = self._check_rows(prompts, sampling_params, lora_request, priority)
        problems = [f"row {i}, {row}" for i, row in enumerate(rows) if not isinstance(row, _Request)]
        if problems:
            raise ValueError(
                f"{len(problems)} invalid prompt row(s); nothing was run:\n  " + "\n  ".join(problems)
            )
        return rows

    def _check_rows(
        self,
        prompts: SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None,
        priority: int | SequenceABC[int] | None,
    ) -> list["_Request | str"]:
        """Each row as a ready `_Request`, or as the text of its problems."""
        engine = self.engine
        prompts = list(prompts)
        problems: list[str] = []
        params_list = _per_prompt("sampling_params", sampling_params, len(prompts), problems)
        adapters = _per_prompt("lora_request", lora_request, len(prompts), problems)
        priorities = _per_prompt("priority", priority, len(prompts), problems)
        if problems:
            raise ValueError("generate() was called with invalid arguments; nothing was run:\n  " + "\n  ".join(problems))

        max_len = engine.model_config.max_model_len
        vocab = engine.model_config.hf_config.vocab_size
        capacity = engine.kv_cache_tokens
        rows: list[_Request | str] = []
        adapter_problems: dict[LoRARequest, str | None] = {}
        for prompt, params, adapter, prio in zip(prompts, params_list, adapters, priorities):
            found: list[str] = []
            if not isinstance(adapter, (LoRARequest, type(None))):
                found.append(f"lora_request: expected a LoRARequest or None, got {type(adapter).__name__}")
            elif adapter is not None:
                if adapter not in adapter_problems:
                    adapter_problems[adapter] = self._check_adapter(adapter)
                if adapter_problems[adapter]:
                    found.append(f"lora_request: {adapter_problems[adapter]}")
            params = self.get_default_sampling_params() if params is None else params
            if not isinstance(params, SamplingParams):
                found.append(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
                params = SamplingParams()
            prio = 0 if prio is None else prio
            if not isinstance(prio, int):
                found.append(f"priority: expected an integer, got {prio!r}")
            if (bad_text := invalid_unicode_problem(prompt)) is not None:
                found.append(bad_text)
                rows.append("; ".join(found))
                continue
            text, ids = self._tokenize(prompt)
            needed = len(ids or []) + params.max_output_tokens(len(ids or []), max_len)
            if ids is None:
                found.append("prompt: expected a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                             f"got {type(prompt).__name__}")
            elif not ids:
                found.append("prompt: is empty: drop the row or give it text")
            elif len(ids) >= max_len:
                found.append(f"prompt: has {len(ids)} tokens, but max_model_len is {max_len}: shorten it "
                             f"to at most {max_len - 1} tokens, or raise max_model_len")
            elif any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                found.append(f"prompt_token_ids: holds ids outside the vocabulary [0, {vocab}): fix the ids")
            elif any(t >= vocab for t in params.token_ids()):
                found.append(f"sampling_params: stop_token_ids, logit_bias or allowed_token_ids name ids "
                             f"outside the vocabulary [0, {vocab}): fix the ids")
            elif needed > capacity:
                found.append(f"max_tokens: prompt plus max_tokens needs {needed} tokens of KV cache, which "
                             f"holds {capacity}: lower max_tokens or raise kv_cache_memory / gpu_memory_utilization")
            elif params.n > engine.config.max_num_seqs:
                found.append(f"sampling_params: n={params.n} completions run side by side, but max_num_seqs is "
                             f"{engine.config.max_num_seqs}: lower n or raise max_num_seqs")
            elif (problem := self._logprobs_problem(params, vocab)) is not None:
                found.append(problem)
            elif params.structured_outputs is not None and (problem := self._structured_problem(params)):
                found.append(f"structured_outputs: {problem}")
            rows.append("; ".join(found) if found else _Request(text, ids, params, prio, adapter))
        return rows

    def _logprobs_problem(self, params: SamplingParams, vocab: int) -> str | None:
        """Why the request asks for more logprobs per token than `max_logprobs` allows, or None."""
        limit = logprobs_count(self.engine.config.max_logprobs, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            asked = logprobs_count(getattr(params, name), vocab)
            if asked is not None and asked > limit:
                return (f"{name}: asks for {asked} logprobs per token, but max_logprobs is {limit}: "
                        f"ask for at most {limit}, or raise LLM(max_logprobs=...) (-1 allows the whole vocabulary)")
        return None

    def _structured_problem(self, params: SamplingParams) -> str | None:
        """Why the request's structured output cannot run (compiling its grammar, once per
        distinct constraint), or None."""
        if params.min_tokens:
            return (f"min_tokens={params.min_tokens} clashes with it (the grammar decides where the "
                    "output ends): set min_tokens to 0")
        return self.engine.structured_output.problem(params.structured_outputs)

    def _check_adapter(self, adapter: LoRARequest) -> str | None:
        """Why the adapter cannot run (reading it into host memory to find out), or None."""
        try:
            self.add_lora(adapter)
        except ValueError as exc:  # LoRAError included
            return str(exc)
        return None

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int] | None]:
        """The prompt's text and token ids; ids are None for a prompt of an unknown form."""
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            return None, None
        return text, self.engine.tokenizer(text).input_ids if text else []

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes; returns False while requests are running."""
        return self.engine.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Frees the model and the KV cache; the LLM cannot be used afterwards."""
        if self.llm_engine is not None:
            self.llm_engine.release()
            self.llm_engine = None
            gc.collect()
            release_freed_memory()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class CompletedRequests:
    """The `(index, RequestOutput)` pairs of `LLM.generate_as_completed`, as requests finish."""

    def __init__(self, pairs: Iterator[tuple[int, RequestOutput]], count: int) -> None:
        self._pairs = pairs
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[tuple[int, RequestOutput]]:
        return self._pairs

    def close(self) -> None:
        """Stops early: aborts the requests that have not finished."""
        self._pairs.close()


def chat_messages_problem(messages: object) -> str | None:
    """Why `messages` is not a conversation a chat template can render (a list of
    {"role": str, "content": str or a list of text parts} with valid Unicode), or None."""
    if not isinstance(messages, list) or not messages:
        return f"messages: expected a non-empty list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return f"message {i}: expected a dict with 'role' and 'content', got {message!r:.80}"
        content = message["content"]
        if isinstance(content, list):
            if (problem := _text_parts_problem(content, i)) is not None:
                return problem
            content = _joined(content)
        for field, value in (("role", message["role"]), ("content", content)):
            if not isinstance(value, str):
                return (f"message {i}: {field} must be a string, got {type(value).__name__} "
                        f"({value!r:.40}): convert it upstream")
            if (problem := invalid_unicode_problem(value, f"message {i} {field}")) is not None:
                return problem
    return None


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every content as a string (text parts joined by newlines),
    for templates that render strings; other keys are kept. Assumes `chat_messages_problem`
    found nothing."""
    return [{**m, "content": _joined(m["content"])} if isinstance(m["content"], list) else m for m in messages]


def _text_parts_problem(parts: list, index: int) -> str | None:
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            return (f"message {index}: content part {j} is {kind!r}, not a text part "
                    "({'type': 'text', 'text': str}): only text can be rendered (no multimodal models here)")
    return None


def _joined(parts: list[dict[str, str]]) -> str:
    return "\n".join(part["text"] for part in parts)


def invalid_unicode_problem(prompt: object, field: str = "prompt") -> str | None:
    """Why the prompt's text (a str, or the "prompt" of a dict) cannot be encoded as UTF-8
    (a lone surrogate), as `<field>: ...`, or None."""
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"{field}: holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not "
                "valid Unicode: fix the text's encoding upstream (e.g. decode the source bytes as UTF-8)")
    return None


def _per_prompt(name: str, value: Any, count: int, problems: list[str]) -> list[Any]:
    """One value per prompt from a single value or a list of them."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            problems.append(f"{name}: got {len(value)} values for {count} prompts; give one per prompt or a single value")
            return [None] * count
        return list(value)
    return [value] * count


class _Progress:
    """The progress bar: prompts done, with estimated input and output tokens per second."""

    def __init__(self, use_tqdm: bool | Callable[..., Any], total: int) -> None:
        self.bar = None
        if use_tqdm:
            factory = tqdm if use_tqdm is True else use_tqdm
            self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True,
                               postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.started = time.perf_counter()
        self.input_tokens = 0
        self.output_tokens = 0

    def update(self, finished: list) -> None:
        """Called after every step, so that a bar or a logger can tick during long decodes."""
        if self.bar is None:
            return
        self.input_tokens += sum(s.num_prompt_tokens for s in finished)
        self.output_tokens += sum(c.num_output_tokens for s in finished for c in s.group)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.output_tokens / elapsed:.2f} toks/s")
        self.bar.update(len(finished))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _settings_doc() -> str:
    """`LLM.__init__`'s docstring, from the settings' own descriptions."""
    lines = ["Loads the model and sizes the KV cache.", "", "Args:"]
    for setting in engine_settings():
        lines.append(f"    {setting.name} (default {setting.default!r}): {setting.metadata['help']}")
    return "\n".join(lines)


LLM.__init__.__doc__ = _settings_doc()
