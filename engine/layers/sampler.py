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
    token is drawn by inverse CDF from one uniform number; seeded rows take it from
    their own generator, advanced once per generated token, so their choices do not
    depend on the rest of the batch.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """One token per row from logits [rows, vocab] in the model's dtype."""
        raw = logits.float()
        wants_logprobs = bool(meta.num_logprobs) and any(k is not None for k in meta.num_logprobs)
        processed = raw
        if meta.needs_processing:
            # Logprobs are of the raw logits, and the caller's tensor stays as it was: work
            # in place only on the float32 copy that the upcast made.
            processed = self.process(raw.clone() if wants_logprobs or raw is logits else raw, meta)
        if meta.all_greedy:
            tokens = processed.argmax(dim=-1)
        else:
            tokens = self._sample(processed, meta)
        if not wants_logprobs:
            return [SampledToken(t) for t in tokens.tolist()]
        return token_logprobs(raw, tokens, meta.num_logprobs)

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logits processors and penalties, in vLLM's order, in place on float32 logits."""
        device = logits.device
        if meta.allowed:
            rows = torch.tensor([row for row, _ in meta.allowed], device=device)
            keep = torch.zeros(len(meta.allowed), logits.shape[1], dtype=torch.bool, device=device)
            keep[_flat_rows(meta.allowed, device), _flat_ids(meta.allowed, device)] = True
            logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
        if meta.banned:
            rows = torch.tensor([row for row, ids in meta.banned for _ in ids], device=device)
            logits[rows, _flat_ids(meta.banned, device)] = float("-inf")
        if meta.bias is not None:
            rows, ids, values = meta.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """A token per row: the argmax for greedy rows, else a draw by inverse CDF.

        Each sampled row takes one uniform number per token: from its own generator when
        seeded, else from the engine's. Rows with top-k or top-p draw inside their sorted
        head only, the others over the whole vocabulary; each group is gathered once.
        """
        vocab = logits.shape[1]
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        greedy = meta.temperatures == 0
        if greedy.any():
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        sampled = (~greedy).nonzero().squeeze(1)
        uniform = torch.empty(logits.shape[0], device=logits.device)
        uniform[sampled] = self._uniforms([meta.generators[i] for i in sampled.tolist()], logits.device)
        narrowed = ((meta.top_ks > 0) & (meta.top_ks < vocab)) | (meta.top_ps < 1)
        for rows, is_filtered in ((~greedy & narrowed, True), (~greedy & ~narrowed, False)):
            if not rows.any():
                continue
            group = logits[rows].div_(meta.temperatures[rows].unsqueeze(1))
            if meta.any_min_p:
                _apply_min_p(group, meta.min_ps[rows])
            if is_filtered:
                head, order = top_k_top_p_window(group, meta.top_ks[rows], meta.top_ps[rows])
                tokens[rows] = order.gather(1, _inverse_cdf(head, uniform[rows]).unsqueeze(1)).squeeze(1)
            else:
                tokens[rows] = _inverse_cdf(group, uniform[rows])
        return tokens

    def _uniforms(self, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        uniform = torch.empty(len(generators), device=device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            uniform[shared] = torch.rand(len(shared), generator=self.generator, device=device)
        for i, gen in enumerate(generators):
            if gen is not None:
                uniform[i] = torch.rand((), generator=gen, device=device)
        return uniform

def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> list[SampledToken]:
    """Each row's token with its log-probability under `logits`, its rank (1 = most
    likely) and the row's `num_logprobs[i]` most likely tokens (None: no logprobs)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_t = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    k_max = max((k for k in num_logprobs if k is not None), default=0)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    out = []
    for i, (token, k) in enumerate(zip(tokens.tolist(), num_logprobs)):
        if k is None:
            out.append(SampledToken(token))
        else:
            out.append(SampledToken(token, chosen[i], ranks[i], top_ids[i, :k].tolist() if k else [],
                                    top_values[i, :k].tolist() if k else []))
    return out


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """vLLM's penalties on rows `p.rows`: repetition over prompt and output tokens,
    frequency and presence over output tokens only.

    Only the (row, token) pairs that occur are touched: a few hundred per row, instead
    of passes over the whole vocabulary.
    """
    vocab = logits.shape[1]
    width = vocab + 1  # the padding id is `vocab`
    local = torch.arange(len(p.rows), device=logits.device).unsqueeze(1)
    prompt_keys = (local * width + p.prompt_ids).flatten()
    output_keys = (local * width + p.output_ids).flatten()
    keys = torch.cat([prompt_keys, output_keys]).unique()
    keys = keys[keys % width != vocab]
    counts = torch.zeros(len(keys), device=logits.device)
    output_keys = output_keys[output_keys % width != vocab]
    counts.index_add_(0, torch.searchsorted(keys, output_keys), torch.ones(len(output_keys), device=logits.device))
    which, token = keys // width, keys % width
    row = p.rows[which]
    values = logits[row, token]
    repetition = p.repetition[which]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - p.frequency[which] * counts - p.presence[which] * (counts > 0)
    logits[row, token] = values


def _apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> None:
    """Sets to -inf, in place, tokens less likely than min_p times the row's most likely."""
    rows = (min_ps > 0).nonzero().squeeze(1)
    if len(rows):
        probs = logits[rows].softmax(dim=-1)
        floor = min_ps[rows].unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits[rows] = logits[rows].masked_fill(probs < floor, float("-inf"))


def _flat_rows(pairs: list[tuple[int, list[int]]], device: torch.device) -> torch.Tensor:
    """For (row, ids) pairs: the pair's position once per id."""
    return torch.tensor([k for k, (_, ids) in enumerate(pairs) for _ in ids], device=device)


def _flat_ids(pairs: list[tuple[int, list[int]]], device: torch.device) -> torch.Tensor:
    return torch.tensor([i for _, ids in pairs for i in ids], device=device)


def _inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose cumulative probability exceeds that row's uniform
    number: a draw from softmax(logits) that never lands on a zero-probability column.
    The weights need no normalization: the target is scaled by their total instead."""
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()
    cdf = weights.cumsum(dim=-1)
    target = (uniform * cdf[:, -1] * (1 - 1e-6)).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logits.shape[1] - 1)


def top_k_top_p_window(logits: torch.Tensor, top_ks: torch.Tensor,
                       top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's most likely tokens, as (logits, token ids) in descending order, with
    those outside its top-k set and, within it, outside its top-p nucleus at -inf
    (top_k 0 and top_p 1 are off). A token stays in the nucleus while the tokens more
    likely than it hold less than top_p of the (top-k) probability mass.

    Only the head of each row is sorted: `topk` over a window sized to hold every row's
    top-k set and nucleus (grown if it does not), instead of sorting the whole vocabulary.
    """
    vocab = logits.shape[1]
    top_ks = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab)
    use_top_p = top_ps < 1
    full_lse = logits.logsumexp(dim=-1, keepdim=True)
    window = min(vocab, max(16, int(top_ks[top_ks < vocab].max()) if (top_ks < vocab).any() else 0))
    nucleus_rows = use_top_p & (top_ks == vocab)
    if bool(((top_ks == vocab) & ~use_top_p).any()):
        window = vocab  # a row that filters nothing keeps every token
    elif nucleus_rows.any():
        # The tokens above probability tau form a prefix of the sorted row; once they hold
        # top_p of the mass, the nucleus lies within them, so their count is a window.
        probs = (logits[nucleus_rows] - full_lse[nucleus_rows]).exp()
        for tau in (1e-3, 1e-4, 1e-5):
            above = probs >= tau
            if bool(((probs * above).sum(dim=-1) >= top_ps[nucleus_rows]).all()):
                window = max(window, int(above.sum(dim=-1).max()))
                break
        else:
            window = vocab
    while True:
        values, order = logits.topk(window, dim=-1)
        ranks = torch.arange(window, device=logits.device).unsqueeze(0)
        in_top_k = ranks < top_ks.unsqueeze(1)
        head = values.masked_fill(~in_top_k, float("-inf"))
        lse = torch.where((top_ks < vocab).unsqueeze(1), head.logsumexp(dim=-1, keepdim=True), full_lse)
        probs = (head - lse).exp()
        mass = probs.cumsum(dim=-1)
        covered = torch.where(top_ks < vocab, top_ks <= window, ~use_top_p | (mass[:, -1] >= top_ps))
        if window == vocab or bool(covered.all()):
            break
        window = min(vocab, window * 4)
    keep = in_top_k & (~use_top_p.unsqueeze(1) | (mass - probs < top_ps.unsqueeze(1)))
    return values.masked_fill(~keep, float("-inf")), order
