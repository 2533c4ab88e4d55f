"""How a caller reaches the engine, as vLLM's `vllm/entrypoints/` is: `LLM` (`llm`), the
prompts it takes turned into requests (`inputs`), replicas as whole engines
(`data_parallel`), chat templates (`chat_utils`), `tool_choice`, the progress bar, and the
OpenAI batch file (`openai/`). Imports nothing, so that loading one of them loads only it."""
