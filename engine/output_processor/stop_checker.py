"""Whether a completion ends with the token just appended, and why (vLLM v0's
`engine/output_processor/stop_checker.py`): its grammar complete, or refusing the token; a
stop token or a stop string once it has min_tokens; its length limit."""

import logging

from engine.core.sequence import Sequence
from engine.output_processor.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StopChecker:
    """Sets a completion's `finish_reason` (and `stop_reason`) when its newest token ends it;
    `eos_token_ids` are the model's, which a stop reports as no `stop_reason` of its own."""

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids

    @staticmethod
    def grammar_ends(seq: Sequence, token: int) -> bool:
        """Advances the completion's grammar by `token`; finishes it ("stop") once the grammar
        is complete. A token the grammar refuses (every token was masked: a clash with other
        settings such as allowed_token_ids) ends it too, as "abort"."""
        if not seq.grammar.accept(token):
            logger.warning("request %s: its grammar refused token %d; the completion stops there",
                           seq.request_id, token)
            seq.finish_reason = "abort"
        elif seq.grammar.is_terminated:
            seq.finish_reason = "stop"
        return seq.finish_reason is not None

    def check(self, seq: Sequence, token: int, delta: str) -> None:
        """Finishes the completion when `token` is a stop token, or `delta` (the text it added;
        "" where the text is decoded only at the end) completes a stop string, once it has
        min_tokens; or when it has as many tokens as it may have."""
        params = seq.sampling_params
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= params.min_tokens:
            if token in seq.output.stop_token_ids:
                seq.finish_reason = "stop"
                if params.ignore_eos or token not in self.eos_token_ids:
                    seq.stop_reason = token
            elif params.stop and (stop := find_stop(seq.output.detokenizer, delta, params)):
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and num_tokens >= seq.max_num_tokens:
            seq.finish_reason = "length"


def find_stop(detokenizer: IncrementalDetokenizer, delta: str, params: SamplingParams) -> str | None:
    """The first stop string that the newest text completes; cuts the text before it
    (after it with `include_stop_str_in_output`)."""
    if not delta:
        return None
    text = detokenizer.text
    window_start = max(0, len(text) - len(delta) - max(len(s) for s in params.stop) + 1)
    found = [(text.find(s, window_start), s) for s in params.stop]
    found = [(i, s) for i, s in found if i >= 0]
    if not found:
        return None
    index, stop = min(found)
    detokenizer.text = text[: index + len(stop)] if params.include_stop_str_in_output else text[:index]
    return stop
