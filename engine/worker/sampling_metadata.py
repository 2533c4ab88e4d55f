"""Each step's per-row sampling settings (`SamplingMetadata`), built from its sequences.

The common rows (a temperature, top-p/k, min-p, a seed) cost a few list comprehensions
per step; the rows whose logits are processed (penalties, logit bias, allowed or banned
tokens, min_tokens, bad words) are flagged when their sequence is created
(`Sequence.processes_logits`) and only they are walked one by one.
"""

import torch

from engine.core.sequence import Sequence
from engine.sample.sampler import Penalties, SamplingMetadata
from engine.structured_output.manager import grammar_bitmask
from engine.worker.input_batch import upload


class SamplingMetadataBuilder:
    """Builds the step's `SamplingMetadata` on `device`."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device

    def build(self, seqs: list[Sequence]) -> SamplingMetadata:
        params = [s.sampling_params for s in seqs]
        meta = SamplingMetadata(all_greedy=all(p.greedy for p in params))
        if not meta.all_greedy:
            meta.temperatures = self._floats([p.temperature for p in params])
            meta.top_ps = self._floats([p.top_p for p in params])
            meta.top_ks = upload([max(p.top_k, 0) for p in params], torch.long, self.device)
            meta.min_ps = self._floats([p.min_p for p in params])
            meta.generators = [s.generator for s in seqs]
            meta.any_min_p = any(p.min_p > 0 for p in params)
        counts = [p.logprobs for p in params]
        if any(k is not None for k in counts):
            meta.num_logprobs = counts
        meta.grammar = grammar_bitmask([s.grammar for s in seqs])
        processed = [row for row, seq in enumerate(seqs) if seq.processes_logits]
        if processed:
            self._processors(meta, seqs, processed)
        return meta

    def _processors(self, meta: SamplingMetadata, seqs: list[Sequence], rows: list[int]) -> None:
        """Banned and allowed tokens, logit bias and penalties of the rows that have them."""
        banned, allowed, bias_rows, bias_ids, bias_values, penalized = [], [], [], [], [], []
        for row in rows:
            seq = seqs[row]
            p = seq.sampling_params
            outputs = seq.output_token_ids
            ban = [ids[-1] for ids in seq.bad_words_ids if _ends_with(outputs, ids[:-1])]
            if len(outputs) < p.min_tokens:
                ban += [*self.eos_token_ids, *p.stop_token_ids]
            if ban:
                banned.append((row, ban))
            if p.allowed_token_ids:
                allowed.append((row, p.allowed_token_ids))
            for token, value in (p.logit_bias or {}).items():
                bias_rows.append(row)
                bias_ids.append(token)
                bias_values.append(value)
            if p.needs_penalties:
                penalized.append(row)
        meta.banned = banned or None
        meta.allowed = allowed or None
        if bias_rows:
            meta.bias = (upload(bias_rows, torch.long, self.device), upload(bias_ids, torch.long, self.device),
                         self._floats(bias_values))
        if penalized:
            meta.penalties = self._penalties([seqs[r] for r in penalized], penalized)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return upload(values, torch.float32, self.device)

    def _penalties(self, seqs: list[Sequence], rows: list[int]) -> Penalties:
        vocab = self.vocab_size

        def padded(lists: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(x) for x in lists))
            return upload([x + [vocab] * (width - len(x)) for x in lists], torch.long, self.device)

        params = [s.sampling_params for s in seqs]
        return Penalties(
            rows=upload(rows, torch.long, self.device),
            prompt_ids=padded([s.token_ids[: s.num_prompt_tokens] for s in seqs]),
            output_ids=padded([s.output_token_ids for s in seqs]),
            presence=self._floats([p.presence_penalty for p in params]),
            frequency=self._floats([p.frequency_penalty for p in params]),
            repetition=self._floats([p.repetition_penalty for p in params]),
        )


def _ends_with(tokens: list[int], suffix: list[int]) -> bool:
    return not suffix or tokens[-len(suffix):] == suffix
