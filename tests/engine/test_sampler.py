"""Unit tests of the batched sampler (`engine/sample/sampler.py`) against independent references.

No model is loaded: every test builds `SamplingMetadata` with the engine's builder from
sequences made here, and checks the sampler against transformers' logits warpers, float64
re-computations of vLLM's penalty formulas, float64 log-softmax, or a chi-square
goodness-of-fit test. The top-k/top-p tests run both kinds of head (`GrowingWindow`, a CPU's,
and `FixedWindow`, the sync-free one); test_sampler_sync.py checks that sampling reads
nothing back from the device.
"""

import dataclasses

import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import engine.sample.sampler as sampler_module
from engine.core.sequence import Sequence, logits_processing
from engine.sample.sampler import (
    FixedWindow,
    GrowingWindow,
    Sampler,
    SamplingMetadata,
    TokenPairs,
    TopKTopP,
    apply_penalties,
    seeded_uniform,
    top_k_top_p_head,
)
from engine.sampling_params import SamplingParams
from engine.worker.sampling_metadata import SamplingMetadataBuilder

# --------------------------------------------------------------------------- helpers


TOP_K_TOP_P_KINDS = pytest.mark.parametrize("kind", [GrowingWindow(), FixedWindow()], ids=["growing", "fixed"])


def filter_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                       kind: TopKTopP = GrowingWindow()) -> torch.Tensor:
    """The sampler's top-k/top-p filter as full-vocabulary logits (-inf outside the kept
    set); rows with neither filter are not routed to it, so they stay as they are."""
    out = logits.clone()
    routed = (top_ks > 0) | (top_ps < 1)
    if routed.any():
        ks = top_ks[routed]
        max_top_k = int(ks.max()) if bool((ks > 0).all()) else None  # as the metadata's builder sets it
        kept = kind.kept(logits[routed], ks, top_ps[routed], max_top_k)
        out[routed] = logits[routed].masked_fill(~kept, float("-inf"))
    return out


def make_sequence(row: int, params: SamplingParams, prompt: list[int], output: list[int],
                  bad_words: list[list[int]] | None = None) -> Sequence:
    """A sequence as the engine makes it: with its logits' processing where it has one."""
    seq = Sequence(row, str(row), None, prompt, params)
    seq.token_ids += output
    seq.logits_processing = logits_processing(params, bad_words or [])
    return seq


def build_meta(
    params: list[SamplingParams],
    *,
    vocab: int,
    banned: dict[int, list[int]] | None = None,
    history: dict[int, tuple[list[int], list[int]]] | None = None,
) -> SamplingMetadata:
    """Per-row settings -> SamplingMetadata, through the engine's builder.

    `history[row] = (prompt_ids, output_ids)` (none by default); a seeded row draws its
    token number len(output_ids). `banned[row]` are tokens the row may not take (as
    one-token bad words).
    """
    history, banned = history or {}, banned or {}
    seqs = [make_sequence(row, p, *history.get(row, ([], [])), [[t] for t in banned.get(row, [])])
            for row, p in enumerate(params)]
    return SamplingMetadataBuilder(vocab, set(), torch.device("cpu")).build(seqs)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 1.0, distinct: bool = True) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    for row in logits if distinct else ():  # no ties: transformers' top-k keeps every tie of the k-th value
        assert row.unique().numel() == vocab
    return logits


def hf_top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers, in vLLM's order (top-k, then top-p on what is left)."""
    x = row.unsqueeze(0).clone()
    if top_k > 0:
        x = TopKLogitsWarper(top_k=top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p=top_p)(None, x)
    return x.squeeze(0)


def top_p_margin(row: torch.Tensor, top_k: int, top_p: float) -> float:
    """Distance in float64 between top_p and the nearest 'mass of the more likely tokens'."""
    x = row.double()
    if top_k > 0:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    probs = x.softmax(-1).sort(descending=True).values
    before = probs.cumsum(0) - probs
    return (before - top_p).abs().min().item()


def chi2_critical(df: int, p_value: float = 0.001) -> float:
    """The x with P(Chi2(df) > x) = p_value, by bisection on torch.special.gammaincc."""
    lo, hi = 0.0, 1000.0
    half_df = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if torch.special.gammaincc(half_df, torch.tensor(mid / 2, dtype=torch.float64)).item() > p_value:
            lo = mid
        else:
            hi = mid
    return lo


def chi2_statistic(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


# --------------------------------------------------------------------------- 1. top-k / top-p / min-p


TOP_K_TOP_P_ROWS = [  # (top_k, top_p); 0 / 1.0 = off
    (0, 1.0),
    (1, 1.0),
    (5, 1.0),
    (0, 0.9),
    (0, 0.5),
    (50, 0.95),
    (499, 1.0),
    (20, 0.3),
]


@TOP_K_TOP_P_KINDS
@pytest.mark.parametrize("scale", [1.0, 4.0], ids=["scale1", "scale4"])
def test_top_k_top_p_masks_match_transformers(scale, kind):
    vocab = 500
    logits = random_logits(len(TOP_K_TOP_P_ROWS), vocab, seed=0, scale=scale)
    top_ks = torch.tensor([k for k, _ in TOP_K_TOP_P_ROWS])
    top_ps = torch.tensor([p for _, p in TOP_K_TOP_P_ROWS], dtype=torch.float32)
    for i, (k, p) in enumerate(TOP_K_TOP_P_ROWS):
        if p < 1:  # the random draw must not sit on a float32 rounding boundary
            assert top_p_margin(logits[i], k, p) > 1e-5, f"row {i} too close to the top-p boundary"

    out = filter_top_k_top_p(logits.clone(), top_ks, top_ps, kind)

    mismatches = []
    for i, (k, p) in enumerate(TOP_K_TOP_P_ROWS):
        ref = hf_top_k_top_p(logits[i], k, p)
        ours_inf, ref_inf = torch.isinf(out[i]), torch.isinf(ref)
        if not torch.equal(ours_inf, ref_inf):
            mismatches.append(
                f"row {i} (top_k={k}, top_p={p}): {int((ours_inf & ~ref_inf).sum())} extra -inf, "
                f"{int((ref_inf & ~ours_inf).sum())} missing -inf (kept by ours: {int((~ours_inf).sum())}, "
                f"by transformers: {int((~ref_inf).sum())})"
            )
        # kept logits are passed through unchanged
        assert torch.equal(out[i][~ours_inf], logits[i][~ours_inf])
    assert not mismatches, "masks differ from transformers' warpers:\n" + "\n".join(mismatches)
    # the filter must actually have removed something (guards against a no-op)
    assert torch.isinf(out[2]).sum() == vocab - 5 and torch.isinf(out[1]).sum() == vocab - 1


@TOP_K_TOP_P_KINDS
def test_top_k_only_and_top_p_only_match_transformers(kind):
    vocab = 500
    logits = random_logits(6, vocab, seed=1, scale=2.0)
    ks = [0, 1, 3, 100, 500, 7]
    out = filter_top_k_top_p(logits.clone(), torch.tensor(ks), torch.ones(6), kind)
    for i, k in enumerate(ks):
        assert torch.equal(torch.isinf(out[i]), torch.isinf(hf_top_k_top_p(logits[i], k, 1.0))), f"row {i} k={k}"
    ps = [0.1, 0.5, 0.75, 0.9, 0.99, 0.6]
    for i, p in enumerate(ps):
        assert top_p_margin(logits[i], 0, p) > 1e-5
    out = filter_top_k_top_p(logits.clone(), torch.zeros(6, dtype=torch.long), torch.tensor(ps), kind)
    for i, p in enumerate(ps):
        ref = hf_top_k_top_p(logits[i], 0, p)
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref)), f"row {i} top_p={p}"
    assert (~torch.isinf(out[0])).sum() < (~torch.isinf(out[4])).sum()


@TOP_K_TOP_P_KINDS
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(kind):
    """top_p=5e-324 passes validation (it is above 0) but is 0 in float32: the nucleus still
    holds the most likely token, as at any top_p, instead of none (an index of -1 raised out
    of the sampler, a batch line with such a top_p stopping the whole run)."""
    logits = random_logits(3, 1000, seed=4, scale=3.0)
    out = filter_top_k_top_p(logits, torch.tensor([0, 0, 5]), torch.tensor([5e-324, 1e-45, 5e-324]), kind)
    for row in range(3):
        assert (~torch.isinf(out[row])).nonzero().flatten().tolist() == [int(logits[row].argmax())]


@TOP_K_TOP_P_KINDS
def test_top_p_off_row_is_not_filtered_by_other_rows_top_p(kind):
    """A row with top_p = 1 (off) must keep its whole vocabulary whether or not another
    row of the batch uses top-p (vLLM / transformers never drop a token at top_p = 1)."""
    vocab = 32000
    logits = random_logits(2, vocab, seed=2, scale=3.0, distinct=False)
    top_ks = torch.zeros(2, dtype=torch.long)
    # alone: top_p = 1 filters nothing
    alone = filter_top_k_top_p(logits[1:].clone(), top_ks[1:], torch.ones(1), kind)
    assert torch.equal(alone[0], logits[1])
    hf = TopPLogitsWarper(top_p=1.0)(None, logits[1:].clone())
    assert not torch.isinf(hf).any()
    # next to a top_p=0.5 row: that row is filtered, this one still is not
    batch = filter_top_k_top_p(logits.clone(), top_ks, torch.tensor([0.5, 1.0]), kind)
    assert torch.isinf(batch[0]).any()
    dropped = torch.isinf(batch[1])
    mass = logits[1].double().softmax(-1)[dropped].sum().item()
    assert not dropped.any(), (
        f"top_p=1.0 row lost {int(dropped.sum())} of {vocab} tokens (probability mass {mass:.2e}, "
        f"largest {logits[1].double().softmax(-1)[dropped].max().item():.1e}) in a batch with a top_p=0.5 row; "
        f"alone it keeps all {vocab}"
    )


def test_min_p_mask_matches_transformers_on_temperature_scaled_logits(monkeypatch):
    """min-p is applied to the probabilities after temperature: the logits that reach the
    top-k/top-p filter are min-p-masked logits / T, equal to MinPLogitsWarper on logits / T."""
    vocab = 500
    rows = [  # (temperature, min_p)
        (0.5, 0.0),
        (1.0, 0.05),
        (1.5, 0.1),
        (2.0, 0.3),
        (1.8, 0.5),
        (1.0, 1.0),
        (0.3, 0.02),
        (1.2, 0.0),
    ]
    logits = random_logits(len(rows), vocab, seed=3, scale=2.0)
    # top_k = vocab - 1 routes every row through the filter, whose input we observe.
    params = [SamplingParams(temperature=t, min_p=m, top_k=vocab - 1) for t, m in rows]
    meta = build_meta(params, vocab=vocab)

    seen = []

    def spy(x, top_ks, top_ps):
        seen.append(x.clone())
        return top_k_top_p_head(x, top_ks, top_ps)

    monkeypatch.setattr(sampler_module, "top_k_top_p_head", spy)
    tokens = Sampler(torch.Generator().manual_seed(0))(logits.clone(), meta)
    assert len(seen) == 1, "the sampler did not reach the top-k/top-p filter"
    filtered = seen[0]

    for i, (t, m) in enumerate(rows):
        scaled = logits[i] / t
        probs = scaled.double().softmax(-1)
        if m > 0:  # not on a rounding boundary of the rule prob < min_p * max_prob
            rel = (probs / (m * probs.max()) - 1).abs()
            assert rel.min() > 1e-4 or m == 1.0
        ref = MinPLogitsWarper(min_p=m)(None, scaled.unsqueeze(0).clone()).squeeze(0) if m > 0 else scaled
        ours_inf = torch.isinf(filtered[i])
        assert torch.equal(ours_inf, torch.isinf(ref)), f"row {i} (T={t}, min_p={m})"
        torch.testing.assert_close(filtered[i][~ours_inf], scaled[~ours_inf], rtol=1e-6, atol=1e-6)
        assert not ours_inf[tokens[i].token_id], f"row {i} sampled a token removed by min-p"
    assert torch.isinf(filtered[5]).sum() == vocab - 1  # min_p = 1 keeps only the top token
    for i in (1, 2, 3, 4):  # the rule did real work: some, not all, tokens removed
        assert 0 < torch.isinf(filtered[i]).sum() < vocab - 1
    assert not torch.isinf(filtered[[0, 7]]).any()  # min_p = 0: off


# --------------------------------------------------------------------------- 2. penalties


PENALTY_VOCAB = 30
PENALTY_PARAMS = [
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
    SamplingParams(),  # no penalties: untouched
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.0),
    SamplingParams(presence_penalty=-0.7),
    SamplingParams(repetition_penalty=2.0),
]
PENALTY_HISTORY = {  # row: (prompt ids, output ids), with repeats
    0: ([1, 2, 2, 3, 9, 9, 9], [3, 4, 4, 4, 5, 12]),
    2: ([0, 7, 7], [7, 8, 8, 29, 29, 29, 29]),
    3: ([5, 6], [6, 10, 10]),
    4: ([11, 12, 13, 13], []),
}


def reference_penalties(logits: np.ndarray, params, history) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for row, p in enumerate(params):
        if not p.needs_penalties:
            continue
        prompt, output = history.get(row, ([], []))
        for token in range(out.shape[1]):
            count = sum(1 for t in output if t == token)
            value = out[row, token]
            if token in prompt or count > 0:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            value -= p.frequency_penalty * count
            value -= p.presence_penalty * (1 if count > 0 else 0)
            out[row, token] = value
    return out


def penalty_logits() -> torch.Tensor:
    logits = random_logits(len(PENALTY_PARAMS), PENALTY_VOCAB, seed=4, scale=2.0)
    logits[0, 9] = 0.0  # logit exactly 0 in the prompt: stays 0 under repetition
    assert (logits > 0).any() and (logits < 0).any()
    return logits


def test_apply_penalties_matches_vllm_formulas():
    logits = penalty_logits()
    meta = build_meta(PENALTY_PARAMS, vocab=PENALTY_VOCAB, history=PENALTY_HISTORY)
    p = meta.penalties
    assert p.rows.tolist() == [0, 2, 3, 4]
    assert (p.lengths < p.token_ids.shape[1]).any()  # padding present

    out = logits.clone()
    assert apply_penalties(out, p) is None  # in place
    expected = reference_penalties(logits.numpy(), PENALTY_PARAMS, PENALTY_HISTORY)
    np.testing.assert_allclose(out.numpy().astype(np.float64), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], logits[1])  # row without penalties untouched
    # the test is not vacuous: every penalized row changed, and only where history says so
    for row in (0, 2, 3, 4):
        changed = set(torch.nonzero(out[row] != logits[row]).flatten().tolist())
        prompt, output = PENALTY_HISTORY[row]
        assert changed and changed <= set(prompt) | set(output)
    # row 3 has no repetition penalty: its prompt-only token 5 is untouched, output token 6 is
    assert out[3, 5] == logits[3, 5] and out[3, 6] != logits[3, 6]


def test_process_applies_penalties_and_leaves_input_alone():
    logits = penalty_logits()
    meta = build_meta(PENALTY_PARAMS, vocab=PENALTY_VOCAB, history=PENALTY_HISTORY)
    assert meta.needs_processing
    out = Sampler.process(logits.clone(), meta)
    expected = reference_penalties(logits.numpy(), PENALTY_PARAMS, PENALTY_HISTORY)
    np.testing.assert_allclose(out.numpy().astype(np.float64), expected, rtol=1e-6, atol=1e-6)

    # the sampler must not modify the caller's float32 logits
    before = logits.clone()
    Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- 3. bias / allowed / banned


def test_logit_bias_allowed_and_banned():
    vocab = 40
    logits = random_logits(5, vocab, seed=5)
    params = [
        SamplingParams(logit_bias={3: 2.5, 7: -1.25, 10: 100.0}),  # several in one row: all added
        SamplingParams(allowed_token_ids=[1, 5, 39], logit_bias={5: 0.5, 6: 3.0}),
        SamplingParams(logit_bias={3: -0.5}),
        SamplingParams(),  # banned only
        SamplingParams(),  # untouched
    ]
    banned = {3: [0, 2, 39], 2: [3, 4]}  # row 2: bias on a banned token keeps it -inf
    meta = build_meta(params, vocab=vocab, banned=banned)
    out = Sampler.process(logits.clone(), meta)

    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 7] += -1.25
    expected[0, 10] += 100.0
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[[1, 5, 39]] = True
    expected[1] = expected[1].masked_fill(~keep, float("-inf"))
    expected[1, 5] += 0.5
    expected[2, [3, 4]] = float("-inf")
    expected[3, [0, 2, 39]] = float("-inf")
    assert torch.equal(out, expected)

    # the same in words: exactly the biased positions moved, by exactly their values
    diff = out[0] - logits[0]
    assert torch.nonzero(diff).flatten().tolist() == [3, 7, 10]
    np.testing.assert_allclose(diff[[3, 7, 10]].numpy(), [2.5, -1.25, 100.0], atol=1e-5)
    assert torch.nonzero(torch.isfinite(out[1])).flatten().tolist() == [1, 5, 39]
    assert torch.nonzero(torch.isinf(out[3])).flatten().tolist() == [0, 2, 39]
    assert torch.isfinite(out[[0, 4]]).all() and torch.equal(out[4], logits[4])


def test_logit_bias_accumulates_repeated_entries():
    """Two bias entries for the same (row, token) add up (index_put_ with accumulate)."""
    logits = random_logits(2, 10, seed=6)
    meta = build_meta([SamplingParams(), SamplingParams()], vocab=10)
    meta.bias = TokenPairs(torch.tensor([1, 1, 0]), torch.tensor([4, 4, 4]), torch.tensor([1.5, 2.0, -3.0]))
    out = Sampler.process(logits.clone(), meta)
    assert out[1, 4].item() == pytest.approx(logits[1, 4].item() + 3.5, abs=1e-6)
    assert out[0, 4].item() == pytest.approx(logits[0, 4].item() - 3.0, abs=1e-6)
    changed = torch.nonzero(out != logits).tolist()
    assert changed == [[0, 4], [1, 4]]


# --------------------------------------------------------------------------- 4. greedy


def test_greedy_rows_take_argmax_of_processed_logits():
    vocab = 50
    logits = random_logits(5, vocab, seed=7)
    top = logits.argmax(-1)
    low0 = int(logits[1].argmin())
    second2 = int(logits[2].topk(2).indices[1])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={low0: 50.0}),  # bias moves the argmax
        SamplingParams(temperature=0),  # its argmax is banned
        SamplingParams(temperature=0, repetition_penalty=100.0, frequency_penalty=2.0),
        SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.5),  # ignored when greedy
    ]
    history = {3: ([], [int(top[3])])}
    expected_3 = int(torch.where(torch.arange(vocab) == top[3], float("-inf"), logits[3]).argmax())
    banned = {2: [int(top[2])]}
    expected = [int(top[0]), low0, second2, expected_3, int(top[4])]

    meta = build_meta(params, vocab=vocab, banned=banned, history=history)
    assert meta.all_greedy
    got = [t.token_id for t in Sampler(torch.Generator().manual_seed(0))(logits, meta)]
    assert got == expected

    # the same rows in a mixed batch (all_greedy False): greedy rows still take the argmax
    mixed = params + [SamplingParams(temperature=1.0)]
    mixed_logits = torch.cat([logits, random_logits(1, vocab, seed=8)])
    meta = build_meta(mixed, vocab=vocab, banned=banned, history=history)
    assert not meta.all_greedy
    for seed in range(3):
        got = [t.token_id for t in Sampler(torch.Generator().manual_seed(seed))(mixed_logits, meta)]
        assert got[:5] == expected


# --------------------------------------------------------------------------- 5. logprobs


def check_logprobs(result, raw: torch.Tensor, k: int | None, check_top_ids: bool = True) -> None:
    ref = torch.log_softmax(raw.double(), dim=-1)
    if k is None:
        assert (result.logprob, result.rank, result.top_ids, result.top_logprobs) == (None, None, None, None)
        return
    token = result.token_id
    assert result.logprob == pytest.approx(ref[token].item(), abs=1e-4)
    assert result.rank == 1 + int((ref > ref[token]).sum())
    assert len(result.top_ids) == k and len(result.top_logprobs) == k
    ref_values, ref_ids = ref.topk(k)
    np.testing.assert_allclose(result.top_logprobs, ref_values.numpy(), atol=1e-4)
    if check_top_ids:
        assert result.top_ids == ref_ids.tolist()
    else:  # ties possible: the ids must carry the reported values
        np.testing.assert_allclose(ref[result.top_ids].numpy(), result.top_logprobs, atol=1e-4)


def test_logprobs_are_those_of_the_raw_logits():
    vocab = 100
    logits = random_logits(7, vocab, seed=9, scale=2.0)
    low = int(logits[3].argsort()[10])  # 11th smallest: a bias forces it, its raw rank is 90
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0),  # no logprobs
        SamplingParams(temperature=0.8, logprobs=0),
        SamplingParams(temperature=0, logprobs=5, logit_bias={low: 1000.0}),
        SamplingParams(temperature=1.0, logprobs=1, repetition_penalty=3.0, presence_penalty=2.0,
                       allowed_token_ids=list(range(0, vocab, 2))),
        SamplingParams(temperature=1.0, top_k=10, logprobs=20),
        SamplingParams(temperature=0, logprobs=2),  # its two best logits tie
    ]
    tied = logits[6].topk(2).indices
    logits[6, tied[1]] = logits[6, tied[0]]
    history = {4: (list(range(20)), [int(logits[4].argmax())])}
    meta = build_meta(params, vocab=vocab, history=history)
    results = Sampler(torch.Generator().manual_seed(0))(logits.clone(), meta)
    for i, (result, p) in enumerate(zip(results, params)):
        check_logprobs(result, logits[i], p.logprobs, check_top_ids=i != 6)
    assert results[6].rank == 1 and results[6].token_id in tied.tolist()
    assert sorted(results[6].top_ids) == sorted(tied.tolist())
    assert results[0].rank == 1 and results[0].top_ids[0] == results[0].token_id
    assert results[3].token_id == low and results[3].rank == 90  # raw, not biased, logprob
    assert results[3].logprob < results[3].top_logprobs[-1]
    assert results[4].token_id % 2 == 0
    assert results[2].top_ids == [] and results[2].top_logprobs == []


@pytest.mark.cpu_kinds
def test_logprobs_zero_or_none_everywhere_and_bfloat16_input():
    vocab = 64
    logits = random_logits(3, vocab, seed=10, scale=3.0)
    sampler = Sampler(torch.Generator().manual_seed(0))
    meta = build_meta([SamplingParams(temperature=1.0)] * 3, vocab=vocab)
    assert all(r.logprob is None and r.top_ids is None for r in sampler(logits, meta))
    meta = build_meta([SamplingParams(logprobs=0)] * 3, vocab=vocab)
    for i, r in enumerate(sampler(logits, meta)):
        check_logprobs(r, logits[i], 0)

    bf16 = logits.bfloat16()
    meta = build_meta([SamplingParams(temperature=0, logprobs=4), SamplingParams(logprobs=None),
                       SamplingParams(temperature=0.5, logprobs=2)], vocab=vocab)
    for i, r in enumerate(sampler(bf16, meta)):
        check_logprobs(r, bf16[i], meta.num_logprobs[i], check_top_ids=False)


# --------------------------------------------------------------------------- 6. distribution


STAT_VOCAB = 20
STAT_N = 20000
STAT_T = 0.7
# chi-square critical value at p = 0.001 with 19 degrees of freedom, from standard
# chi-square tables (scipy.stats.chi2.ppf(0.999, 19) = 43.820); cross-checked below.
CHI2_CRITICAL_DF19 = 43.820


def stat_logits() -> torch.Tensor:
    return random_logits(1, STAT_VOCAB, seed=11, scale=1.0)[0]


def draw(row: torch.Tensor, params: SamplingParams | list[SamplingParams], seed: int,
         kind: TopKTopP = GrowingWindow()) -> np.ndarray:
    """Counts of each token in STAT_N draws from `row` (with these settings for every row,
    or one each)."""
    logits = row.unsqueeze(0).expand(STAT_N, -1).contiguous()
    meta = build_meta(params if isinstance(params, list) else [params] * STAT_N, vocab=STAT_VOCAB)
    tokens = [t.token_id for t in Sampler(torch.Generator().manual_seed(seed), kind)(logits, meta)]
    return np.bincount(tokens, minlength=STAT_VOCAB)


def test_chi2_critical_value():
    assert chi2_critical(19) == pytest.approx(CHI2_CRITICAL_DF19, abs=1e-3)


def test_sampled_frequencies_follow_softmax_over_temperature():
    row = stat_logits()
    probs = (row.double() / STAT_T).softmax(-1).numpy()
    assert probs.max() > 0.15 and STAT_N * probs.min() >= 5  # moderately peaked; chi-square valid
    counts = draw(row, SamplingParams(temperature=STAT_T), seed=1234)
    assert counts.sum() == STAT_N
    assert chi2_statistic(counts, probs) < CHI2_CRITICAL_DF19
    # the test has power: the same draws reject the untempered distribution softmax(logits)
    assert chi2_statistic(counts, row.double().softmax(-1).numpy()) > CHI2_CRITICAL_DF19


def test_whole_vocabulary_draw_spans_blocks():
    """A vocabulary of several CDF blocks and a partial last one: frequencies of 20 token
    ranges that straddle the block edges follow softmax."""
    vocab, bins = 4000, 20
    row = random_logits(1, vocab, seed=21, scale=1.5)[0]
    row[3990:] += 4.0  # the partial last block holds real mass
    logits = row.unsqueeze(0).expand(STAT_N, -1).contiguous()
    meta = build_meta([SamplingParams(temperature=1.0)] * STAT_N, vocab=vocab)
    tokens = np.array([t.token_id for t in Sampler(torch.Generator().manual_seed(5))(logits, meta)])
    probs = row.double().softmax(-1).numpy()
    edges = np.linspace(0, vocab, bins + 1).astype(int)
    counts = np.array([((tokens >= a) & (tokens < b)).sum() for a, b in zip(edges[:-1], edges[1:])])
    expected = np.array([probs[a:b].sum() for a, b in zip(edges[:-1], edges[1:])])
    assert STAT_N * expected.min() >= 5
    assert chi2_statistic(counts, expected) < CHI2_CRITICAL_DF19


@TOP_K_TOP_P_KINDS
def test_top_p_samples_stay_in_the_nucleus(kind):
    row = stat_logits()
    probs = (row.double() / STAT_T).softmax(-1)
    top_p = 0.8
    order = probs.argsort(descending=True)
    sorted_probs = probs[order]
    before = sorted_probs.cumsum(0) - sorted_probs
    assert (before - top_p).abs().min() > 1e-4
    nucleus = order[before < top_p]
    outside = np.ones(STAT_VOCAB, dtype=bool)
    outside[nucleus.numpy()] = False
    assert 2 <= len(nucleus) < STAT_VOCAB - 2

    counts = draw(row, SamplingParams(temperature=STAT_T, top_p=top_p), seed=99, kind=kind)
    assert counts[outside].sum() == 0, f"tokens outside the nucleus drawn: {np.nonzero(counts * outside)}"
    renorm = probs[nucleus] / probs[nucleus].sum()
    assert STAT_N * renorm.min().item() >= 5
    stat = chi2_statistic(counts[nucleus.numpy()], renorm.numpy())
    assert stat < chi2_critical(len(nucleus) - 1)


def test_seeded_draws_follow_softmax_over_temperature():
    """Rows with seeds 0, 1, 2, ... (each at its first token) draw like the engine's
    generator does: the frequencies follow softmax(logits / T)."""
    row = stat_logits()
    probs = (row.double() / STAT_T).softmax(-1).numpy()
    counts = draw(row, [SamplingParams(temperature=STAT_T, seed=i) for i in range(STAT_N)], seed=0)
    assert counts.sum() == STAT_N
    assert chi2_statistic(counts, probs) < CHI2_CRITICAL_DF19


# --------------------------------------------------------------------------- 7. top-k/top-p kinds


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0], ids=["flat", "peaked", "spiky"])
def test_both_top_k_top_p_kinds_keep_the_same_tokens(scale):
    """`FixedWindow` (sync-free, for a GPU) keeps exactly the tokens `GrowingWindow` (a
    CPU's) keeps, ties with the cut included: in batches where every row has a top-k (a
    window of the largest) and where some row has top-p alone (the whole row sorted)."""
    vocab = 5000
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(30)) * scale
    logits[::2] = (logits[::2] * 2).round() / 2  # many ties
    with_top_p_alone = ([0, 5, 50, 0, 2000, 0, 1, 40, 0, 300, 0, vocab],
                        [0.9, 1.0, 0.95, 0.5, 1.0, 0.999, 1.0, 0.3, 0.99, 0.8, 0.7, 0.6])
    all_top_k = ([3, 5, 50, 700, 2000, 17, 1, 40, 9, 300, 64, 100],
                 [0.9, 1.0, 0.95, 0.5, 1.0, 0.999, 1.0, 0.3, 0.99, 0.8, 0.7, 1.0])
    for ks, ps in (with_top_p_alone, all_top_k):
        top_ks, top_ps = torch.tensor(ks), torch.tensor(ps)
        max_top_k = max(ks) if all(ks) else None
        growing = GrowingWindow().kept(logits, top_ks, top_ps, max_top_k)
        fixed = FixedWindow().kept(logits, top_ks, top_ps, max_top_k)
        assert torch.equal(fixed, growing)
        kept = growing.sum(dim=-1)
        assert (kept < vocab).all() and (kept > 0).all()
        for i, k in enumerate(ks):
            if 0 < k < vocab:
                assert kept[i] >= k or ps[i] < 1  # ties with the k-th keep more than k


@TOP_K_TOP_P_KINDS
def test_narrowed_rows_draw_only_kept_tokens(kind):
    logits = random_logits(6, 3000, seed=31, scale=3.0, distinct=False)
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.6), SamplingParams(top_k=300, top_p=0.9),
              SamplingParams(top_k=1, temperature=1.0), SamplingParams(top_p=0.99, temperature=1.5),
              SamplingParams(top_k=40, min_p=0.2)]
    meta = build_meta(params, vocab=3000)
    group = meta.draws[0]
    assert group.rows.tolist() == [0, 1, 2, 4, 5] and meta.greedy_rows.tolist() == [3]
    sampler = Sampler(torch.Generator().manual_seed(0), kind)
    scaled = logits[group.rows] / group.temperatures.unsqueeze(1)
    kept = kind.kept(scaled, group.top_ks, group.top_ps, group.max_top_k)
    for _ in range(20):
        tokens = torch.tensor([t.token_id for t in sampler(logits, meta)])
        assert kept.gather(1, tokens[group.rows].unsqueeze(1)).all()
        assert tokens[3] == logits[3].argmax()


# --------------------------------------------------------------------------- 8. seeded rows


def seeded_tokens(position: int, others: list[SamplingParams], target: SamplingParams, engine_seed: int,
                  kind: TopKTopP = GrowingWindow(), steps: int = 30) -> list[int]:
    """Tokens drawn step after step for the row with settings `target` at `position` among
    `others`; each row's output grows by its token every step, as in the engine."""
    vocab = 50
    params = list(others)
    params.insert(position, target)
    own = random_logits(1, vocab, seed=12)[0]
    other_logits = random_logits(max(len(params), 2), vocab, seed=13)
    logits = torch.stack([own if i == position else other_logits[i] for i in range(len(params))])
    seqs = [make_sequence(row, p, [1, 2, 3], []) for row, p in enumerate(params)]
    sampler = Sampler(torch.Generator().manual_seed(engine_seed), kind)
    drawn = []
    for _ in range(steps):
        tokens = [t.token_id for t in sampler(logits, SamplingMetadataBuilder(vocab, set(), CPU).build(seqs))]
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
        drawn.append(tokens[position])
    return drawn


CPU = torch.device("cpu")


@TOP_K_TOP_P_KINDS
@pytest.mark.parametrize("target", [SamplingParams(temperature=1.0, seed=7),
                                    SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=7)],
                         ids=["whole_vocabulary", "narrowed"])
def test_seeded_row_is_independent_of_the_batch(target, kind):
    alone = seeded_tokens(0, [], target, engine_seed=0, kind=kind)
    batch_a = seeded_tokens(2, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, seed=99),
                                SamplingParams(temperature=1.3, top_k=5)], target, engine_seed=1, kind=kind)
    batch_b = seeded_tokens(0, [SamplingParams(temperature=0), SamplingParams(temperature=1.0, min_p=0.1)],
                            target, engine_seed=2, kind=kind)
    batch_c = seeded_tokens(1, [SamplingParams(temperature=1.0, seed=7)], target, engine_seed=3, kind=kind)
    assert len(set(alone)) > 5  # a real random sequence, not a constant
    assert batch_a == alone
    assert batch_b == alone
    assert batch_c == alone
    other_seed = dataclasses.replace(target, seed=8)
    assert seeded_tokens(0, [], other_seed, engine_seed=0, kind=kind) != alone
    assert seeded_tokens(1, [SamplingParams(temperature=1.0)], other_seed, engine_seed=4, kind=kind) != alone


def test_a_seeded_row_draws_by_its_seed_and_the_count_of_its_tokens():
    """Token number i of a row seeded with s draws with seeded_uniform(s, i), whatever its
    tokens are and whatever came before (so a preempted row, recomputed, draws on)."""
    params = SamplingParams(temperature=1.0, seed=5)
    seqs = [make_sequence(0, params, [1, 2], []), make_sequence(1, params, [9], [4, 4, 4]),
            make_sequence(2, SamplingParams(temperature=1.0), [1], [3]),
            make_sequence(3, SamplingParams(temperature=1.0, seed=6), [7, 7, 7, 7], [1, 2, 3])]
    [group] = SamplingMetadataBuilder(50, set(), CPU).build(seqs).draws
    assert group.seeded.tolist() == pytest.approx([seeded_uniform(5, 0), seeded_uniform(5, 3), -1.0,
                                                   seeded_uniform(6, 3)], abs=0)
    assert not group.all_seeded
    [group] = SamplingMetadataBuilder(50, set(), CPU).build([seqs[0], seqs[3]]).draws
    assert group.all_seeded
    [group] = SamplingMetadataBuilder(50, set(), CPU).build([seqs[2]]).draws
    assert group.seeded is None


def test_seeded_uniform_numbers_are_uniform_and_distinct():
    """24-bit numbers in [0, 1), a function of (seed, index) only, spread evenly over 20 bins
    along consecutive indices and along consecutive seeds (users seed 0, 1, 2, ...); big,
    negative and derived seeds work."""
    assert seeded_uniform(3, 10) == seeded_uniform(3, 10)
    along_index = np.array([seeded_uniform(42, i) for i in range(STAT_N)])
    along_seed = np.array([seeded_uniform(s, 0) for s in range(STAT_N)])
    for numbers in (along_index, along_seed):
        assert numbers.min() >= 0 and numbers.max() < 1
        assert np.all(numbers * 2**24 == np.floor(numbers * 2**24))
        assert len(set(numbers.tolist())) > STAT_N * 0.99
        counts = np.bincount((numbers * 20).astype(int), minlength=20)
        assert chi2_statistic(counts, np.full(20, 1 / 20)) < CHI2_CRITICAL_DF19
    assert abs(np.corrcoef(along_index[:-1], along_index[1:])[0, 1]) < 0.03
    for seed in (2**64 - 1, -(2**63), 2**70 + 3, hash((5, 2)) & (2**63 - 1)):
        assert 0 <= seeded_uniform(seed, 1) < 1
    assert seeded_uniform(1, 0) != seeded_uniform(2, 0) and seeded_uniform(1, 0) != seeded_uniform(1, 1)


def test_unseeded_rows_follow_the_engine_generator():
    vocab = 50
    logits = random_logits(4, vocab, seed=14)
    meta = build_meta([SamplingParams(temperature=1.0)] * 4, vocab=vocab)

    def run(seed):
        sampler = Sampler(torch.Generator().manual_seed(seed))
        return [[t.token_id for t in sampler(logits, meta)] for _ in range(10)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_greedy_tokens_are_torch_argmax_on_hostile_rows():
    """The compiled argmax (on a CPU where it is built) gives torch.argmax's index: the first of
    tied largest values, a row's first NaN, index 0 for a row of -inf, widths that are not a
    multiple of the vector, a row's last entry, a strided view."""
    from engine.kernels import cpu_build, cpu_sampling
    from engine.sample.sampler import greedy_tokens

    assert (cpu_sampling.argmax_rows(torch.zeros(1, 3)) is None) == (cpu_build.load() is None)
    torch.manual_seed(0)
    for width in (1, 7, 8, 13, 49152):
        logits = torch.randn(12, width)
        logits[1] = float("-inf")
        logits[2, -1] = 1e30
        if width > 3:
            logits[3, [1, 3]] = 1e9
            logits[4, [2, width - 1]] = float("nan")
            logits[5] = float("-inf")
            logits[5, 2], logits[5, 3] = -0.0, 0.0
            logits[6, width // 2] = float("inf")
        for rows in (logits, logits[::2], logits[:, : max(1, width - 1)]):
            assert torch.equal(greedy_tokens(rows), rows.argmax(dim=-1)), width
