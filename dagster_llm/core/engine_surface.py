"""Everything `dagster_llm.core` takes from the engine, named in one place: every other module
of the core imports engine names from here, never from `engine` itself
(tests/dagster_llm/test_layout.py checks it), so what the core depends on is read here and a
change of the engine that reaches the Dagster side shows up as a change of this list.

What the core takes, and why:
- the `LLM` and its API types: the one object a run calls (`generate_as_completed`,
  `beam_search_as_completed`, `embed_as_completed`, its checks and stats), the params it is
  called with and the outputs it returns, which the tables store column by column;
- the engine's step times (`StepCost`, `StepTimes`): the progress lines' ETA uses the same
  fit of a step's time that speculative decoding trims with, rather than a copy of it;
- chat rendering (`render_chat` and its checks): a chat row's prompt is rendered, and its
  problems found, before any row runs, exactly as `LLM.chat` would render it;
- `tool_choice`: a table's forced tool call is checked against its tools where the asset is
  defined, and its calls are read from what the grammar made, as `LLM.chat` reads them;
- images, audio and video: a row's images, clips and videos are read and checked against the model's limits
  with the engine's own readers (and their errors named as the engine names them), so a row
  the engine would refuse is an error row before the model runs;
- transcripts: a transcript table's clips are cut into windows and prompted as
  `LLM.transcribe` does it, from the same functions;
- the model cache folder (`default_cache_dir`): model folders fetched from an object store
  go where the engine looks for models;
- the OpenAI batch protocol: a request table's rows are checked with the very line checks
  of `python -m engine.run_batch` and run by its very fan-out (`run_lines`: a body's engine
  inputs, the engine's checks, the response bodies), so a table and a batch file give the
  same answers.

The names load on first use (`engine.lazy_exports`), as `engine`'s own do: importing one
module of the core loads only the engine modules whose names it reads, so the definitions of
a code location load neither torch nor the engine's batch runner.
"""

from engine.lazy_exports import lazy_exports

_EXPORTS = {
    # The LLM and its API types
    "LLM": "engine",
    "BeamSearchOutput": "engine",
    "BeamSearchParams": "engine",
    "CompletionOutput": "engine",
    "EngineStats": "engine",
    "LoRARequest": "engine",
    "PoolingParams": "engine",
    "RequestOutput": "engine",
    "SamplingParams": "engine",
    "StructuredOutputsParams": "engine",
    "UnfinishedOutput": "engine",
    "ToolCall": "engine.outputs",
    # A step's time, for the progress lines' ETA
    "StepCost": "engine.core.step_cost",
    "StepTimes": "engine.core.step_cost",
    # Chat rendering and its checks
    "chat_messages_problem": "engine.entrypoints.chat_utils",
    "invalid_unicode_problem": "engine.entrypoints.chat_utils",
    "render_chat": "engine.entrypoints.chat_utils",
    "unread_parts_problem": "engine.entrypoints.chat_utils",
    # tool_choice: checked against the tools, its grammar, the calls read from it
    "ToolChoice": "engine.entrypoints.tool_choice",
    "apply_tool_choice": "engine.entrypoints.tool_choice",
    "grammar_problem": "engine.entrypoints.tool_choice",
    # Images and audio in prompts
    "IMAGE": "engine.multimodal.image",
    "ImageLimits": "engine.multimodal.image",
    "load_image": "engine.multimodal.image",
    "AUDIO": "engine.multimodal.audio",
    "AudioLimits": "engine.multimodal.audio",
    "read_audio": "engine.multimodal.audio",
    "VIDEO": "engine.multimodal.video",
    "VideoLimits": "engine.multimodal.video",
    "read_video": "engine.multimodal.video",
    "MediaKind": "engine.multimodal.media",
    "short_location": "engine.multimodal.media",
    # Transcripts: clips cut into the model's windows, their prompts, detected languages
    "ClipWindows": "engine.entrypoints.transcription",
    "TranscriptionOutput": "engine.outputs",
    "TranscriptionPlan": "engine.entrypoints.transcription",
    "plan_transcription": "engine.entrypoints.transcription",
    "split_windows": "engine.multimodal.audio_windows",
    # Where the engine looks for models
    "default_cache_dir": "engine.model_loader.embedded_model",
    # The OpenAI batch protocol (line checks, error codes), and the run of lines of one task on a loaded LLM
    "CHAT_URL": "engine.entrypoints.openai.protocol",
    "DUPLICATE_CUSTOM_ID": "engine.entrypoints.openai.protocol",
    "INVALID_JSON": "engine.entrypoints.openai.protocol",
    "INVALID_LINE": "engine.entrypoints.openai.protocol",
    "UNSUPPORTED_URL": "engine.entrypoints.openai.protocol",
    "BadLine": "engine.entrypoints.openai.protocol",
    "BatchLine": "engine.entrypoints.openai.protocol",
    "LineError": "engine.entrypoints.openai.protocol",
    "first_set": "engine.entrypoints.openai.serving",
    "line_task": "engine.entrypoints.openai.runner",
    "nesting_problem": "engine.entrypoints.openai.protocol",
    "parse_line": "engine.entrypoints.openai.protocol",
    "run_lines": "engine.entrypoints.openai.runner",
    "too_deep_problem": "engine.entrypoints.openai.protocol",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
