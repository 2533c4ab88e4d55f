"""Linear layers whose matrix products run through the kernel this CPU does best, may
add per-request LoRA deltas, and may be split over tensor-parallel ranks (column- or
row-parallel, as in Megatron-LM and vLLM)."""

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.hardware import ONEDNN_ISA_ENV, detect_cpu, keep_onednn_off_amx

if TYPE_CHECKING:
    from engine.distributed.communicator import TensorParallelGroup

logger = logging.getLogger(__name__)

# oneDNN may take another kernel for very few rows, whose sums could round differently
# from the many-row kernel's (measured in bfloat16 on AVX-512: a single row did): a
# token's result would depend on how many others share its step. Padding to this many
# rows keeps it the same.
MIN_ROWS = 8


def linear_kernel(dtype: torch.dtype, device: torch.device) -> str:
    """"onednn" (the weight prepacked once into oneDNN's blocked layout) or "aten"
    (`F.linear`, MKL's sgemm for float32 on x86).

    oneDNN serves float32 on every CPU, and bfloat16 wherever its bfloat16 kernels run
    (`CpuInfo.onednn_bf16`; they refuse AVX2-only CPUs). Measured on an AVX2 EPYC in
    float32: a row's result is the same bits whatever the batch's size and the row's
    place in it, where MKL's differs for batches under 4 or 9 rows; and it is 1.1-1.8x
    faster at the language-model head's shape. Likewise in bfloat16 on AVX-512 without
    AVX512-BF16 (oneDNN capped at that instruction set on a Zen 5), where `F.linear`'s
    rows differed at 1, 2, 3, 5 and 13 rows at a time and the prepacked ones at none.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "aten"
    if dtype == torch.float32 or (dtype == torch.bfloat16 and detect_cpu().onednn_bf16):
        return "onednn"
    return "aten"


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] reordered for oneDNN where `linear_kernel` picks it; None
    where the plain product is used (or oneDNN refuses this CPU after all)."""
    if linear_kernel(weight.dtype, weight.device) != "onednn":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError as error:
        logger.warning("oneDNN refused to prepack a %s weight (%s); using F.linear", weight.dtype, error)
        return None


def project(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), through the prepacked weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows < MIN_ROWS:
        x = F.pad(x, (0, 0, 0, MIN_ROWS - rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


def rows_kept_apart(dtype: torch.dtype) -> bool:
    """Whether this process's `project` gives a row of `dtype` the same bits whatever the
    number of rows it shares a product with: a product of the shape where AMX's rows
    differed at every row count tried (1,536 inputs x 576 outputs, on a Sapphire Rapids),
    computed whole and 1, 13 and 32 rows at a time. A few milliseconds."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=generator).to(dtype)
    x = torch.randn(64, 1536, generator=generator).to(dtype)
    packed = prepack(weight)
    whole = project(x, weight, packed)
    return all(torch.equal(torch.cat([project(x[i : i + rows], weight, packed) for i in range(0, len(x), rows)]),
                           whole) for rows in (1, 13, 32))


def enforce_batch_invariance(dtype: torch.dtype) -> None:
    """Makes this process's products in `dtype` keep a row's bits apart from its batch
    (the engine's `batch_invariant=True` on a CPU): for bfloat16 on an AMX CPU oneDNN is
    capped below AMX (`keep_onednn_off_amx`) and a product checked. Every other kind's
    kernels keep rows apart already, as do float32's on AMX (measured on a Sapphire Rapids).

    Raises:
        RuntimeError: oneDNN in this process runs kernels whose rows depend on the batch
            (it had started before the cap, or ONEDNN_MAX_CPU_ISA lets it use AMX), naming the fix.
    """
    cpu = detect_cpu()
    if not cpu.amx or dtype != torch.bfloat16:
        return
    keep_onednn_off_amx(cpu)
    if rows_kept_apart(torch.bfloat16):
        return
    setting = os.environ.get(ONEDNN_ISA_ENV)
    raise RuntimeError(
        "batch_invariant=True: oneDNN in this process runs AMX kernels, whose bfloat16 rows depend on how many rows "
        f"share a product ({ONEDNN_ISA_ENV}={setting}); oneDNN reads that cap once, before its first product, and "
        "this process had run one already. Create the LLM in a fresh process (or before any other PyTorch product "
        f"on the CPU), or start the process with {ONEDNN_ISA_ENV}=AVX512_CORE_BF16")


class LinearMethod(Protocol):
    """How a quantized `Linear` stores and multiplies its weight (`engine.quantization`)."""

    def create_weights(self, layer: "Linear") -> None:
        """Readies the layer for the checkpoint's tensors, before the model is materialized."""

    def process_weights(self, layer: "Linear") -> None:
        """Replaces the loaded weight with the method's form of it (once: a second call
        does nothing)."""

    def apply(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias) in x's dtype."""


class LoRADeltas(Protocol):
    """A projection's LoRA adapter slots (`engine.lora.slots.LoRASlots`): each request's
    adapter delta added to its rows of the output."""

    def add_deltas(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds each row's adapter delta to `out`, in place, and returns it."""


@dataclass(frozen=True)
class ShardSlice:
    """The part of a checkpoint tensor one tensor-parallel rank holds: `length` entries
    of dimension `dim` (0: output features, 1: input features) from `start`, of `full`."""

    dim: int
    start: int
    length: int
    full: int

    @classmethod
    def even(cls, dim: int, full: int, rank: int, size: int) -> "ShardSlice | None":
        """Rank `rank`'s equal share of `full` entries; None (all of it) for one rank."""
        if size == 1:
            return None
        length = full // size
        return cls(dim, rank * length, length, full)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slice of a whole tensor in memory."""
        return tensor.narrow(self.dim, self.start, self.length)


class StoredTensor(Protocol):
    """A checkpoint tensor as the loader reads it (`engine.model_loader.weights.CheckpointTensor`,
    or a pre-quantized projection's `engine.quantization.checkpoint.QuantizedTensor`)."""

    shape: tuple[int, ...]

    def read(self, piece: "ShardSlice | None" = None) -> torch.Tensor:
        """The tensor, or the slice `piece` of it a tensor-parallel rank holds."""


class Linear(nn.Linear):
    """`nn.Linear` whose weight may be reordered once into oneDNN's blocked layout.

    On a CPU the prepacked product skips reordering the weight on every call (bfloat16
    at decode shapes: 64x576 by 576x3072, 0.60 ms against 1.10 ms) and gives a row the
    same bits whatever else is in the batch, so a seeded request's output does not
    depend on its neighbours. Other devices, and bfloat16 on CPUs where oneDNN does not
    run it (AVX2-only), use `F.linear`.

    With LoRA enabled, `lora` holds this projection's adapter slots and adds each
    adapter's delta to the rows of the requests that use it. With a `quant_method`
    (`engine.quantization`) the weight is quantized at `prepack` and the method computes
    the product; `quantizable` False keeps a projection in the model's dtype, and
    `stored_quantized` False says that a quantized checkpoint stores this weight in the dtype
    (a vision tower's), so that only a method at load (int8, FP8) quantizes it.
    """

    packed_weight: torch.Tensor | None = None
    lora: LoRADeltas | None = None
    quant_method: "LinearMethod | None" = None
    quantizable = True
    stored_quantized = True
    # Rows of each checkpoint tensor stacked here (q/k/v, gate/up; one when not fused).
    shard_sizes: list[int] | None = None
    # For each of them, the slice of the checkpoint tensor this rank holds (None: all).
    checkpoint_slices: list[ShardSlice | None] | None = None

    def prepack(self) -> None:
        """Quantizes the weight with the layer's method, or else reorders it for oneDNN
        where that helps; either drops the original copy."""
        if self.quant_method is not None:
            self.quant_method.process_weights(self)
        if self.quant_method is None and self.packed_weight is None:
            self.packed_weight = prepack(self.weight)
            if self.packed_weight is not None:
                self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T (+ bias) as float32. On a GPU a 16-bit product keeps its float32
        accumulator instead of rounding the result to 16 bits (for logits, where that
        rounding turns near-ties into ties: 52 -> 58 of 64 greedy prompts agreeing with
        float32 on the embedded model, H100)."""
        plain = self.lora is None and self.quant_method is None
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and plain:
            out = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            return out if self.bias is None else out + self.bias.float()
        return self(x).float()

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias), by the layer's quantization method or the prepacked weight."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return project(x, self.weight, self.packed_weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, self.bias)
        if self.lora is not None:
            out = self.lora.add_deltas(x, out)
        return out


class ColumnParallelLinear(Linear):
    """A projection whose output features are split over the tensor-parallel ranks: each
    rank computes its share of the outputs from the whole input, and nothing is summed.
    A fused projection stacks several checkpoint tensors (q, k, v): `slices` says which
    rows of each this rank holds (None: all of it, for one rank). `padded_sizes`, when
    given, are the rows each takes here, at least the slice's (a padded vocabulary)."""

    def __init__(self, in_features: int, full_sizes: list[int], slices: list[ShardSlice | None], bias: bool,
                 padded_sizes: list[int] | None = None) -> None:
        sizes = padded_sizes or [size if piece is None else piece.length for size, piece in zip(full_sizes, slices)]
        super().__init__(in_features, sum(sizes), bias=bias)
        self.shard_sizes = sizes
        self.checkpoint_slices = slices

    @classmethod
    def split(cls, in_features: int, full_sizes: list[int], group: "TensorParallelGroup",
              bias: bool) -> "ColumnParallelLinear":
        """Each stacked tensor split evenly over the group's ranks."""
        return cls(in_features, full_sizes, [ShardSlice.even(0, n, group.rank, group.size) for n in full_sizes], bias)


class RowParallelLinear(Linear):
    """A projection whose input features are split over the tensor-parallel ranks: each
    rank multiplies its share of the input (the output of a column-parallel layer, which
    is already split that way) and the partial outputs are summed over the ranks (one
    all-reduce), the bias added once after the sum. A LoRA delta is partial too (A's
    columns split like the weight's) and is summed with the product."""

    def __init__(self, in_features: int, out_features: int, group: "TensorParallelGroup", bias: bool) -> None:
        super().__init__(in_features // group.size, out_features, bias=bias)
        self.group = group
        self.shard_sizes = [out_features]
        self.checkpoint_slices = [ShardSlice.even(1, in_features, group.rank, group.size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(x)
        out = self.product(x, None)
        if self.lora is not None:
            out = self.lora.add_deltas(x, out)
        self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias
