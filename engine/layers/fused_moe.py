"""The mixture-of-experts feed-forward layer: the router's choice of experts per token
(`Routing`: Mixtral's and Qwen's softmax, gpt-oss's, DeepSeek-V2/V3's grouped and Llama 4's
sigmoid routers), and the experts' SwiGLU products summed by routing weight (`FusedMoE`;
gpt-oss's experts add biases and clamp their SwiGLU, `ClampedSwiGLU`; Llama 4's take the
weight on their input).

On a CPU the experts run as grouped products that skip idle experts: the step's
(token, expert) slots are sorted by expert once, and each expert that received slots
multiplies just their rows, through oneDNN's prepacked weights like every `Linear`, in a
C++ operator that runs one expert per thread (`engine/kernels/cpu_fused_moe.cpp`; PyTorch's
operations where it cannot be built, and for experts with biases or the clamped SwiGLU,
which that operator does not compute). A GPU runs them in the fused Triton kernel
(`engine.kernels.triton.fused_moe`), every variant included.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.kernels import cpu_build
from engine.layers.linear import MIN_ROWS, prepack, project

if TYPE_CHECKING:
    from engine.distributed.communicator import TensorParallelGroup



@dataclass(frozen=True)
class Routing:
    """How a family's router turns its logits [tokens, experts] into each token's `top_k`
    experts and their weights (`select`); the defaults are Mixtral's and Qwen's.

    `scoring`: "softmax" over the experts or each logit's "sigmoid". With `score_chosen`
    the top k of the raw logits are chosen first and only they are scored (gpt-oss: a
    softmax over the k; Llama 4: their sigmoids); otherwise every expert is scored and the
    top k of the scores chosen. `groups` > 1 (DeepSeek) first keeps the `topk_groups` best
    of that many equal groups of experts, a group ranked by the sum of its
    `group_rank_top` best scores (DeepSeek-V2: 1, its max; V3: 2), and chooses the top k
    within them. `renormalize` divides the chosen weights by their sum, and
    `scaling_factor` (DeepSeek's `routed_scaling_factor`) multiplies them after.
    """

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    score_chosen: bool = False
    renormalize: bool = False
    groups: int = 1
    topk_groups: int = 1
    group_rank_top: int = 1
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.score_chosen and self.groups > 1:
            raise ValueError(f"Routing(score_chosen=True) chooses on the raw logits and cannot also keep the best of "
                             f"groups={self.groups} groups: set groups=1 or score_chosen=False")

    @classmethod
    def gpt_oss(cls, config: PretrainedConfig) -> "Routing":
        """gpt-oss: a softmax over the top k of the router's logits (the router has a bias)."""
        return cls(config.num_experts_per_tok, score_chosen=True)

    @classmethod
    def deepseek_v2(cls, config: PretrainedConfig) -> "Routing":
        """DeepSeek-V2: softmax scores, group-limited greedy choice where `topk_method` says
        so, the weights (renormalised where `norm_topk_prob`) times `routed_scaling_factor`."""
        grouped = config.topk_method == "group_limited_greedy"
        return cls(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                   groups=config.n_group if grouped else 1, topk_groups=config.topk_group if grouped else 1,
                   scaling_factor=config.routed_scaling_factor)

    @classmethod
    def deepseek_v3(cls, config: PretrainedConfig) -> "Routing":
        """DeepSeek-V3: sigmoid scores, chosen with the router's `e_score_correction_bias`
        added (pass it to `select`), groups ranked by their two best; the unbiased scores,
        renormalised where `norm_topk_prob`, times `routed_scaling_factor`."""
        return cls(config.num_experts_per_tok, scoring="sigmoid", renormalize=bool(config.norm_topk_prob),
                   groups=config.n_group, topk_groups=config.topk_group, group_rank_top=2,
                   scaling_factor=config.routed_scaling_factor)

    @classmethod
    def llama4(cls, config: PretrainedConfig) -> "Routing":
        """Llama 4: the sigmoid of each chosen logit, which scales the expert's input
        (`FusedMoE(weights_on_input=True)`)."""
        return cls(config.num_experts_per_tok, scoring="sigmoid", score_chosen=True)

    def select(self, router_logits: torch.Tensor,
               correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] float32, ids [tokens, top_k] int64) of each token's
        experts, as transformers' routers compute them (scores in float32; with
        `score_chosen` the choice on the logits in their dtype). `correction_bias`
        [experts] is added to the scores for the choice only (DeepSeek-V3; not with
        `score_chosen`).

        The order of a token's k experts may differ from transformers' (its DeepSeek
        routers leave them unsorted); `FusedMoE` sums them in expert order either way.
        Families whose routers round the weights to the logits' dtype (Qwen, gpt-oss,
        Llama 4) cast `weights.to(router_logits.dtype)` themselves."""
        if self.score_chosen:
            if correction_bias is not None:
                raise ValueError("Routing(score_chosen=True) chooses on the raw logits: a correction_bias has no "
                                 "place there; pass none, or route with score_chosen=False")
            chosen, ids = torch.topk(router_logits, self.top_k, dim=-1)
            weights = self._score(chosen)
        else:
            scores = self._score(router_logits)
            choice = scores if correction_bias is None else scores + correction_bias
            if self.groups > 1:
                choice = self._in_best_groups(choice)
            ids = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # guards all-zero sigmoids
        if self.scaling_factor != 1.0:
            weights = weights * self.scaling_factor
        return weights, ids

    def _score(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scoring == "softmax":
            return torch.softmax(logits, dim=-1, dtype=torch.float32)
        return torch.sigmoid(logits.float())

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's `topk_groups` best groups at -inf."""
        tokens, experts = choice.shape
        if experts % self.groups:
            raise ValueError(f"{experts} experts do not split into n_group={self.groups} equal groups; "
                             "fix config.json's n_group")
        by_group = choice.view(tokens, self.groups, experts // self.groups)
        group_scores = by_group.topk(self.group_rank_top, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, self.topk_groups, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return by_group.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, experts)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top_k` experts of each token and their routing weights, as transformers' routers
    choose them: softmax over all experts in float32, top-k, then (`renormalize`: Mixtral
    always, Qwen2-MoE/Qwen3-MoE with `norm_topk_prob`) division by the top-k's sum.

    Returns (weights [tokens, top_k] float32, ids [tokens, top_k] int64). Qwen2-MoE and
    Qwen3-MoE then round the weights to the logits' dtype (Mixtral does not): a model
    matching them casts `weights.to(router_logits.dtype)` itself. Other routers: `Routing`."""
    return Routing(top_k, renormalize=renormalize).select(router_logits)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' `GptOssExperts`): the gate clamped from
    above and the up product on both sides at `limit`, then (up + 1) * gate *
    sigmoid(alpha * gate), each step rounded to the inputs' dtype as PyTorch rounds it."""

    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config: PretrainedConfig) -> "ClampedSwiGLU":
        """From config.json's `swiglu_limit` and `swiglu_alpha` (the released configs lack
        the latter; transformers from 5.24 default it to 1.702, as here)."""
        return cls(alpha=getattr(config, "swiglu_alpha", None) or 1.702, limit=config.swiglu_limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def deinterleave_gate_up(gate_up: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """gpt-oss's fused gate/up rows (gate and up alternating along `dim`: an expert's
    [2I, H] matrix or its [2I] bias) as `FusedMoE` holds them: the I gate rows, then the
    I up rows."""
    dim %= gate_up.dim()
    pairs = gate_up.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


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

    Variants (gpt-oss, Llama 4): `bias` adds w13_bias [E, 2 * I] (gate then up, as w13)
    and w2_bias [E, H] to the two products; `activation` replaces silu(gate) * up by
    gpt-oss's `ClampedSwiGLU`; `weights_on_input` multiplies each chosen expert's input by
    its routing weight (rounded to the input's dtype) instead of its output (Llama 4). The
    compiled CPU operator computes plain SwiGLU experts only: the variants run as grouped
    PyTorch products on a CPU (oneDNN's prepacked ones where prepacked), in the Triton
    kernel on a GPU.

    Tensor parallelism splits every expert's intermediate dimension: each rank holds
    I = intermediate_size / ranks of it (rank r the r-th slice: rows of the checkpoint's
    gate and up and of w13_bias, columns of its down), and the partial outputs are summed
    over the ranks; rank 0 alone adds w2_bias.

    `kernel`, when set (see `engine.model_loader.kernel_routing`), computes the experts in one
    fused call: kernel(x, w13, w2, topk_weights, topk_ids), with the variants' keywords
    (`engine.kernels.triton.fused_moe.fused_moe`). `packed` holds the experts'
    matrices in oneDNN's layout once `prepack` has run (the 3-D weights are then empty);
    they are opaque tensors without a storage, so a count of the weights' bytes adds their
    numel * element_size as it does for `Linear.packed_weight`. With a `quant_method`
    (`engine.quantization`) `prepack` quantizes the experts instead and the method runs them,
    biases and the clamped SwiGLU included.
    """

    kernel: Callable | None = None
    packed: PackedExperts | None = None
    quant_method: MoEMethod | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 group: "TensorParallelGroup | None" = None, bias: bool = False,
                 activation: ClampedSwiGLU | None = None, weights_on_input: bool = False) -> None:
        super().__init__()
        local = intermediate_size // (group.size if group is not None else 1)
        self.group = group
        self.num_experts = num_experts
        self.activation = activation
        self.weights_on_input = weights_on_input
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * local)) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    @property
    def plain(self) -> bool:
        """Whether the experts are plain SwiGLU without biases, which every path computes."""
        return self.w13_bias is None and self.activation is None

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
        e = topk_ids[t, j], for x [T, H] (the variants as the class says); [T, H] in x's dtype."""
        if self.weights_on_input:
            tokens, top_k = topk_ids.shape
            rows = (x.unsqueeze(1) * topk_weights.to(x.dtype).unsqueeze(-1)).flatten(0, 1)
            ones = torch.ones(tokens * top_k, 1, dtype=torch.float32, device=x.device)
            out = self._local(rows, ones, topk_ids.reshape(-1, 1))
            out = out.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
        else:
            out = self._local(x, topk_weights, topk_ids)
        if self.group is not None and self.group.size > 1:
            self.group.all_reduce(out)
        return out

    def _local(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the weighted sum, on the path the layer's state picks."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, topk_weights, topk_ids)
        if self.kernel is not None:
            if self.plain:
                return self.kernel(x, self.w13, self.w2, topk_weights, topk_ids)
            clamped = self.activation is not None
            return self.kernel(x, self.w13, self.w2, topk_weights, topk_ids, w13_bias=self.w13_bias,
                               w2_bias=self.down_bias(), limit=self.activation.limit if clamped else None,
                               alpha=self.activation.alpha if clamped else 1.0)
        if self.plain and self.packed is not None and (kernels := cpu_build.load()) is not None:
            return kernels.fused_moe(x, topk_weights, topk_ids, self.packed.w13, self.packed.w2, MIN_ROWS)
        return self.grouped(x, topk_weights, topk_ids, self._expert)

    def down_bias(self) -> torch.Tensor | None:
        """w2_bias where this rank adds it: on rank 0 only, as the ranks' outputs are summed."""
        return self.w2_bias if self.group is None or self.group.rank == 0 else None

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
        """Expert `expert`'s SwiGLU (or `activation`) of `rows` [n, H], with its biases, in
        their dtype."""
        if self.packed is not None:  # project reads the packed matrices, not the emptied weights
            (w13, w2), (packed13, packed2) = (self.w13, self.w2), (self.packed.w13[expert], self.packed.w2[expert])
        else:
            (w13, w2), (packed13, packed2) = (self.w13[expert], self.w2[expert]), (None, None)
        bias13, bias2 = self.w13_bias, self.down_bias()
        gate, up = project(rows, w13, packed13, None if bias13 is None else bias13[expert]).chunk(2, dim=-1)
        hidden = F.silu(gate).mul_(up) if self.activation is None else self.activation(gate, up)
        return project(hidden, w2, packed2, None if bias2 is None else bias2[expert])
