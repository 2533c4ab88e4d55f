"""Beam search in the continuous batch: the choice that keeps a request's best beams after
each step (the API types are in `engine.beam_search`).

A request's live beams are ordinary sequences of the batch. Each step every live beam
reports its 2 x beam_width most likely next tokens; once all of them have, `BeamGroup`
keeps the best continuations as transformers' `generate(num_beams=k, do_sample=False)`
does, and the engine carries them out on the KV cache: a beam chosen once goes on in
place, one chosen several times is forked (its blocks shared, the partial last block
copied on write when a fork first writes), and a beam not chosen is retired, its blocks
returned. So beams share their prompt and every block they have in common.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.outputs import Logprob
from engine.sample.sampler import SampledToken

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.core.sequence import Sequence


@dataclass
class Continuation:
    """A candidate next beam: `parent` extended by `token_id`, and its summed log-probability."""

    parent: "Sequence"
    token_id: int
    logprob: float
    cum_logprob: float
    candidates: dict[int, Logprob]


@dataclass(eq=False)
class BeamGroup:
    """One beam-search request's state: its live beams (sequences in the batch), the
    candidates they reported this step, and its best finished beams.

    `max_new_tokens` is the most tokens a beam may generate (max_tokens, or what the
    context leaves); `eos_token_ids` are the ids that finish a beam unless ignore_eos.
    """

    params: BeamSearchParams
    head: "Sequence"
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    beams: list["Sequence"] = field(default_factory=list)
    reports: dict["Sequence", SampledToken] = field(default_factory=dict)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False

    def report(self, beam: "Sequence", sampled: SampledToken) -> bool:
        """Records a live beam's candidates for this step; True once every live beam has."""
        self.reports[beam] = sampled
        return len(self.reports) == len(self.beams)

    def advance(self) -> list[Continuation]:
        """Chooses the step's continuations from the reports, as transformers does: of the
        2k best candidates over all beams, those of the first k that end (EOS, or the
        length limit) join the finished beams (the best k kept), and the k best that do
        not end are the next beams. Sets `done` when none are left or none can still beat
        the finished ones."""
        width = self.params.beam_width
        candidates = sorted(self._candidates(), key=lambda c: -c.cum_logprob)[: self.params.num_candidates]
        generated = self.beams[0].num_output_tokens + 1
        at_limit = generated >= self.max_new_tokens
        running = []
        for rank, candidate in enumerate(candidates):
            ends_with_eos = not self.params.ignore_eos and candidate.token_id in self.eos_token_ids
            if at_limit or ends_with_eos:
                if rank < width:
                    self._finish(candidate, generated, "stop" if ends_with_eos else "length")
            elif len(running) < width:
                running.append(candidate)
        self.reports.clear()
        self.done = not running or not self._can_improve(running[0], generated)
        return [] if self.done else running

    def _candidates(self) -> list[Continuation]:
        found = []
        for beam in self.beams:
            sampled = self.reports[beam]
            entries = {token_id: Logprob(value, rank)
                       for rank, (token_id, value) in enumerate(zip(sampled.top_ids, sampled.top_logprobs), start=1)}
            for token_id, value in zip(sampled.top_ids, sampled.top_logprobs):
                found.append(Continuation(beam, token_id, value, beam.output.cumulative_logprob + value, entries))
        return found

    def _score(self, cum_logprob: float, generated: int) -> float:
        return cum_logprob / generated ** self.params.length_penalty

    def _finish(self, candidate: Continuation, generated: int, reason: str) -> None:
        parent = candidate.parent
        self.finished.append(BeamSearchSequence(
            tokens=[*parent.token_ids, candidate.token_id],
            logprobs=[*parent.output.logprobs, candidate.candidates],
            cum_logprob=candidate.cum_logprob,
            score=self._score(candidate.cum_logprob, generated),
            finish_reason=reason,
            lora_request=parent.lora_request,
        ))
        self.finished.sort(key=lambda b: -b.score)
        del self.finished[self.params.beam_width:]

    def _can_improve(self, best: Continuation, generated: int) -> bool:
        """Whether the best live beam, scored at its present length, still beats the worst
        of a full set of finished beams (transformers' heuristic for early_stopping=False)."""
        if len(self.finished) < self.params.beam_width:
            return True
        return self._score(best.cum_logprob, generated) > self.finished[-1].score

    def output(self, tokenizer: "PreTrainedTokenizerBase") -> BeamSearchOutput:
        """The finished beams, best first, with their generated text decoded as vLLM does
        (special tokens kept; a final EOS dropped unless include_stop_str_in_output)."""
        num_prompt = self.head.num_prompt_tokens
        for beam in self.finished:
            generated = beam.tokens[num_prompt:]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = tokenizer.decode(generated)
        return BeamSearchOutput(list(self.finished))
