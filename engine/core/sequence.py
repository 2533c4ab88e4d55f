"""A request's state inside the engine: its tokens, its progress and its blocks, and beside
them one record per feature it uses (its output's, its grammar, its speculation, its beam
group, its pooling, its logits' processing), made where the feature is turned on. The
worker's state of a running sequence is the worker's (`engine.worker.input_batch.BatchRow`)."""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.lora.request import LoRARequest
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.beam_search import BeamSearchOutput, BeamSearchParams
    from engine.multimodal.inputs import MultiModalFeature, ProcessedPrompt
    from engine.output_processor.state import OutputState
    from engine.pooling_params import PoolingParams
    from engine.sample.sampler import SampledToken
    from engine.structured_output.backend_types import StructuredOutputGrammar


class BeamGroupState(Protocol):
    """The beam-search request a live beam belongs to, as the scheduler and the engine read
    it through the beam (`engine.core.beam_group.BeamGroup` implements it; declared here so
    that a sequence does not import its group)."""

    params: "BeamSearchParams"
    beams: list["Sequence"]

    def report(self, beam: "Sequence", sampled: "SampledToken") -> bool:
        """Records a live beam's candidates for this step; True once every live beam has."""

    def output(self, tokenizer: "PreTrainedTokenizerBase") -> "BeamSearchOutput":
        """The finished beams, best first."""


class SpeculationState(Protocol):
    """A speculating sequence's state, as the proposer keeps it on the sequence: the tokens
    proposed for its next step (which the scheduler verifies in it, after its last token),
    and the proposer's own (`engine.spec_decode.proposer.SpecState` implements it; declared
    here so that a sequence does not import its proposer)."""

    proposal: list[int]

    def record(self, seq: "Sequence", proposed: int, accepted: int) -> None:
        """Counts a decode step of the sequence: `proposed` tokens verified, `accepted` of them accepted."""


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class SequenceBlocks:
    """The block manager's bookkeeping of a sequence (`engine.core.block_manager`): its block
    table, how many of its leading blocks are registered in the prefix cache, the key
    (parent key's hash, token ids and image hashes) of each full block found so far, and for
    an encoder-decoder model (Whisper) the blocks holding its cross-attention keys and values
    (`cross`: its encoder rows', written once, in the same pool as the decoder's)."""

    table: list[int] = field(default_factory=list)
    cross: list[int] = field(default_factory=list)
    num_registered: int = 0
    keys: list[tuple[int | None, tuple[int | str, ...]]] = field(default_factory=list)


@dataclass
class Pooling:
    """A prompt to embed or classify: its settings, whether its pooling reads every prompt
    position (MEAN and CLS do, so none is taken from the prefix cache), and its output
    vector once its prompt is computed."""

    params: "PoolingParams"
    whole_prompt: bool = False
    vector: list[float] | None = None


@dataclass(frozen=True)
class LogitsProcessing:
    """What a sequence whose logits are processed before sampling needs beyond its sampling
    params (`logits_processing`): its request's bad words as token ids."""

    bad_words_ids: list[list[int]]


def logits_processing(params: SamplingParams, bad_words_ids: list[list[int]]) -> LogitsProcessing | None:
    """The record of a request whose logits go through processors before sampling (banned or
    allowed tokens, logit bias, penalties, min_tokens); None for the others, most requests,
    whose rows the sampling-metadata builder then skips."""
    if bad_words_ids or params.min_tokens or params.allowed_token_ids or params.logit_bias or params.needs_penalties:
        return LogitsProcessing(bad_words_ids)
    return None


class Sequence:
    """One generation in flight: its request's state, and a record per feature it uses.

    `token_ids` holds the prompt followed by the generated tokens. `num_computed_tokens`
    counts the leading tokens whose keys and values sit in the KV cache; the scheduler
    advances it chunk by chunk, so prefill and decode are the same operation. When the
    count reaches `num_tokens`, the step's logits at the last token yield the next token.
    `num_pending_tokens` counts tokens sampled on the device but not yet read back
    (asynchronous scheduling: at most one); the scheduler counts them as present, the model
    runner takes them from the device as input ids. `max_num_tokens` is the prompt plus the
    most tokens it may generate (set by the engine); `num_cached_tokens` the prompt tokens
    its first admission found in the prefix cache.

    `multi_modal` holds the prompt's images (by position; `mm_features`) and, for M-RoPE
    models, its [3, prompt] rotary positions and the offset of the generated tokens'. For an
    encoder-decoder model (Whisper) it holds the clip its decoder attends to
    (`cross_features`, `cross_rows` encoder rows), which no prompt position stands for. With
    n > 1 the sequence is completion `index` of its request: the parent (index 0) forks the
    other n - 1 once its prompt is computed, and `group` is shared by all of them.
    """

    # Each feature's state is a record of its own, None where the request does not use the
    # feature and made where it is turned on.
    output: "OutputState | None" = None  # its text, stops, logprobs, reasoning (`OutputProcessor.start`)
    grammar: "StructuredOutputGrammar | None" = None  # where a structured output stands in its grammar
    spec: SpeculationState | None = None  # speculative decoding: its proposals and its proposer's state
    beam: BeamGroupState | None = None  # beam search: the group that decides its next token
    pooling: Pooling | None = None  # a prompt to embed or classify
    logits_processing: LogitsProcessing | None = None  # logits processed before sampling

    def __init__(self, seq_id: int, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, priority: int = 0, index: int = 0,
                 lora_request: LoRARequest | None = None, multi_modal: "ProcessedPrompt | None" = None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.sampling_params = sampling_params
        self.priority = priority
        self.index = index
        self.lora_request = lora_request
        self.multi_modal = multi_modal
        self.mm_features: list["MultiModalFeature"] = multi_modal.features if multi_modal is not None else []
        self.cross_features: list["MultiModalFeature"] = multi_modal.cross if multi_modal is not None else []
        self.cross_rows = sum(f.num_embeds for f in self.cross_features)
        # Every item whose encoder output the sequence reads (the scheduler's encoder work).
        self.encoder_features = self.mm_features + self.cross_features
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_num_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0
        self.blocks = SequenceBlocks()
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.num_pending_children = sampling_params.n - 1 if index == 0 else 0
        self.group: list[Sequence] = [self]

    @property
    def lora_int_id(self) -> int | None:
        """The adapter's id, or None for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position is computed (none taken from the prefix cache): prompt
        logprobs read them all, and so does a MEAN or CLS pooling."""
        pooling = self.pooling
        return self.sampling_params.prompt_logprobs is not None or (pooling is not None and pooling.whole_prompt)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def request_finished(self) -> bool:
        """Whether every completion of this sequence's request is done (none left to fork)."""
        return all(s.is_finished for s in self.group) and not self.group[0].num_pending_children

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.blocks.table})"
        )
