"""Pooling models: embeddings and classifications of whole prompts (vLLM's
`runner="pooling"`, `LLM.embed`, `LLM.classify`, `LLM.score`).

A pooling request is a prompt that is only prefilled: the scheduler batches it like any
prompt (chunked, prefix-cached), and when its last token is computed the step pools its
final hidden states into one vector: the last token's (LAST), the mean over the
prompt's tokens (MEAN, summed chunk by chunk) or the first token's (CLS). An embedding
model returns that vector (L2-normalised unless the request says otherwise); a
classifier (`*ForSequenceClassification`) puts it through its `score` head and returns
the class probabilities.
"""

import torch
import torch.nn.functional as F

from engine.config import PoolerConfig


class Pooler:
    """Pools the rows of a step into each finished prompt's output vector. A MEAN or CLS
    prompt computed over several steps keeps its partial result in its row of the persistent
    batch (`BatchRow.pooling_state`) between them."""

    def __init__(self, config: PoolerConfig, score: torch.nn.Module | None) -> None:
        self.config = config
        self.score = score

    def update(self, state: torch.Tensor | None, hidden: torch.Tensor, first_position: int) -> torch.Tensor | None:
        """A prompt's MEAN or CLS state after a chunk of its rows (the first at prompt
        position `first_position`): the float32 sum of its rows so far, or its first row.
        A chunk at position 0 starts afresh (a preempted prompt is computed again)."""
        if self.config.pooling_type == "MEAN":
            chunk = hidden.float().sum(0)
            return chunk if first_position == 0 or state is None else state + chunk
        if self.config.pooling_type == "CLS" and first_position == 0:
            return hidden[0].float()
        return state

    def rows_read(self, first_row: int, count: int, first_position: int, last: bool) -> range:
        """The rows of a chunk (rows [first_row, first_row + count) of a step, from prompt
        position `first_position`; `last` when it ends the prompt) that `update` and
        `vector` read: all of them (MEAN), the prompt's first (CLS) or its last (LAST)."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            return range(first_row, first_row + count)
        if kind == "CLS":
            return range(first_row, first_row + (first_position == 0))
        return range(first_row + count - 1, first_row + count) if last else range(0)

    def vector(self, state: torch.Tensor | None, last_chunk: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The pooled vector of a prompt of `num_tokens` whose last chunk of rows is `last_chunk`."""
        if self.config.pooling_type == "LAST":
            return last_chunk[-1].float()
        return state / num_tokens if self.config.pooling_type == "MEAN" else state

    def finish(self, vectors: list[torch.Tensor], normalize: list[bool]) -> torch.Tensor:
        """The outputs [prompts, dim] of the pooled vectors: embeddings (each normalised
        where asked) or a classifier's class probabilities (a softmax over its labels; a
        sigmoid for one label, as vLLM and sentence-transformers' cross-encoders do)."""
        pooled = torch.stack(vectors)
        if self.config.task == "classify":
            logits = F.linear(pooled, self.score.weight.float())
            return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        unit = F.normalize(pooled, dim=-1)
        keep = torch.tensor(normalize, device=pooled.device)[:, None]
        return torch.where(keep, unit, pooled)
