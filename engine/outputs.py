"""What `LLM.generate` returns: vLLM's `RequestOutput` and `CompletionOutput`."""

from dataclasses import dataclass, fields

from engine.lora.request import LoRARequest


@dataclass
class Logprob:
    """A token's log-probability under the model's raw logits, its rank among all
    tokens (1 = most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FunctionCall:
    """The function a tool call names and its arguments, a JSON object's text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass
class ToolCall:
    """One call of a tool in a completion, as OpenAI's `tool_calls` entries:
    {"id": "call_...", "type": "function", "function": {"name": ..., "arguments": "{...}"}}."""

    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    `finish_reason` is "stop" (EOS, a stop token or a stop string) or "length"
    (`max_tokens` or the model's context reached); `stop_reason` names the stop string
    or stop token id that fired, and is None for EOS and for "length". `lora_request` is
    the adapter it ran with (None: the base model).

    With a reasoning parser (the engine's `reasoning_parser`), `reasoning` holds the
    model's reasoning section (vLLM's `reasoning_content`; None: the completion has none)
    and `text` the answer after it; `num_reasoning_tokens` counts the reasoning's tokens,
    its markers included, and `reasoning_ended` says whether the section was closed (False:
    the completion stopped while reasoning, and `text` holds only what it wrote before
    opening the section, usually nothing). With a tool-call parser
    (`tool_call_parser`), the calls found in the answer are in `tool_calls` (None: none)
    and `text` keeps what the model wrote besides them; a call that does not parse is named
    in `tool_call_error` and loses nothing: the calls that parse stay in `tool_calls`, a named
    call whose arguments are not a JSON object is there too (its arguments as written), and a
    call that cannot be read stays in `text` as the model wrote it.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    lora_request: LoRARequest | None = None
    reasoning: str | None = None
    num_reasoning_tokens: int = 0
    reasoning_ended: bool | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (from `time.monotonic()`) of a request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The result for one prompt, in the order the prompts were given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class UnfinishedOutput:
    """A completion still queued or running: the tokens it has generated so far and the
    most it may generate (its max_tokens, or what the model's context leaves)."""

    num_generated_tokens: int
    max_tokens: int


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    """vLLM's output of `LLM.embed` for one prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    """vLLM's output of `LLM.classify` for one prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    """vLLM's output of `LLM.score` for one pair of texts."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


PoolingRequestOutput = EmbeddingRequestOutput | ClassificationRequestOutput


@dataclass
class TranscriptionWindow:
    """One window of a transcribed clip (`LLM.transcribe`): its span in the clip, in seconds,
    and what the model wrote for it."""

    start_s: float
    end_s: float
    text: str
    token_ids: list[int]


@dataclass
class TranscriptionOutput:
    """A clip's transcript (`LLM.transcribe`): its windows' texts joined in order without a
    separator (as vLLM's transcription endpoint joins them), the windows, their token ids in
    order, the clip's duration and its language (as given, or as detected)."""

    text: str
    windows: list[TranscriptionWindow]
    token_ids: list[int]
    duration_s: float
    language: str


@dataclass
class EngineStats:
    """Counters since the engine started: what was computed, and how often it had to redo work."""

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_images_encoded: int = 0  # vision-encoder runs, one per image (its output is then cached)
    num_audios_encoded: int = 0  # audio-encoder runs, one per clip (likewise)
    num_videos_encoded: int = 0  # vision-encoder runs on videos, one per distinct video
    # Speculative decoding: verifications of a sequence's proposals, the tokens proposed in
    # them, and those accepted (vLLM's num_drafts, num_draft_tokens, num_accepted_tokens).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens (None before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification adds on average: its accepted proposals plus the one the
        model samples after them (None before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def __add__(self, other: "EngineStats") -> "EngineStats":
        """Both engines' counters summed (data-parallel replicas)."""
        return EngineStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(EngineStats)))
