"""Sampling reads nothing back from the device: with the sync-free top-k/top-p head
(`FixedWindow`, what a GPU gets) a mixed batch samples under `no_host_sync`, which raises
at every operation that would make the host wait for a GPU. It runs on CPU tensors, where
the same Python and aten calls are made as on a GPU.

A host sync shows up at one of two levels: a Python method that turns a tensor into host
values (`.tolist()`, `.item()`, `bool()`, `int()`, `.numpy()`, ...; on a CPU tensor these
reach no aten operator at all, so a `TorchFunctionMode` catches them), or an aten operator
whose output depends on the values read (`nonzero`, boolean-mask indexing, `unique`, ...,
and `_local_scalar_dense`, which every scalar read on a GPU becomes: a `TorchDispatchMode`).
A tensor made from host data (`torch.tensor(list)`) is refused too: on a GPU it is a
blocking copy, and `upload` (when the metadata is built) is the way up.
"""

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.sequence import Sequence, logits_processing
from engine.sample.sampler import FixedWindow, GrowingWindow, Sampler, SamplingMetadata
from engine.sampling_params import SamplingParams
from engine.worker.sampling_metadata import SamplingMetadataBuilder


class HostSync(AssertionError):
    """An operation that reads device values on the host."""


_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__complex__, torch.Tensor.__index__, torch.Tensor.__array__,
    torch.Tensor.__format__, torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.cpu,
    torch.tensor, torch.as_tensor, torch.from_numpy,
}

_VALUE_SHAPED = {  # aten operators whose output's size depends on the values, or that return a host value
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.argwhere.default,
    torch.ops.aten.masked_select.default, torch.ops.aten._unique.default, torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default, torch.ops.aten.bincount.default,
    torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default,
}


class _NoHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            raise HostSync(f"{func.__qualname__} reads tensor values on the host")
        if func is torch.Tensor.to and not kwargs.get("non_blocking") and _names_cpu(args[1:], kwargs):
            raise HostSync("a blocking copy to the host")
        return func(*args, **kwargs)


class _NoValueShapedOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_SHAPED:
            raise HostSync(f"{func} reads tensor values on the host")
        if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_):
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                raise HostSync(f"{func} with a boolean mask")
        if func.overloadpacket is torch.ops.aten.repeat_interleave and kwargs.get("output_size") is None:
            raise HostSync(f"{func} without output_size")
        return func(*args, **kwargs)


def _names_cpu(args: tuple, kwargs: dict) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raises `HostSync` at any operation inside that would make the host wait for a GPU."""
    with _NoHostReads(), _NoValueShapedOps():
        yield


# --------------------------------------------------------------------------- the guard bites


DELIBERATE_SYNCS = {
    "tolist": lambda x: x.tolist(),
    "item": lambda x: x[0].item(),
    "bool": lambda x: bool(x[0] > 0),
    "if any": lambda x: 1 if (x > 0).any() else 0,
    "int max": lambda x: int(x.max()),
    "float": lambda x: float(x[0]),
    "index a list": lambda x: [0, 1, 2][x[0].long().clamp(0, 2)],
    "range": lambda x: range(x[0].long()),
    "numpy": lambda x: x.numpy(),
    "print": lambda x: f"{x}",
    "cpu": lambda x: x.cpu(),
    "to cpu": lambda x: x.to("cpu"),
    "nonzero": lambda x: x.nonzero(),
    "where one argument": lambda x: torch.where(x > 0),
    "mask index": lambda x: x[x > 0],
    "mask assign": lambda x: x.__setitem__(x > 0, 0.0),
    "masked_select": lambda x: x.masked_select(x > 0),
    "unique": lambda x: x.unique(),
    "repeat_interleave": lambda x: torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3])),
    "host list up": lambda x: torch.tensor([1, 2, 3], device=x.device),
    "equal": lambda x: torch.equal(x, x),
}


@pytest.mark.parametrize("sync", DELIBERATE_SYNCS.values(), ids=DELIBERATE_SYNCS.keys())
def test_the_guard_catches_each_kind_of_host_sync_on_cpu_tensors(sync):
    x = torch.randn(8)
    sync(x.clone())  # harmless outside the guard
    with pytest.raises(HostSync), no_host_sync():
        sync(x)


def test_the_guard_lets_shape_static_work_through():
    x = torch.randn(4, 50)
    rows = torch.tensor([2, 0])
    with no_host_sync():
        y = x.index_select(0, rows).softmax(-1).topk(5).values
        z = x.masked_fill(x < 0, float("-inf")).sort(dim=-1).values.cumsum(-1)
        x[rows, rows] = 1.0
        torch.where(x > 0, x, 0.0).argmax(-1)
        x.to(torch.float64)
    assert y.shape == (2, 5) and z.shape == (4, 50)


# --------------------------------------------------------------------------- sampling under the guard


VOCAB = 3000


def mixed_batch() -> list[Sequence]:
    """Every kind of row: greedy (and top_k=1), temperature, top-k, top-p, both, min-p,
    seeded ones, penalties, allowed/banned tokens, logit bias, logprobs."""
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.9, seed=11, logprobs=0),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.1, top_p=0.9, seed=12),
        SamplingParams(temperature=0.7, top_k=100, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                       seed=13),
        SamplingParams(temperature=1.0, allowed_token_ids=[3, 9, 27], logit_bias={9: 2.0}),
        SamplingParams(temperature=0.6, top_p=0.5, logit_bias={1: -3.0, 5: 4.0}, min_tokens=10),
    ]
    seqs = []
    for row, p in enumerate(params):
        seq = Sequence(row, str(row), None, [row + 1, 7, 7, 300], p)
        seq.token_ids += [7, 12, 12][: row % 4]
        seq.logits_processing = logits_processing(p, [[2], [8, 10]] if row == 2 else [])
        seqs.append(seq)
    return seqs


def build(seqs: list[Sequence], vocab: int = VOCAB) -> SamplingMetadata:
    return SamplingMetadataBuilder(vocab, {0}, torch.device("cpu")).build(seqs)


def sample_under_guard(seqs: list[Sequence], logits: torch.Tensor, sampler: Sampler) -> list[int]:
    meta = build(seqs, logits.shape[1])  # on the host, before sampling: it may read
    with no_host_sync():
        output = sampler.sample(logits, meta)
    return [entry.token_id for entry in output.entries()]


def test_a_mixed_batch_samples_without_a_host_sync():
    seqs = mixed_batch()
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    fixed = Sampler(torch.Generator().manual_seed(0), FixedWindow())
    tokens = sample_under_guard(seqs, logits, fixed)
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    assert tokens[9] in (3, 9, 27)
    # the CPU's head reads window sizes back: the guard sees it, so the test above can fail
    with pytest.raises(HostSync):
        sample_under_guard(seqs, logits, Sampler(torch.Generator().manual_seed(0), GrowingWindow()))


def test_only_the_top_k_top_p_head_differs_between_the_two_kinds():
    """Both heads give the same tokens to rows that do not narrow, and the same kept sets
    (test_sampler.py) to those that do; the seeded rows draw the same numbers."""
    seqs = mixed_batch()
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    fixed = Sampler(torch.Generator().manual_seed(0), FixedWindow())(logits, build(seqs))
    growing = Sampler(torch.Generator().manual_seed(0), GrowingWindow())(logits, build(seqs))
    not_narrowed = [0, 1, 2, 3, 7, 8, 9]  # greedy, or drawing over the whole vocabulary
    assert [fixed[i].token_id for i in not_narrowed] == [growing[i].token_id for i in not_narrowed]


def test_a_grammar_row_samples_without_a_host_sync(tiny_models):
    from transformers import AutoTokenizer

    from engine.structured_output.manager import StructuredOutputManager
    from engine.structured_output.params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    vocab = 320  # the tiny model's
    manager = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id])
    seqs = mixed_batch()
    seqs[4].grammar = manager.grammar(StructuredOutputsParams(regex=r"[0-9]{3}"))
    seqs[0].grammar = manager.grammar(StructuredOutputsParams(choice=["yes", "no"]))
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(2)) * 3
    tokens = sample_under_guard(seqs, logits, Sampler(torch.Generator().manual_seed(0), FixedWindow()))
    assert tokenizer.decode([tokens[4]]).strip().isdigit()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_mixed_batch_samples_on_a_gpu_without_a_sync(tiny_models):
    """On a GPU the sampler picks `FixedWindow`, and CUDA's own detector of synchronizing
    calls agrees with the guard, a grammar row (xgrammar's GPU kernel) included."""
    from transformers import AutoTokenizer

    from engine.structured_output.manager import StructuredOutputManager
    from engine.structured_output.params import StructuredOutputsParams

    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    vocab = 320  # the tiny model's
    seqs = mixed_batch()
    seqs[4].grammar = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id]).grammar(
        StructuredOutputsParams(regex=r"[0-9]{3}"))
    meta = SamplingMetadataBuilder(vocab, {0}, device).build(seqs)
    logits = torch.randn(len(seqs), vocab, device=device) * 3
    sampler = Sampler(torch.Generator(device).manual_seed(0))
    assert isinstance(sampler.top_k_top_p, FixedWindow)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with no_host_sync():
            output = sampler.sample(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = output.to_host().token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokenizer.decode([tokens[4]]).strip().isdigit()
