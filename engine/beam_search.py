"""Beam search's API types: vLLM's `BeamSearchParams`, `BeamSearchSequence` and
`BeamSearchOutput`. The engine's side, the choice that keeps a request's best beams after
each step, is `engine.core.beam_group`."""

from dataclasses import dataclass

from engine.lora.request import LoRARequest
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam-search settings.

    Beams are ranked by their summed log-probabilities; finished ones (EOS, or
    `max_tokens` or the context reached) are kept by that sum divided by
    (generated tokens) ** `length_penalty`, so a penalty above 0 favours longer
    outputs, below 0 shorter ones. Generation stops once no live beam can beat the worst
    of the `beam_width` best finished ones (transformers' `early_stopping=False`).
    `temperature` is taken for vLLM's signature: the beams are chosen from the model's
    log-probabilities, as greedy beam search does, whatever its value.
    `include_stop_str_in_output` keeps the EOS token's text in `text`.

    Raises:
        ValueError: a setting outside its range, naming it.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            problems.append(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            problems.append(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)):
            problems.append(f"length_penalty must be a number, got {self.length_penalty!r}")
        if problems:
            raise ValueError("invalid BeamSearchParams: " + "; ".join(problems))

    @property
    def num_candidates(self) -> int:
        """Continuations each beam reports per step (transformers' and vLLM's 2 x beam_width)."""
        return 2 * self.beam_width

    def sampling_params(self) -> SamplingParams:
        """What each beam runs with: one greedy step at a time, reporting its top
        candidates; the stops are the beam group's to decide."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True,
                              logprobs=self.num_candidates, detokenize=False)


@dataclass
class BeamSearchSequence:
    """One beam of a finished search, as vLLM returns it: `tokens` holds the prompt's ids
    then the generated ones, `text` the generated text only; `logprobs` has one entry
    per generated token (the candidates its parent reported); `score` is
    `cum_logprob / generated ** length_penalty`, by which the beams are ordered."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None


@dataclass
class BeamSearchOutput:
    """The `beam_width` best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
