"""Batched sampling: one pass over the step's logits, each row with its own settings."""

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    """Token history of the penalized rows: ids padded with `vocab` (out of range)."""

    rows: torch.Tensor
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors on the logits' device.

    `generators[i]` is row i's own seeded generator, or None to draw from the engine's.
    `banned` and `allowed` list (row, token ids) pairs; `bias` is (rows, ids, values).
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool
    penalties: Penalties | None = None
    banned: list[tuple[int, list[int]]] | None = None
    allowed: list[tuple[int, list[int]]] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: list[int | None] | None = None

    @property
    def needs_processing(self) -> bool:
        return bool(self.penalties or self.banned or self.allowed or self.bias)


@dataclass
class SampledToken:
    """A row's sampled token; with logprobs, its log-probability and the top ones."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


class Sampler:
    """Processors, penalties, temperature, min-p, top-k and top-p for a whole batch.

    Log-probabilities are those of the model's raw logits, as vLLM reports them. A
    token is drawn as argmax(probs / E) with E ~ Exponential(1) per vocabulary entry
    (the exponential race, equivalent to sampling from probs). Seeded rows draw E from
    their own generator, advanced once per generated token, so their choices do not
    depend on the rest of the batch.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """One token per row from logits [rows, vocab] in the model's dtype."""
        raw = logits.float()
        processed = self.process(raw.clone(), meta) if meta.needs_processing else raw
        tokens = processed.argmax(dim=-1)
        if not meta.all_greedy:
            tokens = torch.where(meta.temperatures == 0, tokens, self._sample(processed, meta))
        token_list = tokens.tolist()
        if not meta.num_logprobs or all(k is None for k in meta.num_logprobs):
            return [SampledToken(t) for t in token_list]
        return self._with_logprobs(raw, tokens, token_list, meta.num_logprobs)

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logits processors and penalties, in vLLM's order, in place on float32 logits."""
        if meta.allowed:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            for row, ids in meta.allowed:
                keep[row, ids] = True
            rows = torch.tensor([row for row, _ in meta.allowed], device=logits.device)
            logits[rows] = logits[rows].masked_fill(~keep[rows], float("-inf"))
        for row, ids in meta.banned or ():
            logits[row, ids] = float("-inf")
        if meta.bias is not None:
            rows, ids, values = meta.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / torch.where(meta.temperatures == 0, 1.0, meta.temperatures).unsqueeze(1)
        if meta.any_min_p:
            probs = logits.softmax(dim=-1)
            floor = meta.min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < floor, float("-inf"))
        if meta.any_top_k or meta.any_top_p:
            logits = filter_top_k_top_p(logits, meta.top_ks, meta.top_ps, meta.any_top_k, meta.any_top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(meta.generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, gen in enumerate(meta.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                       num_logprobs: list[int | None]) -> list[SampledToken]:
        logprobs = raw.log_softmax(dim=-1)
        chosen_t = logprobs.gather(1, tokens.unsqueeze(1))
        ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        k_max = max(k for k in num_logprobs if k is not None)
        top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
        out = []
        for i, (token, k) in enumerate(zip(token_list, num_logprobs)):
            if k is None:
                out.append(SampledToken(token))
            else:
                out.append(SampledToken(token, chosen[i], ranks[i], top_ids[i, :k].tolist() if k else [],
                                        top_values[i, :k].tolist() if k else []))
        return out


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """vLLM's penalties on rows `p.rows`: repetition over prompt and output tokens,
    frequency and presence over output tokens only."""
    vocab = logits.shape[1]
    rows = logits[p.rows]
    counts = torch.zeros(rows.shape[0], vocab + 1, device=logits.device)
    counts.scatter_add_(1, p.output_ids, torch.ones_like(p.output_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, p.prompt_ids, True)
    seen = seen[:, :vocab] | (counts > 0)
    repetition = p.repetition.unsqueeze(1)
    rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
    rows -= p.frequency.unsqueeze(1) * counts
    rows -= p.presence.unsqueeze(1) * (counts > 0)
    logits[p.rows] = rows


def filter_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                       any_top_k: bool, any_top_p: bool) -> torch.Tensor:
    """Sets to -inf every logit outside its row's top-k and top-p sets (0 / 1 = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    if any_top_k:
        k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if any_top_p:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_ps.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
