"""Engine settings (`EngineConfig`), what the model folder decides (`ModelConfig`, resolved by
`engine.model_loader.model_config`) and the names each setting allows, as vLLM's `config/`:
one module per group of settings (`model.py`, `device.py`, `scheduler.py`, `cache.py`,
`parallel.py`, `lora.py`, `multimodal.py`, `parsers.py`, `speculative.py`), each declaring its
settings once (`utils._setting`) with their checks and resolution beside them, and
`engine.py`, which composes them into the one flat `EngineConfig`.

A leaf that every tier may read: at import it loads neither torch nor any other engine module
(the Dagster side derives its resource's fields from these settings at definitions load); the
CPU and parser helpers a check needs are imported where it runs."""

from engine.config.cache import BACKEND_CACHE_DTYPES, DEFAULT_KV_CACHE_MEMORY, KV_CACHE_DTYPES, CacheSettings, \
    resolve_kv_cache_dtype
from engine.config.device import DeviceSettings
from engine.config.engine import EngineConfig, engine_settings
from engine.config.lora import LoRASettings
from engine.config.model import AT_LOAD, CHECKPOINT_METHODS, DTYPES, POOLING_TYPES, QUANTIZATION_METHODS, RUNNERS, \
    ModelConfig, ModelSettings, PoolerConfig
from engine.config.multimodal import DEFAULT_IMAGES_PER_PROMPT, DEFAULT_LIMIT_MM_PER_PROMPT, MultiModalSettings
from engine.config.parallel import ParallelSettings
from engine.config.parsers import ParserSettings
from engine.config.scheduler import DEFAULT_STEP_TOKENS, SchedulerSettings
from engine.config.speculative import SpeculativeConfig, SpeculativeSettings
from engine.config.utils import MODEL_FILES, OPERATIONAL, OUTPUT, SETTING_CLASSES

__all__ = [
    "AT_LOAD", "BACKEND_CACHE_DTYPES", "CHECKPOINT_METHODS", "DEFAULT_IMAGES_PER_PROMPT", "DEFAULT_KV_CACHE_MEMORY",
    "DEFAULT_LIMIT_MM_PER_PROMPT", "DEFAULT_STEP_TOKENS", "DTYPES", "KV_CACHE_DTYPES", "MODEL_FILES", "OPERATIONAL",
    "OUTPUT", "POOLING_TYPES", "QUANTIZATION_METHODS", "RUNNERS", "SETTING_CLASSES", "CacheSettings", "DeviceSettings", "EngineConfig",
    "LoRASettings", "ModelConfig", "ModelSettings", "MultiModalSettings", "ParallelSettings", "ParserSettings",
    "PoolerConfig", "SchedulerSettings", "SpeculativeConfig", "SpeculativeSettings", "engine_settings",
    "resolve_kv_cache_dtype",
]
