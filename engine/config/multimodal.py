"""The settings of images and audio in prompts (`MultiModalSettings`), as vLLM's `config/multimodal.py`."""

from dataclasses import dataclass

from engine.config.utils import OPERATIONAL, SettingsGroup, _setting

# Items of each modality one prompt may hold when limit_mm_per_prompt does not say: images as
# vLLM's multi-image chats use them; a few clips (a question about two recordings); videos,
# whose frames make thousands of tokens each, fewer still. Its keys are the modalities a prompt
# may name (the engine reads no video yet: such rows are refused, whatever the limit).
DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 8, "audio": 4, "video": 2}
# Images one prompt may hold when limit_mm_per_prompt does not say.
DEFAULT_IMAGES_PER_PROMPT = DEFAULT_LIMIT_MM_PER_PROMPT["image"]


@dataclass
class MultiModalSettings(SettingsGroup):
    """How many images, audio clips and videos a prompt may hold."""

    limit_mm_per_prompt: dict[str, int] | None = _setting(
        None, "Most items of each modality one prompt may hold, as vLLM's {'image': n, 'audio': n, 'video': n} "
              f"(defaults {DEFAULT_LIMIT_MM_PER_PROMPT}; a modality it leaves out keeps its default); a "
              "multimodal model's rows with more are errors.", OPERATIONAL)

    def problems(self) -> list[str]:
        limit = self.limit_mm_per_prompt
        if limit is not None and (not isinstance(limit, dict) or set(limit) - set(DEFAULT_LIMIT_MM_PER_PROMPT)
                                  or any(not isinstance(n, int) or isinstance(n, bool) or n < 0
                                         for n in limit.values())):
            keys = ", ".join(f"{key!r}: n" for key in DEFAULT_LIMIT_MM_PER_PROMPT)
            return [f"limit_mm_per_prompt must be None or a dict of {{{keys}}} (any of them) with n >= 0, "
                    f"got {limit!r}"]
        return []

    def max_items_per_prompt(self, modality: str) -> int:
        """The most items of `modality` one prompt may hold (limit_mm_per_prompt's, else the default)."""
        return (self.limit_mm_per_prompt or {}).get(modality, DEFAULT_LIMIT_MM_PER_PROMPT[modality])
