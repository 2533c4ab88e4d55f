"""Model families, by the `architectures` name in a Hugging Face config.json."""

from torch import nn
from transformers import PretrainedConfig

from engine.config import PoolerConfig
from engine.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.idefics3 import Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration
from engine.models.llama import LlamaForCausalLM
from engine.models.llama4 import Llama4ForCausalLM
from engine.models.llava import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from engine.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.pooling import pooling_model_class
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from engine.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.voxtral import VoxtralForConditionalGeneration
from engine.models.whisper import WhisperForConditionalGeneration

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}

def pooling_architectures(causal_models: dict[str, type]) -> dict[str, tuple[type, str]]:
    """The pooling checkpoints' architectures: for each "XForCausalLM", "XModel" (the bare
    decoder, an embedding model) and "XForSequenceClassification" (a classifier), with
    the family class and the task."""
    found = {}
    for name, family in causal_models.items():
        stem = name.removesuffix("ForCausalLM")
        found[f"{stem}Model"] = (family, "embed")
        found[f"{stem}ForSequenceClassification"] = (family, "classify")
    return found


# Embedding models ("LlamaModel") and classifiers ("Qwen2ForSequenceClassification") of each family.
POOLING_ARCHITECTURES = pooling_architectures(MODEL_REGISTRY)


def model_class_for(architectures: list[str], pooler: PoolerConfig | None) -> type[nn.Module] | None:
    """The class that runs a checkpoint of these architectures (None: unsupported): the
    family's causal LM, or with a `pooler` the family's pooling model."""
    if (multimodal := multimodal_class_for(architectures)) is not None:
        return multimodal if pooler is None else None
    for name in architectures:
        family = MODEL_REGISTRY.get(name) or POOLING_ARCHITECTURES.get(name, (None,))[0]
        if family is not None:
            return family if pooler is None else pooling_model_class(family, pooler.task == "classify")
    return None


# Vision-language checkpoints whose language model runs here on its own, for text prompts:
# architecture -> the family of its `text_config`.
LANGUAGE_MODELS: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}

# Multimodal checkpoints that run with their images or audio: architecture -> the model class
# (a `VisionLanguageModel`, built from the whole config).
MULTIMODAL_MODELS: dict[str, type[nn.Module]] = {
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "SmolVLMForConditionalGeneration": SmolVLMForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "Qwen2AudioForConditionalGeneration": Qwen2AudioForConditionalGeneration,
    "VoxtralForConditionalGeneration": VoxtralForConditionalGeneration,
}


# A multimodal config's tower config -> what the model is called in messages.
_TOWER_KINDS = {"vision_config": "vision-language", "audio_config": "audio-language"}

# Encoder-decoder checkpoints (vLLM's): architecture -> the model class, built from the whole
# config. Its processor sets `cross_modality`, the one item of each prompt its decoder attends to.
ENCODER_DECODER_MODELS: dict[str, type[nn.Module]] = {
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
}


def multimodal_class_for(architectures: list[str]) -> type[nn.Module] | None:
    """The class of these architectures that reads images or audio (a vision-language or
    encoder-decoder model), or None for a text-only model."""
    found = {**MULTIMODAL_MODELS, **ENCODER_DECODER_MODELS}
    return next((found[a] for a in architectures if a in found), None)


def is_encoder_decoder(architectures: list[str]) -> bool:
    """Whether these architectures name an encoder-decoder model (Whisper)."""
    return any(a in ENCODER_DECODER_MODELS for a in architectures)


def language_model_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """`hf_config` itself, or for a multimodal checkpoint its language model's config
    (with the checkpoint's dtype and tied embeddings): for one of `LANGUAGE_MODELS` under its
    text family's architecture (the family's loader skips the vision tower's weights), for
    one of `MULTIMODAL_MODELS` under the checkpoint's own (the whole model runs).

    Raises:
        ValueError: a multimodal checkpoint of an architecture the engine does not run.
    """
    architectures = getattr(hf_config, "architectures", None) or []
    family = next((LANGUAGE_MODELS[a] for a in architectures if a in LANGUAGE_MODELS), None)
    multimodal = next((a for a in architectures if a in MULTIMODAL_MODELS), None)
    if family is None and multimodal is None:
        kind = next((kind for part, kind in _TOWER_KINDS.items() if getattr(hf_config, part, None) is not None), None)
        if kind is not None:
            raise ValueError(
                f"architecture {architectures} is a {kind} model the engine does not run (supported: "
                f"{sorted(MULTIMODAL_MODELS)}, and the language model alone of {sorted(LANGUAGE_MODELS)})")
        return hf_config
    text = hf_config.get_text_config()
    text.architectures = [family or multimodal]
    text.dtype = getattr(text, "dtype", None) or getattr(hf_config, "dtype", None)
    text.tie_word_embeddings = getattr(hf_config, "tie_word_embeddings",
                                       getattr(text, "tie_word_embeddings", False))  # Qwen2-VL's text config has none
    if getattr(hf_config, "quantization_config", None) is not None:  # the engine reads it from the text part
        text.quantization_config = hf_config.quantization_config
    return text
