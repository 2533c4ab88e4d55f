"""Per-request sampling settings, validated on construction (vLLM's `SamplingParams`)."""

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt, with vLLM's semantics.

    Args:
        n: Completions per prompt; they share the prompt's KV cache.
        temperature: Softmax temperature; 0 means greedy decoding.
        top_p: Keep the smallest set of tokens whose probability adds up to `top_p` (1 = off).
        top_k: Keep the `top_k` most likely tokens (0 or -1 = off).
        min_p: Drop tokens less likely than `min_p` times the most likely one (0 = off).
        seed: Seed of this request's own random generators, so that its samples do not
            depend on the engine's seed or on the rest of the batch.
        presence_penalty: Subtracted from the logit of every token already generated.
        frequency_penalty: Subtracted once per earlier occurrence in the generated text.
        repetition_penalty: Divides positive (multiplies negative) logits of tokens seen in
            the prompt or the output; 1 = off.
        stop: Strings that end the generation; not part of the text unless
            `include_stop_str_in_output`.
        stop_token_ids: Token ids that end the generation besides EOS.
        include_stop_str_in_output: Keep the stop string at the end of the text.
        ignore_eos: Keep generating past the EOS token.
        max_tokens: Most tokens to generate per completion (vLLM's default is 16).
        min_tokens: EOS and `stop_token_ids` are suppressed until this many were generated.
        logprobs: Return the log-probabilities of this many most likely tokens at each
            step, plus the sampled token's.
        prompt_logprobs: The same for every prompt token after the first.
        skip_special_tokens: Leave special tokens out of the text.
        spaces_between_special_tokens: Put spaces around special tokens in the text.
        logit_bias: Token id to a value added to its logit.
        allowed_token_ids: Only these tokens may be generated.
        bad_words: Words that may not be generated (as any of their tokenizations).

    Raises:
        ValueError: naming the field and its allowed range, on any invalid value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        problems = self.problems()
        if problems:
            raise ValueError("Invalid SamplingParams: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid field, as `field: reason` strings (empty when all are valid)."""
        found = []

        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                found.append(f"{name} must be {rule}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "a positive integer")
        check(number(self.temperature) and self.temperature >= 0, "temperature", ">= 0 (0 = greedy)")
        check(number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "-1, 0 (both off) or a positive integer")
        check(number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "an integer or None")
        check(number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        check(number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        check(number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 = off)")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "non-negative integers")
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "a positive integer")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= (self.max_tokens if isinstance(
            self.max_tokens, int) else 0), "min_tokens", "an integer in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and value >= 0), name, "None or a non-negative integer")
        check(all(number(v) for v in (self.logit_bias or {}).values()), "logit_bias", "token id -> number")
        check(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
            "None or a non-empty list of token ids")
        check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", "non-empty strings")
        return found

    @property
    def greedy(self) -> bool:
        """Whether this request takes the most likely (processed) token at every step."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def token_ids(self) -> list[int]:
        """Every token id these settings name, for checking against the vocabulary."""
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or [])]
