"""`LLM.score`'s pairs and scores, as vLLM's `score_utils.py`: the texts paired up, a pair made
one input of a cross-encoder, and the scores read from the pooled outputs (the sigmoid a
cross-encoder computed, or the cosine of two embeddings). The engine calls stay in `LLM`."""

from dataclasses import dataclass
from typing import Any

import torch

from engine.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput


@dataclass(frozen=True)
class ScorePairs:
    """The texts to score, paired up in order: `firsts[i]` with `seconds[i]`."""

    firsts: list[str]
    seconds: list[str]


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> ScorePairs:
    """One `text_1` paired with every `text_2`, else the two lists in order.

    Raises:
        ValueError: lists of different lengths, or an empty list.
    """
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if not seconds or len(firsts) != len(seconds):
        raise ValueError(f"score: text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
                         "or as many as text_2 (and at least one)")
    return ScorePairs(firsts, seconds)


def cross_encoder_inputs(tokenizer: Any, pairs: ScorePairs, num_labels: int) -> list[dict[str, list[int]]]:
    """Each pair as one input of a cross-encoder (the tokenizer's pair encoding).

    Raises:
        ValueError: the classifier has more than one label, so it is no cross-encoder.
    """
    if num_labels != 1:
        raise ValueError(f"score: this classifier has {num_labels} labels; a cross-encoder has one "
                         "(use classify for the probabilities of several labels)")
    return [{"prompt_token_ids": tokenizer(first, second).input_ids}
            for first, second in zip(pairs.firsts, pairs.seconds)]


def cross_encoder_scores(classified: list[ClassificationRequestOutput]) -> list[ScoringRequestOutput]:
    """A cross-encoder's score of each pair: the sigmoid of its one logit."""
    return [ScoringRequestOutput(output.request_id, ScoringOutput(output.outputs.probs[0]), output.prompt_token_ids)
            for output in classified]


def cosine_scores(embedded: list[EmbeddingRequestOutput]) -> list[ScoringRequestOutput]:
    """The cosine of each pair's embeddings, `embedded` holding every first text's, then every
    second text's; a pair's prompt tokens are both texts'."""
    count = len(embedded) // 2
    outputs = []
    for i, (first, second) in enumerate(zip(embedded[:count], embedded[count:])):
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(first.outputs.embedding),
                                                       torch.tensor(second.outputs.embedding), dim=0)
        outputs.append(ScoringRequestOutput(str(i), ScoringOutput(cosine.item()),
                                            first.prompt_token_ids + second.prompt_token_ids))
    return outputs
