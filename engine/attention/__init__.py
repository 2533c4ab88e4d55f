"""Paged attention (vLLM's `v1/attention`): the `Attention` layer and the contract a backend meets
(`layer.py`), the choice of backend by device (`selector.py`) and the backends (`backends/`)."""
