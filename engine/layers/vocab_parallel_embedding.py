"""The token embedding and the language-model head, their vocabulary split over the
tensor-parallel ranks: each rank holds a slice of the rows (the vocabulary padded to a
multiple of the ranks, the padding rows zero), embeds the ids that fall in it and the
ranks sum; logits are computed per slice and gathered on rank 0."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.communicator import TensorParallelGroup
from engine.layers.linear import ColumnParallelLinear, ShardSlice


def vocab_slice(vocab_size: int, group: TensorParallelGroup) -> ShardSlice | None:
    """The rows of the vocabulary this rank holds (the last rank's may be fewer than its
    padded share); None for one rank."""
    if group.size == 1:
        return None
    per_rank = -(-vocab_size // group.size)
    start = min(vocab_size, group.rank * per_rank)
    return ShardSlice(0, start, min(per_rank, vocab_size - start), vocab_size)


class VocabParallelEmbedding(nn.Embedding):
    """`nn.Embedding` over this rank's slice of the vocabulary; rows of ids outside the
    slice are zero before the sum over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        self.group = group
        self.vocab_start = group.rank * -(-vocab_size // group.size)
        super().__init__(-(-vocab_size // group.size), hidden_size)
        self.shard_sizes = [self.num_embeddings]
        self.checkpoint_slices = [vocab_slice(vocab_size, group)]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(hidden)


class ParallelLMHead(ColumnParallelLinear):
    """The language-model head over this rank's slice of the vocabulary; `logits`
    gathers the slices on rank 0. It keeps the model's dtype under quantization: logits
    decide the tokens, and near-ties would flip."""

    quantizable = False

    def __init__(self, hidden_size: int, vocab_size: int, group: TensorParallelGroup) -> None:
        # Every rank's slice padded to one width, so that the gathered slices line up.
        super().__init__(hidden_size, [vocab_size], [vocab_slice(vocab_size, group)], bias=False,
                         padded_sizes=[-(-vocab_size // group.size)])
        self.group = group
        self.vocab_size = vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in float32 on rank 0 (None on the others)."""
        local = self.forward_float32(hidden)
        if self.group.size == 1:
            return local
        whole = self.group.gather_last_dim(local)
        return None if whole is None else whole[:, : self.vocab_size]
