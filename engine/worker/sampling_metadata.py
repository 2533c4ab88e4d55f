"""Each step's per-row sampling settings (`SamplingMetadata`), built from its sequences.

Everything that shapes the sampler's work is decided here, on the host, so that sampling
reads nothing back from the device: which rows are greedy, which draw inside a top-k set
or top-p nucleus (and the largest top_k), which have min-p, and the seeded rows' uniform
numbers (`seeded_uniform`). Tensors go up through `upload`, which never waits for the
device.

The common rows (a temperature, top-p/k, min-p, a seed) cost a few list comprehensions
per step; the rows whose logits are processed (penalties, logit bias, allowed or banned
tokens, min_tokens, bad words) are marked when their sequence is created (it gets a
`LogitsProcessing` record) and only they are walked one by one.
"""

import torch

from engine.core.sequence import Sequence
from engine.sample.rejection_sampler import ProposalRow
from engine.sample.sampler import DrawRows, Penalties, SamplingMetadata, TokenPairs, completion_seed, seeded_uniform
from engine.structured_output.manager import grammar_bitmask
from engine.worker.input_batch import upload


class SamplingMetadataBuilder:
    """Builds the step's `SamplingMetadata` on `device`."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device

    def build(self, seqs: list[Sequence | ProposalRow]) -> SamplingMetadata:
        params = [s.sampling_params for s in seqs]
        meta = SamplingMetadata(all_greedy=all(p.greedy for p in params))
        if not meta.all_greedy:
            self._draws(meta, seqs)
        counts = [p.logprobs for p in params]
        if any(k is not None for k in counts):
            meta.num_logprobs = counts
        # A speculating sequence's later rows see its grammar past the proposals before them.
        ahead = ([s.proposed if isinstance(s, ProposalRow) else [] for s in seqs]
                 if any(isinstance(s, ProposalRow) for s in seqs) else None)
        meta.grammar = grammar_bitmask([s.grammar for s in seqs], self.device, ahead)
        processed = [row for row, seq in enumerate(seqs) if seq.logits_processing is not None]
        if processed:
            self._processors(meta, seqs, processed)
        return meta

    def _draws(self, meta: SamplingMetadata, seqs: list[Sequence]) -> None:
        """Greedy rows, then the sampled rows in two groups: narrowed by top-k or top-p, or
        drawing over the whole vocabulary."""
        greedy, narrowed, whole = [], [], []
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            if p.greedy:
                greedy.append(row)
            elif 0 < p.top_k < self.vocab_size or p.top_p < 1:
                narrowed.append(row)
            else:
                whole.append(row)
        if greedy:
            meta.greedy_rows = upload(greedy, torch.long, self.device)
        meta.draws = [self._draw_rows([seqs[r] for r in rows], rows, is_narrowed)
                      for rows, is_narrowed in ((narrowed, True), (whole, False)) if rows]

    def _draw_rows(self, seqs: list[Sequence], rows: list[int], narrowed: bool) -> DrawRows:
        """The group's settings, in two uploads (floats and integers), each setting a row of one."""
        params = [s.sampling_params for s in seqs]
        floats = {"temperatures": [p.temperature for p in params]}
        integers = {"rows": rows}
        seeded = [p.seed is not None for p in params]
        if any(seeded):
            # A seeded row's token number i (its i-th generated) draws with uniform number i.
            floats["seeded"] = [seeded_uniform(completion_seed(p.seed, s.index), s.num_output_tokens)
                                if p.seed is not None else -1.0 for s, p in zip(seqs, params)]
        if any(p.min_p > 0 for p in params):
            floats["min_ps"] = [p.min_p for p in params]
        if narrowed:
            floats["top_ps"] = [p.top_p for p in params]
            integers["top_ks"] = [max(p.top_k, 0) for p in params]
        group = DrawRows(**_uploaded(floats, torch.float32, self.device),
                         **_uploaded(integers, torch.long, self.device), all_seeded=all(seeded))
        if narrowed:
            group.max_top_k = max(integers["top_ks"]) if all(integers["top_ks"]) else None
        return group

    def _processors(self, meta: SamplingMetadata, seqs: list[Sequence], rows: list[int]) -> None:
        """Banned and allowed tokens, logit bias and penalties of the rows that have them."""
        banned, allowed, bias, penalized = _Pairs(), _Pairs(), _Pairs(), []
        for row in rows:
            seq = seqs[row]
            p = seq.sampling_params
            outputs = seq.output_token_ids
            ban = [ids[-1] for ids in seq.logits_processing.bad_words_ids if _ends_with(outputs, ids[:-1])]
            if len(outputs) < p.min_tokens:
                ban += [*self.eos_token_ids, *p.stop_token_ids]
            banned.add(row, ban)
            allowed.add(row, p.allowed_token_ids or [])
            bias.add(row, list(p.logit_bias or {}), list((p.logit_bias or {}).values()))
            if p.needs_penalties and seq.token_ids:
                penalized.append(row)
        meta.banned = banned.upload(self.device)
        meta.allowed = allowed.upload(self.device)
        meta.bias = bias.upload(self.device)
        if penalized:
            meta.penalties = self._penalties([seqs[r] for r in penalized], penalized)

    def _penalties(self, seqs: list[Sequence], rows: list[int]) -> Penalties:
        width = max(s.num_tokens for s in seqs)
        params = [s.sampling_params for s in seqs]
        return Penalties(
            token_ids=upload([t for s in seqs for t in (s.token_ids + [s.token_ids[0]] * (width - s.num_tokens))],
                             torch.long, self.device).view(len(seqs), width),
            **_uploaded({"rows": rows, "prompt_lens": [s.num_prompt_tokens for s in seqs],
                         "lengths": [s.num_tokens for s in seqs]}, torch.long, self.device),
            **_uploaded({"presence": [p.presence_penalty for p in params],
                         "frequency": [p.frequency_penalty for p in params],
                         "repetition": [p.repetition_penalty for p in params]}, torch.float32, self.device),
        )


class _Pairs:
    """(row, token id[, value]) pairs gathered on the host, uploaded together."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.ids: list[int] = []
        self.values: list[float] = []

    def add(self, row: int, ids: list[int], values: list[float] | None = None) -> None:
        self.rows += [row] * len(ids)
        self.ids += ids
        self.values += values or []

    def upload(self, device: torch.device) -> TokenPairs | None:
        if not self.rows:
            return None
        values = upload(self.values, torch.float32, device) if self.values else None
        return TokenPairs(**_uploaded({"rows": self.rows, "ids": self.ids}, torch.long, device), values=values)


def _uploaded(columns: dict[str, list], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Equal-length host lists as views of one tensor on `device` (one flat copy up)."""
    flat = upload([v for values in columns.values() for v in values], dtype, device)
    return dict(zip(columns, flat.view(len(columns), -1).unbind(0)))


def _ends_with(tokens: list[int], suffix: list[int]) -> bool:
    return not suffix or tokens[-len(suffix):] == suffix
