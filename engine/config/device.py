"""Where and how the forward pass runs (`DeviceSettings`): the device, the attention backend,
CUDA graphs and batch invariance, as vLLM's `config/device.py`, `config/attention.py` and the
`enforce_eager` of its model config."""

from dataclasses import dataclass
from typing import Any

from engine.config.utils import OPERATIONAL, OUTPUT, SettingsGroup, _setting


@dataclass
class DeviceSettings(SettingsGroup):
    """The device, and the kernels and modes the forward pass runs with on it."""

    device: str = _setting("auto", "'auto' (a GPU when there is one), 'cpu' or 'cuda'.", OUTPUT)
    attention_backend: str = _setting("auto", "'auto' (Triton kernels on a GPU; on a CPU the compiled "
                                              "paged-attention kernel where it builds, else PyTorch's products), "
                                              "'triton' (a GPU, or Triton's interpreter under TRITON_INTERPRET=1), "
                                              "'cpu' (the compiled kernel) or 'torch'.", OUTPUT)
    enforce_eager: bool = _setting(False, "Never capture CUDA graphs (on a GPU with the Triton backend, decode "
                                          "steps otherwise replay graphs captured at start-up; off with LoRA).", OPERATIONAL)
    batch_invariant: bool = _setting(False, "Give a row the same bits whatever else shares its step, on every "
                                            "CPU (vLLM's VLLM_BATCH_INVARIANT): a seeded request's output then "
                                            "does not depend on its batch. Free except on a CPU with AMX, whose "
                                            "fastest bfloat16 kernels (the default there) pick their summation "
                                            "order by the batch's size; this keeps oneDNN off AMX in the "
                                            "process, at AVX512-BF16's speed. Not built on a GPU.", OUTPUT)

    def problems(self) -> list[str]:
        problems = []
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            problems.append(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            problems.append("attention_backend must be 'auto', 'torch', 'cpu' or 'triton', "
                            f"got {self.attention_backend!r}")
        return problems

    def resolved(self, model_config: Any, attention_backend: str) -> dict[str, Any]:
        """The model's device, and the backend that `attention_backend` resolved to there.

        Raises:
            ValueError: batch_invariant on a GPU.
        """
        if self.batch_invariant and model_config.device.type != "cpu":
            raise ValueError(
                "batch_invariant=True runs on a CPU only: on a GPU the matrix products (cuBLAS) and the prefill "
                "kernel choose their tiles by the batch's shape, and batch-invariant kernels are not built here. "
                "Leave it False on a GPU (a seeded request's draws are still its own), or use device='cpu'")
        return {"device": str(model_config.device), "attention_backend": attention_backend}
