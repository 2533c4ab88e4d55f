"""Attention backends: `torch_attn` (PyTorch's SDPA, any device), `cpu_attn` (the C++ paged kernel)
and `triton_attn` (Triton kernels on a GPU)."""
