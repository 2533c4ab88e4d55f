"""The settings of images in prompts (`MultiModalSettings`), as vLLM's `config/multimodal.py`."""

from dataclasses import dataclass

from engine.config.utils import OPERATIONAL, SettingsGroup, _setting

# Images one prompt may hold when limit_mm_per_prompt does not say.
DEFAULT_IMAGES_PER_PROMPT = 8


@dataclass
class MultiModalSettings(SettingsGroup):
    """How many images a prompt may hold."""

    limit_mm_per_prompt: dict[str, int] | None = _setting(None, "Most images one prompt may hold, as vLLM's "
                                                                "{'image': n} (default "
                                                                f"{DEFAULT_IMAGES_PER_PROMPT}); a vision-language "
                                                                "model's rows with more are errors.", OPERATIONAL)

    def problems(self) -> list[str]:
        limit = self.limit_mm_per_prompt
        if limit is not None and (set(limit) - {"image"}
                                  or any(not isinstance(n, int) or n < 0 for n in limit.values())):
            return [f"limit_mm_per_prompt must be None or {{'image': n}} with n >= 0, got {limit!r}"]
        return []

    @property
    def max_images_per_prompt(self) -> int:
        """The most images one prompt may hold (limit_mm_per_prompt's, else the default)."""
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)
