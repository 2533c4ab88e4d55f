"""Batched sampling: one pass over the step's logits, each row with its own settings."""

from dataclasses import dataclass

import torch

from engine.sampling_params import logprobs_count
from engine.structured_output.manager import GrammarBitmask


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

    The per-row draw settings are None when every row is greedy. `generators[i]` is row
    i's own seeded generator, or None to draw from the engine's. `banned` and `allowed`
    list (row, token ids) pairs; `bias` is (rows, ids, values). `grammar` holds the
    structured-output rows' allowed tokens.
    """

    all_greedy: bool
    temperatures: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    top_ks: torch.Tensor | None = None
    min_ps: torch.Tensor | None = None
    generators: list[torch.Generator | None] | None = None
    any_min_p: bool = False
    penalties: Penalties | None = None
    banned: list[tuple[int, list[int]]] | None = None
    allowed: list[tuple[int, list[int]]] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: list[int | None] | None = None
    grammar: GrammarBitmask | None = None

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

    Log-probabilities are those of the model's raw logits, as vLLM reports them (with
    the tokens a structured output's grammar forbids at -inf, as in vLLM). A
    token is drawn by inverse CDF from one uniform number; seeded rows take it from
    their own generator, advanced once per generated token, so their choices do not
    depend on the rest of the batch.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """One token per row from logits [rows, vocab], read back to the host."""
        return self.sample(logits, meta).entries()

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> "SamplerOutput":
        """One token per row from logits [rows, vocab] in the model's dtype, left on the
        logits' device (so that a GPU step needs no host round trip)."""
        raw = logits.float()
        if meta.grammar is not None:
            raw = raw.clone() if raw is logits else raw
            meta.grammar.apply(raw)
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
        return SamplerOutput(tokens, token_logprobs(raw, tokens, meta.num_logprobs) if wants_logprobs else None)

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
        seeded, else from the engine's. Temperature and min-p shape the row first; rows
        with top-k or top-p then draw inside their sorted head, the others over the whole
        vocabulary. Every step of the draw depends on the row alone, bit for bit.
        """
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        greedy = meta.temperatures == 0
        if greedy.any():
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        sampled = (~greedy).nonzero().squeeze(1)
        if not len(sampled):
            return tokens
        uniform = self._uniforms([meta.generators[i] for i in sampled.tolist()], logits.device)
        top_ks, top_ps = meta.top_ks[sampled], meta.top_ps[sampled]
        narrowed = ((top_ks > 0) & (top_ks < logits.shape[1])) | (top_ps < 1)
        for group in (narrowed, ~narrowed):
            if not group.any():
                continue
            rows = sampled[group]
            scaled = logits[rows].div_(meta.temperatures[rows].unsqueeze(1))
            if meta.any_min_p:
                _apply_min_p(scaled, meta.min_ps[rows])
            if group is narrowed:
                tokens[rows] = top_k_top_p_head(scaled, top_ks[group], top_ps[group]).draw(uniform[group])
            else:
                tokens[rows] = _inverse_cdf(scaled, uniform[group])
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


@dataclass
class LogprobsTensors:
    """Rows' log-probabilities, still on the device: the chosen token's value and rank,
    and the `k_max` most likely tokens of each row (a row keeps its own `counts[i]`)."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None
    counts: list[int | None]

    def to_host(self, non_blocking: bool) -> "LogprobsTensors":
        move = [None if t is None else t.to("cpu", non_blocking=non_blocking)
                for t in (self.chosen, self.ranks, self.top_values, self.top_ids)]
        return LogprobsTensors(*move, self.counts)


@dataclass
class SamplerOutput:
    """A step's sampled tokens [rows] and, when any row asked, their logprobs."""

    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None = None

    def to_host(self, non_blocking: bool = False) -> "SamplerOutput":
        """A copy on the host; `non_blocking` from a GPU lands in pinned memory, readable
        once the stream has passed the copy (an event tells)."""
        logprobs = self.logprobs.to_host(non_blocking) if self.logprobs is not None else None
        return SamplerOutput(self.token_ids.to("cpu", non_blocking=non_blocking), logprobs)

    def entries(self) -> list[SampledToken]:
        """One `SampledToken` per row (read from the host)."""
        tokens = self.token_ids.tolist()
        lp = self.logprobs
        if lp is None:
            return [SampledToken(t) for t in tokens]
        chosen, ranks = lp.chosen.tolist(), lp.ranks.tolist()
        out = []
        for i, (token, k) in enumerate(zip(tokens, lp.counts)):
            if k is None:
                out.append(SampledToken(token))
            else:
                out.append(SampledToken(token, chosen[i], ranks[i], lp.top_ids[i, :k].tolist() if k else [],
                                        lp.top_values[i, :k].tolist() if k else []))
        return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> LogprobsTensors:
    """Each row's token with its log-probability under `logits`, its rank (1 = most
    likely) and the row's `num_logprobs[i]` most likely tokens (None: no logprobs; -1:
    the whole vocabulary)."""
    logprobs = logits.float().log_softmax(dim=-1)
    counts = [logprobs_count(k, logits.shape[-1]) for k in num_logprobs]
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k_max = max((k for k in counts if k is not None), default=0)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    return LogprobsTensors(chosen.squeeze(1), ranks, top_values, top_ids, counts)


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


# The whole-vocabulary draw first picks a block of this many tokens, then a token in it.
_CDF_BLOCK = 1024


def _inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability (in token id order) exceeds
    that row's uniform number: a draw from softmax(logits) that never lands on a
    zero-probability token. The weights need no normalization: the target is scaled by
    their total instead.

    Two levels, both depending on the row alone: sums over fixed blocks of the vocabulary
    (each block's sum does not depend on the batch's shape, unlike a sum over a whole
    row), a prefix sum over the blocks to find the target's block, then one inside it.
    """
    rows, vocab = logits.shape
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()
    blocks = -(-vocab // _CDF_BLOCK)
    if vocab % _CDF_BLOCK:
        weights = torch.nn.functional.pad(weights, (0, blocks * _CDF_BLOCK - vocab))
    weights = weights.view(rows, blocks, _CDF_BLOCK)
    block_cdf = weights.sum(dim=-1).cumsum(dim=-1)
    target = uniform * block_cdf[:, -1] * (1 - 1e-6)
    block = torch.searchsorted(block_cdf, target.unsqueeze(1), right=True).clamp(max=blocks - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner_cdf = weights.gather(1, block.unsqueeze(2).expand(-1, -1, _CDF_BLOCK)).squeeze(1).cumsum(dim=-1)
    inner = _search_cdf(inner_cdf, target.unsqueeze(1) - before)
    return (block * _CDF_BLOCK + inner).squeeze(1).clamp(max=vocab - 1)


def _search_cdf(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first column of `cdf` [rows, n] above `target` [rows, 1]. Rounding can
    leave the target at or past the row's total: then its last column of nonzero weight,
    so that a draw never lands on a zero-probability token."""
    last_nonzero = (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)
    return torch.minimum(torch.searchsorted(cdf, target, right=True), last_nonzero)


@dataclass
class SortedHead:
    """The most likely tokens of each row, in descending order: `values` (logits), `ids`,
    and `keep`, the tokens inside the row's top-k set and top-p nucleus. The window always
    reaches a dropped token or the end of the vocabulary, so `keep` is the whole kept set."""

    values: torch.Tensor
    ids: torch.Tensor
    keep: torch.Tensor

    def draw(self, uniform: torch.Tensor) -> torch.Tensor:
        """A token per row from softmax over its kept tokens, by inverse CDF in token id
        order: the same token a whole-vocabulary draw would give with the others at zero
        weight, for a fraction of the work."""
        vocab_end = torch.iinfo(self.ids.dtype).max
        by_id, order = torch.where(self.keep, self.ids, vocab_end).sort(dim=-1)
        weights = (self.values - self.values[:, :1]).exp_().masked_fill_(~self.keep, 0.0).gather(1, order)
        cdf = weights.cumsum(dim=-1)
        target = (uniform * cdf[:, -1] * (1 - 1e-6)).unsqueeze(1)
        return by_id.gather(1, _search_cdf(cdf, target)).squeeze(1)


def top_k_top_p_head(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> SortedHead:
    """Each row's sorted head with its top-k set and, within it, its top-p nucleus marked
    (top_k 0 and top_p 1 are off). A token stays in the nucleus while the tokens more
    likely than it hold less than top_p of the (top-k) probability mass. Tokens tied with
    the last one kept are kept too, as vLLM does for top-k.

    Each row's kept set is the same whatever else is in the batch: it comes from that row's
    sorted values (which do not depend on how far the window reaches), prefix sums (which
    run sequentially along a row) and softmax (computed per row), never from sums over a
    row, which PyTorch splits differently depending on the batch's shape. Only the head is
    sorted, in a window that grows until it holds every row's cut.
    """
    vocab = logits.shape[1]
    top_ks = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab)
    has_top_k = top_ks < vocab
    use_top_p = top_ps < 1
    # Total weight exp(logit - max) of each row's distribution: its whole row (softmax's
    # largest probability is exactly one over it) or, below, its top-k set.
    totals = torch.ones(len(logits), device=logits.device)
    whole = use_top_p & ~has_top_k
    window = max(16, int(top_ks[has_top_k].max()) + 1 if has_top_k.any() else 0)
    if whole.any():
        probs = logits[whole].softmax(dim=-1)
        totals[whole] = probs.max(dim=-1).values.reciprocal()
        # Tokens above probability tau form a prefix of the sorted row; once they hold
        # top_p of the mass, the nucleus lies within them: a first guess at the window.
        for tau in (1e-3, 1e-5):
            above = probs >= tau
            if bool(((probs * above).sum(dim=-1) >= top_ps[whole]).all()):
                window = max(window, int(above.sum(dim=-1).max()) + 1)
                break
    while True:
        window = min(window, vocab)
        values, ids = logits.topk(window, dim=-1)
        weights = (values - values[:, :1]).exp()
        mass = weights.cumsum(dim=-1)
        k_last = (top_ks.clamp(max=window) - 1).unsqueeze(1)
        totals = torch.where(has_top_k, mass.gather(1, k_last).squeeze(1), totals)
        ranks = torch.arange(window, device=logits.device)
        in_nucleus = (mass - weights) < (top_ps * totals).unsqueeze(1)
        prefix = (ranks < top_ks.unsqueeze(1)) & (~use_top_p.unsqueeze(1) | in_nucleus)
        cut = values.gather(1, (prefix.sum(dim=-1, keepdim=True) - 1))
        keep = values >= cut
        if window == vocab or bool((~keep[:, -1]).all()):
            return SortedHead(values, ids, keep)
        window *= 4
