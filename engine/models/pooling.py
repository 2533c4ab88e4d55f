"""A family's decoder as a pooling model: its final hidden states are the output, its
language-model head is not read, and a classifier adds the `score` projection of
transformers' `*ForSequenceClassification`."""

import functools
from collections.abc import Iterable

from torch import nn
from transformers import PretrainedConfig

from engine.distributed.communicator import TensorParallelGroup
from engine.layers.linear import StoredTensor


# Checkpoint names that keep their place; any other (a bare `XModel`'s "layers.0...") is the decoder's.
_TOP_LEVEL = ("model.", "score.", "lm_head.")


@functools.cache
def pooling_model_class(family: type[nn.Module], classify: bool) -> type[nn.Module]:
    """`family` (a causal LM class) without its head, with a classifier's `score` when `classify`."""

    class PoolingModel(family):
        def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None):
            super().__init__(config, max_position, group)
            # Tied to the embeddings, the unused head costs no memory and is not read from the checkpoint.
            self.tie_word_embeddings = True
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False) if classify else None

        def checkpoint_tensors(
            self, weights: Iterable[tuple[str, StoredTensor]]
        ) -> Iterable[tuple[str, StoredTensor]]:
            renamed = ((name if name.startswith(_TOP_LEVEL) else f"model.{name}", tensor) for name, tensor in weights)
            return super().checkpoint_tensors(renamed)

    PoolingModel.__name__ = PoolingModel.__qualname__ = (
        f"{family.__name__.removesuffix('ForCausalLM')}{'ForSequenceClassification' if classify else 'Model'}")
    return PoolingModel
