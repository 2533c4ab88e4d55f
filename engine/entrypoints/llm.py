"""`LLM`: vLLM's offline entry point, over our engine."""

import dataclasses
import gc
import itertools
import logging
from collections.abc import Iterator, Sequence as SequenceABC
from pathlib import Path
from typing import Any

import torch

from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.entrypoints.chat_utils import chat_messages_problem, render_chat, unread_parts_problem
from engine.config import OUTPUT, EngineConfig, PoolerConfig, engine_settings
from engine.entrypoints.data_parallel import ReplicaPool, deal
from engine.distributed.plan import plan_parallelism
from engine.hardware import release_freed_memory, resolve_device
from engine.entrypoints.inputs import (
    LoRARequestArg, PriorityArg, Prompts, PromptType, Request, RequestChecker, SamplingParamsArg, UseTqdm,
    valid_requests,
)
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.multimodal.audio import AudioLike, AudioLimits
from engine.multimodal.image import ImageLimits
from engine.multimodal.video import VideoLimits
from engine.model_loader.folder import model_fingerprint
from engine.output_processor.parsing import PARSING_REVISION
from engine.outputs import (
    ClassificationRequestOutput, EmbeddingRequestOutput, EngineStats, RequestOutput, ScoringRequestOutput,
    TranscriptionOutput, UnfinishedOutput,
)
from engine.pooling_params import PoolingParams
from engine.entrypoints.progress_bar import ProgressBar
from engine.entrypoints.score_utils import cosine_scores, cross_encoder_inputs, cross_encoder_scores, score_pairs
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from engine.entrypoints.transcription import plan_transcription
from engine.entrypoints.tool_choice import ToolChoice, apply_tool_choice, constrained, grammar_problem, resolve_tool_choice
from engine.tool_parsers.abstract import OPENAI_CALL_IDS, CallIds

logger = logging.getLogger(__name__)


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
        self._request_ids = itertools.count()
        self._replicas: ReplicaPool | None = None
        if config.data_parallel_size == 1:
            self._llm_engine: LLMEngine | None = LLMEngine(config)
            return
        plan = plan_parallelism(config.tensor_parallel_size, config.data_parallel_size, resolve_device(config.device))
        self._replicas = ReplicaPool(config, plan.replicas[1:])  # they load while this process does
        try:
            self._llm_engine = LLMEngine(config, plan.replicas[0])
            self._replicas.wait_ready()
        except BaseException:
            self._replicas.close()
            raise
        logger.info("Data parallel over %d replicas: %s", config.data_parallel_size,
                    "; ".join(p.describe() for replica in plan.replicas for p in replica.placements))

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine underneath (tokenizer, scheduler, block manager, model runner), as in
        vLLM; for tests and benchmarks that look inside it.

        Raises:
            RuntimeError: the LLM was closed.
        """
        if self._llm_engine is None:
            raise RuntimeError("this LLM was closed; create a new one")
        return self._llm_engine

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def tool_call_ids(self) -> CallIds:
        """The style of the ids the engine gives tool calls: its tool_call_parser's (Mistral's
        9 alphanumerics, which its templates take back), else OpenAI's `call_` + 24 hex."""
        parser = self.llm_engine.tool_parser
        return parser.call_ids if parser is not None else OPENAI_CALL_IDS

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults: SamplingParams(), with the sampling fields that the model's
        generation_config.json sets (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens)."""
        return SamplingParams(**self.llm_engine.model_config.sampling_defaults)

    @property
    def model_path(self) -> Path:
        """The local model folder the weights were loaded from."""
        return self.llm_engine.model_config.path

    @property
    def model_fingerprint(self) -> str:
        """sha256 of the model folder's files that decide its outputs (weights, config.json,
        generation_config.json, tokenizer, chat template, processor configs) and of the
        tokenizer folder's: what changes when any of them does (`model_fingerprint`)."""
        tokenizer = self.llm_engine.config.tokenizer
        return model_fingerprint(self.model_path, Path(tokenizer).expanduser() if tokenizer else None)

    @property
    def output_settings(self) -> dict[str, object]:
        """Everything of this engine's that decides a completion besides the request: the
        model's fingerprint, and each setting of class OUTPUT (`engine.config`) as the engine
        resolved it, the device by its type. Two engines that differ here may give different
        rows for the same prompts (dtype="auto" is float32 on an AVX2 CPU, bfloat16 with int8
        products on an AVX-512 one; reasoning_parser="auto" is the parser the tokenizer
        implies), so row digests and data versions hold it; operational settings (threads,
        block size, speculation...) stay out, and changing them reuses rows. With a reasoning
        or tool-call parser, the revision of the parsers' rules enters too (`PARSING_REVISION`)."""
        config = self.llm_engine.config
        settings = {setting.name: getattr(config, setting.name) for setting in engine_settings()
                    if setting.metadata.get("affects") == OUTPUT}
        if config.reasoning_parser is not None or config.tool_call_parser is not None:
            settings["output_parsing"] = PARSING_REVISION  # the parsers' rules, which can change their columns
        return {"model": self.model_fingerprint, **settings, "device": torch.device(config.device).type}

    @property
    def dtype(self) -> str:
        """The compute dtype the engine runs in, as `LLM(dtype=...)` names it ("bfloat16"):
        what "auto" picked for this model and device."""
        return self.llm_engine.model_config.dtype_name

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus completion the engine takes: a completion whose
        max_tokens is None may generate up to it."""
        return self.llm_engine.model_config.max_model_len

    @property
    def child_pids(self) -> list[int]:
        """Process ids of the engine's child processes: tensor-parallel ranks 1.. and
        data-parallel replicas 1.. (each replica's own ranks are its children)."""
        replicas = self._replicas.pids if self._replicas is not None else []
        return self.llm_engine.model_runner.workers.pids + replicas

    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's counters since it started (steps, prompt tokens
        computed and found in the prefix cache, tokens generated), summed over the
        data-parallel replicas (theirs as last reported): later work leaves it as it is,
        so two snapshots give what ran between them."""
        stats = dataclasses.replace(self.llm_engine.stats)
        return stats if self._replicas is None else stats + self._replicas.total_stats()

    def unfinished_outputs(self) -> list[UnfinishedOutput]:
        """Tokens generated so far and max_tokens of every completion still queued or
        running (on data-parallel replicas, as last reported): what a progress estimate
        needs. Safe to call from another thread while `generate` runs (a snapshot)."""
        remote = self._replicas.all_unfinished() if self._replicas is not None else []
        return self.llm_engine.unfinished_outputs() + remote

    def structured_output_problem(self, params: StructuredOutputsParams) -> str | None:
        """Why the engine cannot run these structured-output constraints (their grammar
        does not compile; the message names the constraint and the compiler's reason), or
        None. Compiles them once, so requests that use them later start at once."""
        return self.llm_engine.structured_output.problem(params)

    def add_lora(self, lora_request: LoRARequest) -> str:
        """Reads an adapter into host memory and checks it against the model, as
        `generate` would; returns its fingerprint (sha256 of its config and weights).

        Raises:
            ValueError: the LLM was created without enable_lora, or the adapter cannot
                run (the message names it, the problem and the fix).
        """
        return self.llm_engine.add_lora(lora_request)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParamsArg = None,
        *,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequestArg = None,
        priority: PriorityArg = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, rendered with the
        model's chat template (or `chat_template`), with vLLM's arguments.

        A message's content is a string or OpenAI's list of text parts
        ([{"type": "text", "text": ...}], joined by newlines as vLLM does for templates
        that render strings) and, for a vision-language model, image parts
        ({"type": "image_url", "image_url": {"url": "data:..." or "file://..."}},
        {"type": "image_pil", "image_pil": image}), whose placeholders the model's template writes. `continue_final_message` renders the last message open, for
        the model to carry on (it needs add_generation_prompt=False); `tools` and
        `chat_template_kwargs` go to the template. See `render_chat`.

        `tool_choice` is OpenAI's, as vLLM's server takes it: "auto" (None; the model decides
        and the engine's tool_call_parser reads its calls), "none" (the model is not asked to
        call), "required" (one call or more) or {"type": "function", "function": {"name":
        ...}} (one call of that tool). The last two are made exact by a grammar over the
        tools' parameters after the reasoning ends (in place of a structured output of the
        sampling params): every completion's `tool_calls` hold its calls and `text` is empty,
        unless it was cut before its JSON ended (then `tool_call_error` says so). See
        `engine.entrypoints.tool_choice`.

        Raises:
            ValueError: before any work starts, listing every bad conversation; a tool
                choice that does not fit the tools or the sampling params (naming the field).
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("chat: add_generation_prompt and continue_final_message cannot both be True: "
                             "set add_generation_prompt=False to continue the final message")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        processor = self.llm_engine.mm_processor
        if processor is not None and processor.cross_modality is not None:
            raise ValueError(f"chat: {self.llm_engine.model_config.hf_config.model_type} is an encoder-decoder model "
                             "with no chat template: call generate with its decoder prompt and the "
                             f"{processor.cross_modality}, or LLM.transcribe")
        reads = processor.placeholder_ids if processor is not None else {}
        problems = [f"conversation {i}, {problem}" for i, conversation in enumerate(conversations)
                    if (problem := chat_messages_problem(conversation)
                        or unread_parts_problem(conversation, reads)) is not None]
        if problems:
            raise ValueError(f"{len(problems)} invalid conversation(s); nothing was run:\n  " + "\n  ".join(problems))
        choice = resolve_tool_choice(tool_choice, tools)
        if choice.forced:
            sampling_params = self._forced_call_params(sampling_params, choice)
        tokenizer = self.llm_engine.tokenizer
        prompts = [render_chat(tokenizer, conversation, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=chat_template_kwargs, tool_choice=choice.mode)
                   for conversation in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                                priority=priority)
        return [apply_tool_choice(output, choice, tokenizer, self.tool_call_ids) for output in outputs]

    def _forced_call_params(self, sampling_params: SamplingParamsArg, choice: ToolChoice
                            ) -> SamplingParams | list[SamplingParams]:
        """The sampling params of a forced tool choice: each with its grammar (the model's
        defaults where none are given).

        Raises:
            ValueError: the grammar does not compile, or params that constrain the output already.
        """
        if (problem := grammar_problem(choice, self.structured_output_problem)) is not None:
            raise ValueError(f"chat: {problem}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return constrained(sampling_params or self.get_default_sampling_params(), choice)
        return [constrained(params or self.get_default_sampling_params(), choice, f"sampling_params[{i}]")
                if params is None or isinstance(params, SamplingParams) else params  # generate names a wrong type
                for i, params in enumerate(sampling_params)]

    def generate(self, prompts: Prompts, sampling_params: SamplingParamsArg = None, *, use_tqdm: UseTqdm = True,
                 lora_request: LoRARequestArg = None, priority: PriorityArg = None) -> list[RequestOutput]:
        """Completes every prompt and returns one `RequestOutput` per prompt, in input order.

        A prompt is a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}; for a
        vision-language model a dict may add {"multi_modal_data": {"image": image or [images]}}
        (PIL images, encoded bytes, local paths, file:// or data: URIs), each image standing
        for one `image_placeholder` in the prompt. A chat prompt that `render_chat` made may
        carry {"tools": [...]} (the tool parser reads its calls by them) and a "tool_choice"
        other than "auto" (its calls are then left to the caller: `engine.entrypoints.tool_choice`).
        `sampling_params`, `lora_request` and `priority` are one value for all prompts or
        one per prompt; a None adapter runs the base model. Requests with different
        adapters run in the same steps. A priority orders requests (lower first) under
        `scheduling_policy="priority"` and is ignored under "fcfs", as in vLLM.

        Raises:
            ValueError: before any work starts, listing every bad row (index, field,
                reason and what to do).
        """
        return _in_order(self.generate_as_completed(prompts, sampling_params, use_tqdm=use_tqdm,
                                                    lora_request=lora_request, priority=priority))

    def generate_as_completed(self, prompts: Prompts, sampling_params: SamplingParamsArg = None, *,
                              use_tqdm: UseTqdm = True, lora_request: LoRARequestArg = None,
                              priority: PriorityArg = None) -> "CompletedRequests":
        """Like `generate`, but hands each request's output over as soon as it finishes.

        Validates every row at once before anything runs (raising as `generate` does) and
        returns an iterable of `(index, RequestOutput)` pairs, `index` being the prompt's
        position, in the order the requests finish; `len()` of it is the number of
        prompts. Requests are queued when iteration starts; stopping early (closing the
        iterator, or an exception in the progress callback) aborts those still queued or
        running, and their KV blocks return to the cache.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        self._require_task(None, "generate")
        rows = RequestChecker(self.llm_engine).check(prompts, sampling_params, lora_request, priority)
        requests = valid_requests(rows)
        return CompletedRequests(self._run(requests, use_tqdm), len(requests))

    def transcribe(self, audio: Any, *, language: str | None = "en", task: str = "transcribe",
                   prompt: str | None = None, sampling_params: SamplingParams | None = None,
                   use_tqdm: UseTqdm = False) -> list[TranscriptionOutput]:
        """Each clip's transcript (`task="translate"`: its English translation), in input order,
        with a model that transcribes (Whisper; vLLM's transcription endpoint, offline).

        `audio` is one clip (a `(waveform, sample_rate)` tuple, encoded bytes, a path, a file://
        or data: URI: what `multi_modal_data["audio"]` takes) or a list of clips, of any length:
        a clip longer than the model's window (30 s) is cut at its quietest moments into
        windows (`engine.multimodal.audio_windows.split_windows`), each window of every clip
        runs as one request of one `generate` under "<|prev|>{prompt}<|startoftranscript|>
        <|{language}|><|{task}|><|notimestamps|>", and a clip's window texts are joined in
        order. `language=None` detects each clip's language first, as vLLM does (one greedy
        token among the language tokens, over its first window). `sampling_params` default to
        greedy decoding up to the decoder's context.

        Raises:
            ValueError: before any work: a model that does not transcribe, an unknown
                language or task, and every clip that cannot be read, listed.
        """
        plan = plan_transcription(self.llm_engine.mm_processor, audio, language, task, prompt)
        if language is None:
            languages = plan.detected(self.generate(plan.detection_rows(), plan.detection_params(), use_tqdm=False))
        else:
            languages = [language] * len(plan.clips)
        params = sampling_params if sampling_params is not None else SamplingParams(temperature=0, max_tokens=None)
        return plan.outputs(languages, self.generate(plan.rows(languages), params, use_tqdm=use_tqdm))

    def beam_search(self, prompts: Prompts, params: BeamSearchParams, lora_request: LoRARequestArg = None,
                    use_tqdm: UseTqdm = False) -> list[BeamSearchOutput]:
        """The `params.beam_width` best completions of each prompt by beam search, best
        first, one `BeamSearchOutput` per prompt in input order (vLLM's `LLM.beam_search`).

        The beams run in the continuous batch as sequences of their own: they share the
        prompt's KV blocks and every block they have in common, and a beam that
        diverges copies only its partial last block. Beams are chosen as transformers'
        `generate(num_beams=..., do_sample=False)` chooses them (see `BeamSearchParams`).
        A prompt is a string, {"prompt": str} or {"prompt_token_ids": [int, ...]};
        `lora_request` is one adapter for all prompts or one per prompt.

        Raises:
            ValueError: before any work starts, listing every bad row (index, field,
                reason and what to do).
        """
        return _in_order(self.beam_search_as_completed(prompts, params, lora_request=lora_request, use_tqdm=use_tqdm))

    def beam_search_as_completed(self, prompts: Prompts, params: BeamSearchParams,
                                 lora_request: LoRARequestArg = None, use_tqdm: UseTqdm = False
                                 ) -> "CompletedRequests":
        """Like `beam_search`, but hands each prompt's beams over as soon as its search ends,
        as `(index, BeamSearchOutput)` pairs (see `generate_as_completed`).

        Raises:
            ValueError: as `beam_search`, before any work starts.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        self._require_task(None, "beam_search")
        requests = valid_requests(RequestChecker(self.llm_engine).check_beam_search(prompts, params, lora_request))
        return CompletedRequests(self._run(requests, use_tqdm), len(requests))

    def embed(self, prompts: Prompts, pooling_params: PoolingParams | None = None, *, use_tqdm: UseTqdm = True,
              lora_request: LoRARequestArg = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's `LLM.embed`): the model's
        pooled final hidden states (its pooling type: the last token's, the mean, or the
        first token's), unit length unless `pooling_params.normalize` is False or the
        model's sentence-transformers modules leave it unnormalised. The prompts are
        batched by the scheduler like any prefill (chunked, and prefix-cached for last-token
        pooling).

        Raises:
            ValueError: the model is not an embedding model (load a generative checkpoint
                with runner="pooling" to embed with it); before any work starts, every
                bad row (index, field, reason and what to do).
        """
        return _in_order(self.embed_as_completed(prompts, pooling_params, use_tqdm=use_tqdm,
                                                 lora_request=lora_request))

    def embed_as_completed(self, prompts: Prompts, pooling_params: PoolingParams | None = None, *,
                           use_tqdm: UseTqdm = True, lora_request: LoRARequestArg = None) -> "CompletedRequests":
        """Like `embed`, but hands each embedding over as soon as it is computed, as
        `(index, EmbeddingRequestOutput)` pairs (see `generate_as_completed`).

        Raises:
            ValueError: as `embed`, before any work starts.
        """
        self._require_task("embed", "embed")
        return self._pool_as_completed(prompts, pooling_params, use_tqdm, lora_request)

    def validate_pooling(self, prompts: SequenceABC[PromptType], lora_request: LoRARequestArg = None
                         ) -> list[str | None]:
        """Checks prompts to embed or classify without running them: for each row, its
        problems as one line, or None when it is fine (see `validate`)."""
        rows = RequestChecker(self.llm_engine).check_pooling(prompts, None, lora_request)
        return [row.problem for row in rows]

    def _placeholder(self, modality: str) -> str | None:
        """The text that stands for one item of `modality` in a prompt; None for a model that
        does not read it."""
        processor = self.llm_engine.mm_processor
        return processor.placeholders.get(modality) if processor is not None else None

    @property
    def image_placeholder(self) -> str | None:
        """The text that stands for one image in a prompt of this model ("<image>"); None
        for a model that reads no images."""
        return self._placeholder("image")

    @property
    def image_limits(self) -> ImageLimits:
        """What an image may be for this model, checked on its header before it is decoded:
        the decode budget in pixels and the aspect ratio its image processor takes (the
        engine's default budget for a model that reads no images)."""
        processor = self.llm_engine.mm_processor
        return processor.limits if processor is not None and "image" in processor.modalities else ImageLimits()

    @property
    def audio_placeholder(self) -> str | None:
        """The text that stands for one audio clip in a prompt of this model
        ("<|audio_bos|><|AUDIO|><|audio_eos|>"); None for a model that reads no audio."""
        return self._placeholder("audio")

    @property
    def audio_limits(self) -> AudioLimits | None:
        """What a clip may be for this model (its feature extractor's rate, the longest clip
        it takes); None for a model that reads no audio."""
        processor = self.llm_engine.mm_processor
        return processor.audio_limits if processor is not None else None

    @property
    def video_placeholder(self) -> str | None:
        """The text that stands for one video in a prompt of this model
        ("<|vision_start|><|video_pad|><|vision_end|>"); None for a model that reads no video."""
        return self._placeholder("video")

    @property
    def video_limits(self) -> VideoLimits | None:
        """What a video may be for this model (frames per file second sampled, frame counts, the
        per-frame decode budget, the resize to its grid), as `read_video` takes them; None for a
        model that reads no video."""
        processor = self.llm_engine.mm_processor
        return processor.video_limits if processor is not None else None

    @property
    def max_num_seqs(self) -> int:
        """The most sequences in one step (a beam search's beams count one each)."""
        return self.llm_engine.config.max_num_seqs

    @property
    def task(self) -> str:
        """What the model does: "generate" (text), "embed" or "classify" (a pooling model)."""
        pooler = self.llm_engine.model_config.pooler
        return "generate" if pooler is None else pooler.task

    @property
    def hidden_size(self) -> int:
        """The width of the model's hidden states: an embedding's dimension."""
        return self.llm_engine.model_config.hf_config.hidden_size

    def classify(self, prompts: Prompts, *, use_tqdm: UseTqdm = True,
                 lora_request: LoRARequestArg = None) -> list[ClassificationRequestOutput]:
        """Class probabilities of each prompt, in input order (vLLM's `LLM.classify`) from a
        sequence-classification checkpoint: a softmax over its labels (a sigmoid for a
        single label).

        Raises:
            ValueError: the model is not a classifier; before any work starts, every bad row.
        """
        self._require_task("classify", "classify")
        return self._pool(prompts, None, use_tqdm, lora_request)

    def score(self, text_1: str | list[str], text_2: str | list[str], *, use_tqdm: UseTqdm = True,
              lora_request: LoRARequestArg = None) -> list[ScoringRequestOutput]:
        """How well each text of `text_2` matches its text of `text_1` (vLLM's `LLM.score`):
        one `text_1` is paired with every `text_2`, else they pair up in order. An
        embedding model scores the cosine of the two embeddings; a cross-encoder (a
        classifier with one label) reads each pair as one input (the tokenizer's pair
        encoding) and scores the sigmoid of its logit.

        Raises:
            ValueError: lists of different lengths, an empty list, or a model that neither
                embeds nor is a one-label classifier.
        """
        pairs = score_pairs(text_1, text_2)
        pooler = self._require_task(None, "score", pooling=True)
        if pooler.task == "classify":
            inputs = cross_encoder_inputs(self.llm_engine.tokenizer, pairs, pooler.num_labels)
            return cross_encoder_scores(self._pool(inputs, None, use_tqdm, lora_request))
        adapters = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(pairs.firsts)
        return cosine_scores(self._pool(pairs.firsts + pairs.seconds, None, use_tqdm, list(adapters) * 2))

    def _pool(self, prompts: Prompts, params: PoolingParams | None, use_tqdm: UseTqdm,
              lora_request: LoRARequestArg) -> list:
        return _in_order(self._pool_as_completed(prompts, params, use_tqdm, lora_request))

    def _pool_as_completed(self, prompts: Prompts, params: PoolingParams | None, use_tqdm: UseTqdm,
                           lora_request: LoRARequestArg) -> "CompletedRequests":
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        requests = valid_requests(RequestChecker(self.llm_engine).check_pooling(prompts, params, lora_request))
        return CompletedRequests(self._run(requests, use_tqdm), len(requests))

    def _require_task(self, task: str | None, call: str, pooling: bool = False) -> PoolerConfig | None:
        """The model's pooler, when `call` can run on it: `task` names the pooling task it
        needs, None with `pooling` any pooling model, None without a generative model.

        Raises:
            ValueError: the model does not do what `call` needs, saying how to load one that does.
        """
        pooler = self.llm_engine.model_config.pooler
        if task is None and not pooling:
            if pooler is not None:
                raise ValueError(f"{call}: this model pools (runner='pooling', {pooler.task}): call "
                                 f"{'embed or score' if pooler.task == 'embed' else 'classify or score'}, or load a "
                                 "causal LM with runner='generate'")
            return None
        if pooler is None:
            raise ValueError(f"{call}: this model generates text; load an embedding or classification model, or "
                             "this one with LLM(model, runner='pooling') to embed with its hidden states")
        if task is not None and pooler.task != task:
            raise ValueError(f"{call}: this model's task is {pooler.task!r}, not {task!r}: call "
                             f"{pooler.task} or score")
        return pooler

    def validate(self, prompts: SequenceABC[PromptType], sampling_params: SamplingParamsArg = None,
                 lora_request: LoRARequestArg = None, priority: PriorityArg = None) -> list[str | None]:
        """Checks requests without running them: for each row, its problems as one line
        ("field: reason and what to do"; several joined by "; "), or None when it is fine.

        Raises:
            ValueError: when the arguments as a whole do not fit (list lengths).
        """
        rows = RequestChecker(self.llm_engine).check(prompts, sampling_params, lora_request, priority)
        return [row.problem for row in rows]

    def _run(self, requests: list[Request], use_tqdm: UseTqdm) -> Iterator[tuple[int, RequestOutput]]:
        """Runs the requests (dealt out over the data-parallel replicas, this process's
        engine being the first), yielding each one's output as it finishes."""
        if not requests:
            return
        engine, pool = self.llm_engine, self._replicas
        ids = [str(next(self._request_ids)) for _ in requests]
        shares = [list(range(len(requests)))] if pool is None else deal(
            requests, len(pool.replicas) + 1, engine.model_config.max_model_len)
        call, busy = 0, set()
        if pool is not None:
            call = pool.start_call([[(i, ids[i], requests[i]) for i in share] for share in shares[1:]])
            busy = {position for position, share in enumerate(shares[1:]) if share}
        index_of = {}
        for i in shares[0]:
            requests[i].submit(engine, ids[i])
            index_of[ids[i]] = i
        progress = ProgressBar(use_tqdm, len(requests))
        try:
            while engine.has_unfinished_requests() or busy:
                finished = []
                if engine.has_unfinished_requests():
                    finished = [(index_of[seq.request_id], engine.output(seq))
                                for seq in engine.step_requests()]
                if busy:  # a look at the replicas between steps; a wait once this engine is done
                    for position, report in pool.reports(call, 0 if engine.has_unfinished_requests() else None):
                        finished += report.finished
                        if report.done:
                            busy.discard(position)
                progress.update([output for _, output in finished])
                yield from finished
        except BaseException:  # GeneratorExit included: the caller stopped early
            engine.abort_all()
            if busy:
                pool.abort(call, busy)
            raise
        finally:
            progress.close()

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes (of every replica); returns False while requests are running."""
        done = self.llm_engine.block_manager.reset_prefix_cache()
        return (self._replicas is None or self._replicas.reset_prefix_cache()) and done

    def close(self) -> None:
        """Frees the model and the KV cache and stops the engine's other processes; the
        LLM cannot be used afterwards."""
        if self._replicas is not None:
            self._replicas.close()
            self._replicas = None
        if self._llm_engine is not None:
            self._llm_engine.release()  # and detaches its finalizer: the collection below is the one
            self._llm_engine = None
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


def _in_order(finished: CompletedRequests) -> list:
    """The outputs of finished requests in their prompts' order."""
    outputs: list = [None] * len(finished)
    for index, output in finished:
        outputs[index] = output
    return outputs


def _settings_doc() -> str:
    """`LLM.__init__`'s docstring, from the settings' own descriptions."""
    lines = ["Loads the model and sizes the KV cache.", "", "Args:"]
    for setting in engine_settings():
        lines.append(f"    {setting.name} (default {setting.default!r}): {setting.metadata['help']}")
    return "\n".join(lines)


LLM.__init__.__doc__ = _settings_doc()
