"""Batched sampling: one pass over the step's logits, each row with its own settings."""

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors on the logits' device.

    `generators[i]` is row i's own seeded generator, or None to draw from the engine's.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool


class Sampler:
    """Greedy, temperature, top-k and top-p sampling for a whole batch at once.

    A token is drawn as argmax(probs / E) with E ~ Exponential(1) per vocabulary entry (the
    exponential race, equivalent to sampling from probs). Seeded rows draw E from their
    own generator, so their choices do not depend on the rest of the batch.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Token ids [rows] from logits [rows, vocab] in the model's dtype."""
        logits = logits.float()
        greedy_tokens = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_tokens
        greedy = meta.temperatures == 0
        logits = logits / torch.where(greedy, 1.0, meta.temperatures).unsqueeze(1)
        if meta.any_top_k or meta.any_top_p:
            logits = self._filter(logits, meta)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(meta.generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, gen in enumerate(meta.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    @staticmethod
    def _filter(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sets to -inf every logit outside its row's top-k and top-p sets."""
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        if meta.any_top_k:
            k = torch.where(meta.top_ks > 0, meta.top_ks, vocab).clamp(max=vocab)
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
        if meta.any_top_p:
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
            sorted_logits = sorted_logits.masked_fill(before >= meta.top_ps.unsqueeze(1), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
