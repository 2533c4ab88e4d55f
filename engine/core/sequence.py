"""A request's state inside the engine: its tokens, its progress and its blocks."""

import enum
import time
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


class Sequence:
    """One generation in flight.

    `token_ids` holds the prompt followed by the generated tokens. `num_computed_tokens`
    counts the leading tokens whose keys and values sit in the KV cache; the scheduler
    advances it chunk by chunk, so prefill and decode are the same operation. When the
    count reaches `num_tokens`, the step's logits at the last token yield the next token.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        index: int = 0,
        lora_request: LoRARequest | None = None,
        multi_modal: "ProcessedPrompt | None" = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.lora_request = lora_request
        # The prompt's images (by position) and, for M-RoPE models, its [3, prompt] rotary
        # positions and the offset of the generated tokens' positions.
        self.multi_modal = multi_modal
        self.mm_features: list["MultiModalFeature"] = multi_modal.features if multi_modal is not None else []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens sampled on the device but not yet read back (asynchronous scheduling: at
        # most one). The scheduler counts them as present; the model runner takes them
        # from the device as input ids.
        self.num_pending_tokens = 0
        # Prompt plus the most tokens it may generate (set by the engine).
        self.max_num_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.num_registered_blocks = 0
        # (parent key's hash, token ids) of each full block, filled in by the BlockManager.
        self.block_keys: list[tuple[int | None, tuple[int, ...]]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        # The seed of the completion's draws when its request has one, set by the engine
        # (`engine.sample.sampler.seeded_uniform`).
        self.seed: int | None = None
        # n > 1: completion `index` of its request; the parent (index 0) forks the other
        # n - 1 once its prompt is computed. `group` is shared by all of them.
        self.index = index
        self.num_pending_children = sampling_params.n - 1 if index == 0 else 0
        self.group: list[Sequence] = [self]
        # A beam of a beam-search request: its group decides its next token (set by the engine).
        self.beam: BeamGroupState | None = None
        # A pooling request's settings (set by the engine), and the output once its prompt is computed.
        self.pooling: "PoolingParams | None" = None
        self.pooled: list[float] | None = None
        # Every prompt position is computed (none taken from the prefix cache): prompt
        # logprobs read them all, and so does a MEAN or CLS pooling (set by the engine).
        self.computes_whole_prompt = sampling_params.prompt_logprobs is not None
        self.bad_words_ids: list[list[int]] = []
        # Whether its logits are processed before sampling (set by the engine).
        self.processes_logits = False
        # Where the completion stands in its structured-output grammar, set by the engine.
        self.grammar: "StructuredOutputGrammar | None" = None
        # Its text, logprobs, stops and reasoning, kept by the output processor (a completion's
        # or a beam's: `OutputProcessor.start`).
        self.output: "OutputState | None" = None
        # With speculative decoding: its proposals and its proposer's state (set by the proposer).
        self.spec: SpeculationState | None = None

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
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def request_finished(self) -> bool:
        """Whether every completion of this sequence's request is done (none left to fork)."""
        return all(s.is_finished for s in self.group) and not self.group[0].num_pending_children

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
