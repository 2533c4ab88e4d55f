"""Batched sampling: one pass over the step's logits, each row with its own settings.

Everything that decides the shape of the work (which rows are greedy, seeded, narrowed by
top-k or top-p, the largest top_k) is known on the host when the step's `SamplingMetadata`
is built, so sampling reads nothing back from the device: on a GPU it is queued behind the
forward pass while the host goes on (asynchronous scheduling). Only the top-k/top-p head
differs by device, behind `TopKTopP` (see `top_k_top_p_for`).
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kernels import cpu_sampling
from engine.sampling_params import logprobs_count
from engine.structured_output.manager import GrammarBitmask


@dataclass
class Penalties:
    """Token history of the penalized rows, on the device: `token_ids[i]` is row `rows[i]`'s
    prompt then its output, padded with its own first token; positions from
    `prompt_lens[i]` to `lengths[i]` are its output (what frequency and presence count)."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    prompt_lens: torch.Tensor
    lengths: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass
class TokenPairs:
    """(row, token id) pairs on the device, with a value each where the pairs carry one."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor | None = None


@dataclass
class DrawRows:
    """Sampled rows that draw alike, with their settings on the device: either all narrowed
    (a top-k below the vocabulary or a top-p below 1) or none.

    `seeded` holds a seeded row's uniform number (`seeded_uniform`) and -1 elsewhere, or is
    None when no row is seeded; `all_seeded` says no row draws from the engine's generator.
    `min_ps` is None when no row has min-p. Narrowed rows have `top_ks` (0: off) and
    `top_ps`, and `max_top_k`, their largest top_k when every one has a top-k (else None:
    some row's nucleus may reach anywhere in the vocabulary).
    """

    rows: torch.Tensor
    temperatures: torch.Tensor
    seeded: torch.Tensor | None = None
    all_seeded: bool = False
    min_ps: torch.Tensor | None = None
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    max_top_k: int | None = None

    @property
    def narrowed(self) -> bool:
        return self.top_ks is not None


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors on the logits' device, grouped on
    the host (`engine/worker/sampling_metadata.py` builds them).

    Without `all_greedy`, `greedy_rows` (None: none) take the argmax and each of `draws`
    draws its rows. `banned` and `allowed` are (row, token) pairs; `bias` adds its values
    at its pairs. `grammar` holds the structured-output rows' allowed tokens.
    """

    all_greedy: bool
    greedy_rows: torch.Tensor | None = None
    draws: list[DrawRows] = field(default_factory=list)
    penalties: Penalties | None = None
    banned: TokenPairs | None = None
    allowed: TokenPairs | None = None
    bias: TokenPairs | None = None
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


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def completion_seed(seed: int, index: int) -> int:
    """The seed that completion `index` of a request seeded with `seed` draws with: the
    request's for its first completion, one derived from it for each other (n > 1)."""
    return seed if index == 0 else hash((seed, index)) & (2**63 - 1)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) that a request seeded with `seed` draws its token
    number `index` (0 for the first generated token) with: SplitMix64's output number
    `index` from a state made of the mixed seed, keeping 24 bits (as torch.rand in float32).

    A function of the seed and the token's index alone, computed on the host: the draw
    does not depend on the batch, on the device, or on how many draws came before it
    (a step's token discarded, a preemption), and needs no per-row generator on the device.
    """
    state = (_mix64(seed & _MASK64) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    return (_mix64(state) >> 40) / (1 << 24)


class TopKTopP(Protocol):
    """How the narrowed rows draw: from softmax over each row's top-k set and, within it,
    its top-p nucleus (top_k 0 and top_p 1 are off), with the tokens tied with the last
    kept one kept too, as vLLM does for top-k. Both kinds keep the same set of tokens for
    the same logits (`kept`); a row's kept set is found from its sorted values, prefix sums
    along them and a per-row softmax (`_nucleus_cut`), never from a sum across the row."""

    def kept(self, logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
             max_top_k: int | None) -> torch.Tensor:
        """[rows, vocab] True where a row keeps the token."""

    def draw(self, logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, max_top_k: int | None,
             uniform: torch.Tensor) -> torch.Tensor:
        """A token per row by inverse CDF in token id order over the kept tokens."""


class GrowingWindow:
    """Sorts only each row's head, in a window grown until it holds every row's cut: its
    sizes are read back from the device, which costs nothing where the device computes as
    the work is launched (a CPU), and every row's result is the same bits whatever else is
    in the batch."""

    def kept(self, logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
             max_top_k: int | None) -> torch.Tensor:
        head = top_k_top_p_head(logits, top_ks, top_ps)
        return torch.zeros_like(logits, dtype=torch.bool).scatter_(1, head.ids, head.keep)

    def draw(self, logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, max_top_k: int | None,
             uniform: torch.Tensor) -> torch.Tensor:
        return top_k_top_p_head(logits, top_ks, top_ps).draw(uniform)


class FixedWindow:
    """Reads nothing back: the window is fixed on the host, the largest top_k when every
    row has a top-k, else the whole row (a full sort, as vLLM's sampler does: a top-p
    nucleus can reach anywhere, and a fixed number of bisection steps over the threshold
    would sum the mass in another order than the sorted prefix sums, so its kept set could
    differ at the boundary). The cut found in the window then masks the whole row, which
    keeps every tie of it, and the draw is the whole-vocabulary one."""

    def kept(self, logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
             max_top_k: int | None) -> torch.Tensor:
        vocab = logits.shape[1]
        window = vocab if max_top_k is None else min(max_top_k, vocab)
        if window < vocab:  # every row has a top-k: the totals are their top-k sets'
            values, totals = logits.topk(window, dim=-1).values, torch.ones(len(logits), device=logits.device)
        else:
            values, totals = logits.sort(dim=-1, descending=True).values, _row_totals(logits.softmax(dim=-1))
        return logits >= _nucleus_cut(values, top_ks, top_ps, totals, vocab)

    def draw(self, logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, max_top_k: int | None,
             uniform: torch.Tensor) -> torch.Tensor:
        kept = self.kept(logits, top_ks, top_ps, max_top_k)
        return _inverse_cdf(logits.masked_fill(~kept, float("-inf")), uniform)


def top_k_top_p_for(device: torch.device) -> TopKTopP:
    """The top-k/top-p head for `device`: a CPU computes as the work is launched, so
    reading sizes back costs it nothing (`GrowingWindow`, which sorts the least); any other
    device queues the work, and a read-back would stall the host (`FixedWindow`)."""
    return GrowingWindow() if device.type == "cpu" else FixedWindow()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of float32 logits [rows, vocab] (torch.argmax's index), int64: on a
    CPU the compiled kernel's (`engine.kernels.cpu_sampling`), where it is built, since
    PyTorch's reads the rows at a few GB/s there (0.7 ms a step for 32 rows of 49,152 on a Zen
    4, 4.2 ms for 64 on a Sapphire Rapids); elsewhere PyTorch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.numel():
        tokens = cpu_sampling.argmax_rows(logits)
        if tokens is not None:
            return tokens
    return logits.argmax(dim=-1)


class Sampler:
    """Processors, penalties, temperature, min-p, top-k and top-p for a whole batch.

    Log-probabilities are those of the model's raw logits, as vLLM reports them (with
    the tokens a structured output's grammar forbids at -inf, as in vLLM). A
    token is drawn by inverse CDF from one uniform number; a seeded row's is
    `seeded_uniform(seed, index of the token)`, so its choices do not depend on the rest of
    the batch; the others' come from the engine's generator.
    """

    def __init__(self, generator: torch.Generator, top_k_top_p: TopKTopP | None = None) -> None:
        """`top_k_top_p`: by default the one for the generator's device."""
        self.generator = generator
        self.top_k_top_p = top_k_top_p or top_k_top_p_for(generator.device)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """One token per row from logits [rows, vocab], read back to the host."""
        return self.sample(logits, meta).entries()

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> "SamplerOutput":
        """One token per row from logits [rows, vocab] in the model's dtype, left on the
        logits' device; nothing is read back (so that a GPU step needs no host round trip)."""
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
        tokens = greedy_tokens(processed) if meta.all_greedy else self._sample(processed, meta)
        return SamplerOutput(tokens, token_logprobs(raw, tokens, meta.num_logprobs) if wants_logprobs else None)

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logits processors and penalties, in vLLM's order, in place on float32 logits."""
        if meta.allowed is not None:
            # A row's allowed values are kept aside while the whole row goes to -inf (a
            # row with several allowed ids is filled several times, alike).
            pairs = meta.allowed
            kept = logits[pairs.rows, pairs.ids]
            logits.index_fill_(0, pairs.rows, float("-inf"))
            logits[pairs.rows, pairs.ids] = kept
        if meta.banned is not None:
            logits[meta.banned.rows, meta.banned.ids] = float("-inf")
        if meta.bias is not None:
            logits.index_put_((meta.bias.rows, meta.bias.ids), meta.bias.values, accumulate=True)
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """A token per row: the argmax for greedy rows, else a draw by inverse CDF.

        Each sampled row takes one uniform number per token. Temperature and min-p shape
        the row first; narrowed rows then draw inside their top-k set and top-p nucleus,
        the others over the whole vocabulary. Every step of the draw depends on the row
        alone, bit for bit, on a CPU.
        """
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if meta.greedy_rows is not None:
            tokens.index_copy_(0, meta.greedy_rows, greedy_tokens(logits.index_select(0, meta.greedy_rows)))
        for group in meta.draws:
            scaled = logits.index_select(0, group.rows).div_(group.temperatures.unsqueeze(1))
            if group.min_ps is not None:
                _apply_min_p(scaled, group.min_ps)
            uniform = self._uniforms(group, logits.device)
            if group.narrowed:
                drawn = self.top_k_top_p.draw(scaled, group.top_ks, group.top_ps, group.max_top_k, uniform)
            else:
                drawn = _inverse_cdf(scaled, uniform)
            tokens.index_copy_(0, group.rows, drawn)
        return tokens

    def _uniforms(self, group: DrawRows, device: torch.device) -> torch.Tensor:
        """The group's uniform numbers: the seeded rows' own, the others' from the engine's
        generator (one draw for the group)."""
        if group.all_seeded:
            return group.seeded
        shared = torch.rand(len(group.rows), generator=self.generator, device=device)
        return shared if group.seeded is None else torch.where(group.seeded >= 0, group.seeded, shared)


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

    Only the (row, token) pairs that occur are touched: a few hundred per row, instead of
    passes over the whole vocabulary. Each row's ids are sorted, so that the occurrences of
    a token sit together: its output count is a difference of prefix sums, and every
    occurrence writes the same new value (the padding repeats a token of the row).
    """
    positions = torch.arange(p.token_ids.shape[1], device=logits.device)
    generated = (positions >= p.prompt_lens.unsqueeze(1)) & (positions < p.lengths.unsqueeze(1))
    ids, order = p.token_ids.sort(dim=1)
    generated = generated.gather(1, order).long()
    through = generated.cumsum(dim=1)
    first = torch.searchsorted(ids, ids)
    last = torch.searchsorted(ids, ids, right=True) - 1
    counts = (through.gather(1, last) - (through - generated).gather(1, first)).float()
    rows = p.rows.unsqueeze(1).expand_as(ids)
    values = logits[rows, ids]
    repetition = p.repetition.unsqueeze(1)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * (counts > 0)
    logits[rows, ids] = values


def _apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> None:
    """Sets to -inf, in place, tokens less likely than min_p times the row's most likely
    (a row with min_p 0 keeps every token)."""
    probs = logits.softmax(dim=-1)
    floor = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < floor, float("-inf"))


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
    (see `TopKTopP`), for `GrowingWindow`.

    Each row's kept set is the same whatever else is in the batch: the row's sorted values
    do not depend on how far the window reaches, nor do its prefix sums, which run along
    the row (`_nucleus_cut`). Only the head is sorted, in a window that grows until it
    holds every row's cut.
    """
    vocab = logits.shape[1]
    has_top_k = (top_ks > 0) & (top_ks < vocab)
    whole = (top_ps < 1) & ~has_top_k
    totals = torch.ones(len(logits), device=logits.device)
    window = max(16, int(top_ks[has_top_k].max()) + 1 if has_top_k.any() else 0)
    if whole.any():
        probs = logits[whole].softmax(dim=-1)
        totals[whole] = _row_totals(probs)
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
        keep = values >= _nucleus_cut(values, top_ks, top_ps, totals, vocab)
        if window == vocab or bool((~keep[:, -1]).all()):
            return SortedHead(values, ids, keep)
        window *= 4


def _row_totals(probs: torch.Tensor) -> torch.Tensor:
    """Each row's total weight exp(logit - max) from its softmax, whose largest probability
    is exactly one over it."""
    return probs.max(dim=-1).values.reciprocal()


def _nucleus_cut(values: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, totals: torch.Tensor,
                 vocab: int) -> torch.Tensor:
    """Each row's cut [rows, 1]: the smallest value it keeps, from `values`, the head of
    the row sorted in descending order and reaching past its top-k set and its nucleus.

    A token stays in the nucleus while the tokens more likely than it hold less than top_p
    of the probability mass: of the top-k set where the row has a top-k, else `totals`
    (`_row_totals`). The masses are prefix sums along the sorted row, so a row's cut does
    not depend on the window's width nor on the other rows (sums across a row would: PyTorch
    splits them differently depending on the batch's shape).
    """
    window = values.shape[1]
    top_ks = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab)
    weights = (values - values[:, :1]).exp()
    mass = weights.cumsum(dim=-1)
    k_last = (top_ks.clamp(max=window) - 1).unsqueeze(1)
    totals = torch.where(top_ks < vocab, mass.gather(1, k_last).squeeze(1), totals)
    ranks = torch.arange(window, device=values.device)
    # The most likely token always stays: a top_p too small for float32 (5e-324) would keep none.
    in_nucleus = ((mass - weights) < (top_ps * totals).unsqueeze(1)) | (ranks == 0)
    prefix = (ranks < top_ks.unsqueeze(1)) & ((top_ps >= 1).unsqueeze(1) | in_nucleus)
    return values.gather(1, prefix.sum(dim=-1, keepdim=True) - 1)
