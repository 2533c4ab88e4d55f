"""Images and audio in prompts (vLLM's `multi_modal_data`): reading them from paths and URIs
(`media`), decoding and hashing images (`image`) and audio clips (`audio`), the
per-item records a sequence carries through the engine (`inputs`), and turning a prompt with
image and audio placeholders into token ids and encoder inputs (`processing`, whose family-specific
halves live beside each model family in `engine.models`)."""
