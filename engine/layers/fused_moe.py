"""The mixture-of-experts feed-forward layer (Mixtral, Qwen2-MoE, Qwen3-MoE): the router's
choice of experts per token, and the experts' SwiGLU products summed by routing weight.

On a CPU the experts run as grouped products that skip idle experts: the step's
(token, expert) slots are sorted by expert once, and each expert that received slots
multiplies just their rows, through oneDNN's prepacked weights like every `Linear`, in a
C++ operator that runs one expert per thread (`engine/kernels/cpu_fused_moe.cpp`; PyTorch's
operations where it cannot be built). A GPU runs them in the fused Triton kernel
(`engine.kernels.triton.fused_moe`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_build
from engine.layers.linear import MIN_ROWS, prepack, project

if TYPE_CHECKING:
    from engine.distributed.communicator import TensorParallelGroup


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top_k` experts of each token and their routing weights, as transformers' routers
    choose them: softmax over all experts in float32, top-k, then (`renormalize`: Mixtral
    always, Qwen2-MoE/Qwen3-MoE with `norm_topk_prob`) division by the top-k's sum.

    Returns (weights [tokens, top_k] float32, ids [tokens, top_k] int64). Qwen2-MoE and
    Qwen3-MoE then round the weights to the logits' dtype (Mixtral does not): a model
    matching them casts `weights.to(router_logits.dtype)` itself."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEMethod(Protocol):
    """How a quantized `FusedMoE` stores and multiplies its experts (`engine.quantization`)."""

    def process_weights(self, layer: "FusedMoE") -> None:
        """Replaces the loaded w13 and w2 with the method's form of them."""

    def apply(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The layer's output for one rank (as `FusedMoE.forward` before its all-reduce)."""


# An expert's SwiGLU of its rows: expert(e, rows [n, H]) -> [n, H] in the rows' dtype.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's two matrices in oneDNN's layout: w13[e] [2 * I, H], w2[e] [H, I]."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU experts: w13 [E, 2 * I, H] holds each expert's gate rows then its
    up rows (as transformers' `gate_up_proj`), w2 [E, H, I] its down matrix (`down_proj`).

    Tensor parallelism splits every expert's intermediate dimension: each rank holds
    I = intermediate_size / ranks of it (rank r the r-th slice: rows of the checkpoint's
    gate and up, columns of its down), and the partial outputs are summed over the ranks.

    `kernel`, when set (see `engine.model_loader.kernel_routing`), computes the experts in one
    fused call: kernel(x, w13, w2, topk_weights, topk_ids). `packed` holds the experts'
    matrices in oneDNN's layout once `prepack` has run (the 3-D weights are then empty);
    they are opaque tensors without a storage, so a count of the weights' bytes adds their
    numel * element_size as it does for `Linear.packed_weight`. With a `quant_method`
    (`engine.quantization`) `prepack` quantizes the experts instead and the method runs them.
    """

    kernel: Callable | None = None
    packed: PackedExperts | None = None
    quant_method: MoEMethod | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 group: "TensorParallelGroup | None" = None) -> None:
        super().__init__()
        local = intermediate_size // (group.size if group is not None else 1)
        self.group = group
        self.num_experts = num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local))

    def prepack(self) -> None:
        """Reorders every expert's matrices for oneDNN where that helps (`Linear.prepack`)
        and drops the 3-D originals, which the packed copies replace; a no-op where the
        plain product is used, or where the Triton kernel runs, which reads the 3-D weights."""
        if self.quant_method is not None:
            if self.w13.numel():
                self.quant_method.process_weights(self)
            return
        if self.packed is not None or self.kernel is not None:
            return
        packed = PackedExperts([prepack(w) for w in self.w13], [prepack(w) for w in self.w2])
        if any(matrix is None for matrix in packed.w13 + packed.w2):
            return
        self.packed = packed
        self.w13 = nn.Parameter(torch.empty(0, dtype=self.w13.dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=self.w2.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) with
        e = topk_ids[t, j], for x [T, H]; [T, H] in x's dtype."""
        if self.kernel is not None:
            out = self.kernel(x, self.w13, self.w2, topk_weights, topk_ids)
        elif self.quant_method is not None:
            out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        elif self.packed is not None and (kernels := cpu_build.load()) is not None:
            out = kernels.fused_moe(x, topk_weights, topk_ids, self.packed.w13, self.packed.w2, MIN_ROWS)
        else:
            out = self.grouped(x, topk_weights, topk_ids, self._expert)
        if self.group is not None and self.group.size > 1:
            self.group.all_reduce(out)
        return out

    def grouped(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert: ExpertFn) -> torch.Tensor:
        """The experts as one call of `expert` per expert that received slots, on its rows,
        in PyTorch's operations; the C++ operators compute the same.

        A token's slots are added into the float32 sum in expert order (the stable sort
        keeps it), as transformers adds them: its result depends on its own experts only,
        and each product's rows on nothing else in the batch (`project`)."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // top_k
        rows = x.index_select(0, tokens)
        outputs, start = [], 0
        for index, count in enumerate(torch.bincount(flat_ids, minlength=self.num_experts).tolist()):
            if count:
                outputs.append(expert(index, rows[start : start + count]))
            start += count
        # The weights in float32 first: a float32 product with bfloat16 weights (Qwen's, rounded)
        # takes ATen's mixed-dtype path, several times slower at prefill sizes; same bits.
        weights = topk_weights.reshape(-1)[order].float()
        weighted = torch.cat(outputs).float().mul_(weights[:, None])
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, weighted)
        return out.to(x.dtype)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU of `rows` [n, H], in their dtype."""
        if self.packed is not None:  # project reads the packed matrices, not the emptied weights
            (w13, w2), (packed13, packed2) = (self.w13, self.w2), (self.packed.w13[expert], self.packed.w2[expert])
        else:
            (w13, w2), (packed13, packed2) = (self.w13[expert], self.w2[expert]), (None, None)
        gate, up = project(rows, w13, packed13).chunk(2, dim=-1)
        return project(F.silu(gate).mul_(up), w2, packed2)
