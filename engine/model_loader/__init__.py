"""Model loading (vLLM's `model_executor/model_loader`): the model folder and its settings, the
checkpoint's tensors, the embedded default model, and routing the built model's layers to the
kernels of the device."""
