"""Request checks: the rows of a `generate` call turned into requests the engine can run,
or into the text of each bad row's problems ("field: reason and what to do"), before any
work starts."""

from collections import Counter
from collections.abc import Callable, Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

from PIL import Image

from engine.beam_search import BeamSearchParams
from engine.config import DEFAULT_LIMIT_MM_PER_PROMPT
from engine.entrypoints.chat_utils import READERS, invalid_unicode_problem
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.models import ENCODER_DECODER_MODELS, MULTIMODAL_MODELS
from engine.multimodal.audio import AudioInputError, read_audio
from engine.multimodal.image import ImageInputError, read_image
from engine.multimodal.inputs import ProcessedPrompt
from engine.multimodal.processing import ITEM_NOUNS, BaseMultiModalProcessor, MultiModalInputError, PromptItem
from engine.multimodal.video import VideoInputError, read_video
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams, logprobs_count
from engine.tool_parsers.request_tools import RequestTools

PromptType = str | dict[str, Any]
# The per-call arguments of `LLM.generate` and its siblings: one value for every prompt or one per prompt.
Prompts = PromptType | SequenceABC[PromptType]
SamplingParamsArg = SamplingParams | SequenceABC[SamplingParams] | None
LoRARequestArg = LoRARequest | SequenceABC[LoRARequest | None] | None
PriorityArg = int | SequenceABC[int] | None
UseTqdm = bool | Callable[..., Any]


def _architectures_reading(modality: str) -> str:
    """The multimodal and encoder-decoder architectures that read `modality`, by name."""
    return ", ".join(sorted(name for name, model in {**MULTIMODAL_MODELS, **ENCODER_DECODER_MODELS}.items()
                            if modality in model.processor_class.modalities))


# How a row gets a model that reads a modality its model does not.
_READERS = {modality: f"{how} ({_architectures_reading(modality)})" for modality, how in READERS.items()}


@dataclass
class Request:
    """A row that passed every check, ready for `LLMEngine.add_request`."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    lora_request: LoRARequest | None
    beam_search: BeamSearchParams | None = None
    pooling: PoolingParams | None = None
    multi_modal: ProcessedPrompt | None = None  # its images and audio, processed (`prompt_token_ids` expanded)
    tools: RequestTools | None = None  # a chat prompt's tools and tool choice (`render_chat`)

    def submit(self, engine: LLMEngine, request_id: str) -> None:
        """Queues the request on `engine` under `request_id`."""
        engine.add_request(request_id, self.prompt, self.prompt_token_ids, self.sampling_params, self.priority,
                           self.lora_request, self.beam_search, self.pooling, self.multi_modal, self.tools)


@dataclass(frozen=True)
class RowCheck:
    """One row's outcome: its `request` when it can run, else its `problem` (several joined by "; ")."""

    request: Request | None
    problem: str | None


def valid_requests(rows: list[RowCheck]) -> list[Request]:
    """The rows' requests when every row passed.

    Raises:
        ValueError: listing every bad row by index, with its problems.
    """
    problems = [f"row {i}, {row.problem}" for i, row in enumerate(rows) if row.problem is not None]
    if problems:
        raise ValueError(f"{len(problems)} invalid prompt row(s); nothing was run:\n  " + "\n  ".join(problems))
    return [row.request for row in rows]


class RequestChecker:
    """Checks a call's rows against one engine: the prompt's form, length and token ids,
    and the sampling settings against the engine's limits (context, KV cache, max_num_seqs,
    max_logprobs, the vocabulary, structured outputs, LoRA)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_len = engine.model_config.max_model_len
        self.vocab = engine.model_config.hf_config.vocab_size
        self._adapter_problems: dict[LoRARequest, str | None] = {}  # each adapter is read once per call

    def check(self, prompts: SequenceABC[PromptType], sampling_params: SamplingParamsArg,
              lora_request: LoRARequestArg, priority: PriorityArg) -> list[RowCheck]:
        """Each row as a ready `Request`, or as the text of its problems.

        Raises:
            ValueError: when the arguments as a whole do not fit (list lengths).
        """
        return self._check(prompts, sampling_params, lora_request, priority)

    def check_beam_search(self, prompts: SequenceABC[PromptType], params: BeamSearchParams,
                          lora_request: LoRARequestArg) -> list[RowCheck]:
        """Each row as a ready beam-search `Request`, or as the text of its problems.

        Raises:
            ValueError: when the arguments as a whole do not fit (list lengths, a
                beam_width above max_num_seqs).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search() takes BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.engine.config.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} beams run side by side, but max_num_seqs is "
                             f"{self.engine.config.max_num_seqs}: lower beam_width or raise max_num_seqs")
        rows = self._check(prompts, params.sampling_params(), lora_request, None, kind="beam_search")
        for row in rows:
            if row.request is not None:
                row.request.beam_search = params
        return rows

    def check_pooling(self, prompts: SequenceABC[PromptType], params: PoolingParams | None,
                      lora_request: LoRARequestArg) -> list[RowCheck]:
        """Each row as a ready pooling `Request` (a prompt to embed or classify), or as
        the text of its problems.

        Raises:
            ValueError: when the arguments as a whole do not fit (list lengths, params
                that are not PoolingParams).
        """
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params: expected PoolingParams, got {type(params).__name__}")
        rows = self._check(prompts, SamplingParams(max_tokens=1), lora_request, None, kind="pooling")
        for row in rows:
            if row.request is not None:
                row.request.pooling = params
        return rows

    def _check(self, prompts: SequenceABC[PromptType], sampling_params: SamplingParamsArg,
               lora_request: LoRARequestArg, priority: PriorityArg,
               kind: str = "generate") -> list[RowCheck]:
        prompts = list(prompts)
        problems: list[str] = []
        params_list = _per_prompt("sampling_params", sampling_params, len(prompts), problems)
        adapters = _per_prompt("lora_request", lora_request, len(prompts), problems)
        priorities = _per_prompt("priority", priority, len(prompts), problems)
        if problems:
            raise ValueError("generate() was called with invalid arguments; nothing was run:\n  " + "\n  ".join(problems))
        if any(params is None for params in params_list):
            defaults = SamplingParams(**self.engine.model_config.sampling_defaults)
            params_list = [defaults if params is None else params for params in params_list]
        return [self._check_row(*row, kind) for row in zip(prompts, params_list, adapters, priorities)]

    def _check_row(self, prompt: Any, params: Any, adapter: Any, priority: Any, kind: str = "generate") -> RowCheck:
        priority = 0 if priority is None else priority
        found = self._argument_problems(params, adapter, priority)
        if (bad_text := invalid_unicode_problem(prompt)) is not None:
            return RowCheck(None, "; ".join([*found, bad_text]))
        if not isinstance(params, SamplingParams):
            params = SamplingParams()  # the prompt is still checked, against the defaults
        prompt, problem = self._encoder_decoder_prompt(prompt)
        if problem is not None:
            return RowCheck(None, "; ".join([*found, problem]))
        text, ids = self._tokenize(prompt)
        items, problem = self._multimodal(prompt, ids)
        if items is not None:
            ids = items.prompt_token_ids
        cross_rows = sum(f.num_embeds for f in items.cross) if items is not None else 0
        if (problem := problem or _prompt_problem(prompt, ids, self.max_len, self.vocab, items)
                or self._params_problem(ids, params, kind, cross_rows)
                or self._positions_problem(ids, params, items)):
            found.append(problem)
        if found:
            return RowCheck(None, "; ".join(found))
        return RowCheck(Request(text, ids, params, priority, adapter, multi_modal=items,
                                tools=RequestTools.of_prompt(prompt)), None)

    def _encoder_decoder_prompt(self, prompt: Any) -> tuple[Any, str | None]:
        """vLLM's explicit encoder-decoder prompt, `{"encoder_prompt": {"prompt": "",
        "multi_modal_data": ...}, "decoder_prompt": text or {"prompt": ...} or
        {"prompt_token_ids": ...}}`, as the one prompt dict the checks read (the decoder's prompt
        with the encoder's items); any other prompt as given. Or why it cannot be read that way:
        a decoder-only model, an encoder prompt with text (Whisper's encoder reads audio only),
        a decoder prompt of another form."""
        if not isinstance(prompt, dict) or not {"encoder_prompt", "decoder_prompt"} & set(prompt):
            return prompt, None
        processor = self.engine.mm_processor
        if processor is None or processor.cross_modality is None:
            return prompt, ("encoder_prompt: the model is a decoder: give {'prompt': ..., 'multi_modal_data': ...} "
                            "without encoder_prompt and decoder_prompt")
        encoder, decoder = prompt.get("encoder_prompt"), prompt.get("decoder_prompt")
        if not isinstance(encoder, dict) or encoder.get("prompt") or encoder.get("prompt_token_ids"):
            return prompt, (f"encoder_prompt: expected {{'prompt': '', 'multi_modal_data': {{'{processor.cross_modality}'"
                            f": ...}}}}: the encoder reads the {processor.cross_modality} alone")
        if isinstance(decoder, str):
            decoder = {"prompt": decoder}
        if not isinstance(decoder, dict):
            return prompt, ("decoder_prompt: expected the decoder's prompt, a str or {'prompt': str} or "
                            f"{{'prompt_token_ids': [int, ...]}}, got {type(decoder).__name__}")
        return {**decoder, "multi_modal_data": encoder.get("multi_modal_data")}, None

    def _multimodal(self, prompt: Any, ids: list[int] | None) -> tuple[ProcessedPrompt | None, str | None]:
        """The prompt's images, audio clips and videos processed into its token ids (None: a
        prompt without any), or the problem with them: a modality the model does not read,
        more items than limit_mm_per_prompt, an item that does not read or is outside the
        model's limits, one its processor refuses, placeholders and items that do not pair
        up. What the model cannot take is refused before any item is read."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        processor = self.engine.mm_processor
        if ids is not None and data is None and processor is not None and processor.cross_modality is not None:
            modality = processor.cross_modality
            return None, (f"multi_modal_data: {self.engine.model_config.hf_config.model_type} generates from "
                          f"{modality} only: give one {ITEM_NOUNS[modality]}, as "
                          f"multi_modal_data={{'{modality}': ...}}")
        if ids is None or (data is None and (processor is None
                                             or not set(processor.placeholder_ids.values()).intersection(ids))):
            return None, None
        given, problem = self._given_items({} if data is None else data, processor)
        if problem is not None or (not given and processor is None):
            return None, problem
        items: dict[str, list[PromptItem]] = {}
        # Each modality's reader and the processor's limits for it (only a family that reads
        # images has image limits).
        readers = {"image": (read_image, "limits"), "audio": (read_audio, "audio_limits"),
                   "video": (read_video, "video_limits")}
        for modality, values in given.items():
            read, limits = readers[modality][0], getattr(processor, readers[modality][1])
            items[modality] = []
            for i, value in enumerate(values):
                try:
                    items[modality].append(read(value, limits))
                except (ImageInputError, AudioInputError, VideoInputError) as exc:
                    return None, f"multi_modal_data['{modality}'][{i}]: {exc}"
        try:
            return processor.apply(ids, items), None
        except MultiModalInputError as exc:
            return None, str(exc)

    def _given_items(self, data: Any, processor: BaseMultiModalProcessor | None) -> tuple[dict[str, list], str | None]:
        """`multi_modal_data`'s items as given, a list per modality, or why the row cannot
        have them: not a dict of known modalities, a modality the model does not read, more
        items than limit_mm_per_prompt allows. An image list may be a tuple; an audio tuple
        is one clip, vLLM's (waveform, sample_rate); a video tuple is one video, vLLM's
        (frames, metadata), and so is a list of PIL images (its frames)."""
        if not isinstance(data, dict) or set(data) - set(DEFAULT_LIMIT_MM_PER_PROMPT):
            keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
            return {}, ("multi_modal_data: expected {'image': an image or a list of images, 'audio': a clip or a list "
                        f"of clips, 'video': a video or a list of videos}} (any of the keys), got {keys}")
        reads = processor.modalities if processor is not None else ()
        given = {}
        for modality, value in data.items():
            noun = ITEM_NOUNS[modality]
            if modality not in reads:
                return {}, _unread_problem(modality, processor)
            given[modality] = _item_list(modality, value)
            limit = self.engine.config.max_items_per_prompt(modality)
            if len(given[modality]) > limit:
                return {}, (f"multi_modal_data: holds {len(given[modality])} {noun}s, but limit_mm_per_prompt allows "
                            f"{limit}: use fewer {noun}s, or raise LLM(limit_mm_per_prompt={{'{modality}': n}})")
        return given, None

    def _argument_problems(self, params: Any, adapter: Any, priority: Any) -> list[str]:
        """The row's adapter, sampling params and priority that cannot be used as given."""
        found = []
        if not isinstance(adapter, (LoRARequest, type(None))):
            found.append(f"lora_request: expected a LoRARequest or None, got {type(adapter).__name__}")
        elif adapter is not None and (problem := self._adapter_problem(adapter)):
            found.append(f"lora_request: {problem}")
        if not isinstance(params, SamplingParams):
            found.append(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int):
            found.append(f"priority: expected an integer, got {priority!r}")
        return found

    def _params_problem(self, ids: list[int], params: SamplingParams, kind: str = "generate",
                        cross_rows: int = 0) -> str | None:
        """The first way the sampling settings do not fit the engine with this prompt, or
        None. `kind` is "generate", "beam_search" (its candidates are not logprobs the
        caller asked for, so max_logprobs does not bound them) or "pooling" (the prompt
        alone is computed). `cross_rows`: an encoder-decoder prompt's encoder rows, whose
        cross-attention keys and values take whole blocks of the same cache."""
        engine, vocab = self.engine, self.vocab
        if kind == "pooling":
            return None if len(ids) <= engine.kv_cache_tokens else (
                f"prompt: needs {len(ids)} tokens of KV cache, which holds {engine.kv_cache_tokens}: shorten it "
                "or raise kv_cache_memory / gpu_memory_utilization")
        needed = len(ids) + params.max_output_tokens(len(ids), self.max_len)
        if any(t >= vocab for t in params.token_ids()):
            return (f"sampling_params: stop_token_ids, logit_bias or allowed_token_ids name ids "
                    f"outside the vocabulary [0, {vocab}): fix the ids")
        block = engine.config.block_size if cross_rows else 1
        cross = -(-cross_rows // block) * block
        if needed + cross > engine.kv_cache_tokens:
            what = f"prompt plus max_tokens needs {needed}" + (f" and its encoder rows {cross}" if cross else "")
            return (f"max_tokens: {what} tokens of KV cache, which holds {engine.kv_cache_tokens}: lower "
                    "max_tokens or raise kv_cache_memory / gpu_memory_utilization")
        if params.n > engine.config.max_num_seqs:
            return (f"sampling_params: n={params.n} completions run side by side, but max_num_seqs is "
                    f"{engine.config.max_num_seqs}: lower n or raise max_num_seqs")
        if kind == "generate" and (problem := self._logprobs_problem(params)) is not None:
            return problem
        if params.structured_outputs is not None and (problem := self._structured_problem(params)):
            return f"structured_outputs: {problem}"
        return None

    def _positions_problem(self, ids: list[int], params: SamplingParams,
                           items: ProcessedPrompt | None) -> str | None:
        """Why the row's last token would take a rotary position past the decoder's tables, or
        None: a prompt whose items' positions run ahead of its tokens (a Qwen2.5-VL video's,
        in time) moves every generated token's position on as far."""
        limit = self.engine.mm_processor.max_position if items is not None else None
        if limit is None or items.rope_delta <= 0:
            return None
        last = len(ids) + params.max_output_tokens(len(ids), self.max_len) - 1 + items.rope_delta
        if last < limit:
            return None
        return (f"max_tokens: the prompt's items put its rotary positions {items.rope_delta} ahead of its tokens, "
                f"so its last token would take position {last}, past the model's {limit} (max_position_embeddings): "
                "lower max_tokens, or give shorter videos (fewer frames, or a lower fps)")

    def _logprobs_problem(self, params: SamplingParams) -> str | None:
        """Why the request asks for more logprobs per token than `max_logprobs` allows, or None."""
        limit = logprobs_count(self.engine.config.max_logprobs, self.vocab)
        for name in ("logprobs", "prompt_logprobs"):
            asked = logprobs_count(getattr(params, name), self.vocab)
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

    def _adapter_problem(self, adapter: LoRARequest) -> str | None:
        """Why the adapter cannot run (reading it into host memory to find out), or None."""
        if adapter not in self._adapter_problems:
            try:
                self.engine.add_lora(adapter)
                self._adapter_problems[adapter] = None
            except ValueError as exc:  # LoRAError included
                self._adapter_problems[adapter] = str(exc)
        return self._adapter_problems[adapter]

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int] | None]:
        """The prompt's text and token ids; ids are None for a prompt of an unknown form."""
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            return None, None
        processor = self.engine.mm_processor
        special = processor.add_special_tokens if processor is not None else True
        return text, self.engine.tokenizer(text, add_special_tokens=special).input_ids if text else []


def _item_list(modality: str, value: Any) -> list:
    """A modality's `multi_modal_data` value as the list of its items."""
    if modality == "image":
        return list(value) if isinstance(value, (list, tuple)) else [value]
    if modality == "video" and isinstance(value, list) and value and all(isinstance(v, Image.Image) for v in value):
        return [value]  # one video's frames
    return list(value) if isinstance(value, list) else [value]


def _unread_problem(modality: str, processor: BaseMultiModalProcessor | None) -> str:
    """Why a row's items of `modality` cannot run on a model that does not read it."""
    if modality == "image" and processor is None:
        return f"multi_modal_data: the model reads text only: drop the images, or {_READERS['image']}"
    return (f"multi_modal_data['{modality}']: the model reads no {modality}: drop the {ITEM_NOUNS[modality]}s, or "
            f"{_READERS[modality]}")


def _prompt_problem(prompt: Any, ids: list[int] | None, max_len: int, vocab: int,
                    items: ProcessedPrompt | None = None) -> str | None:
    """What is wrong with the prompt itself (its form, length or token ids), or None."""
    if ids is None:
        return ("prompt: expected a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                f"got {type(prompt).__name__}")
    if not ids:
        return "prompt: is empty: drop the row or give it text"
    if items is not None and items.features and len(ids) >= max_len:
        item_tokens = sum(f.length for f in items.features)
        counts = Counter(f.modality for f in items.features)
        what = " and ".join(f"{n} {ITEM_NOUNS[modality]}(s)" for modality, n in counts.items())
        return (f"multi_modal_data: the prompt's {what} take {item_tokens} tokens and its text "
                f"{len(ids) - item_tokens}, {len(ids)} in all, but max_model_len is {max_len}: use fewer or "
                "smaller items, shorten the text, or raise max_model_len")
    if len(ids) >= max_len:
        return (f"prompt: has {len(ids)} tokens, but max_model_len is {max_len}: shorten it "
                f"to at most {max_len - 1} tokens, or raise max_model_len")
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        return f"prompt_token_ids: holds ids outside the vocabulary [0, {vocab}): fix the ids"
    return None


def _per_prompt(name: str, value: Any, count: int, problems: list[str]) -> list[Any]:
    """One value per prompt from a single value or a list of them."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            problems.append(f"{name}: got {len(value)} values for {count} prompts; give one per prompt or a single value")
            return [None] * count
        return list(value)
    return [value] * count
