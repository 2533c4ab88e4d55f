"""Pre-quantized checkpoints (FP8, AWQ, GPTQ): a tiny model quantized by the test in each
format (tests/quantized_checkpoints.py) loads and computes what transformers' float32 model
computes with the dequantized weights in place of its own.

On a CPU the weights are dequantized as they load; the GPU's products (FP8 with per-token
activations, the 4-bit Triton kernel) are checked here too, on the CPU: the 4-bit kernel
under Triton's interpreter, FP8 in the float32 arithmetic that stands in for
`torch._scaled_mm` there.
"""

import copy

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import LLM, LoRARequest, quantization
from engine.quantization.fp8 import Fp8LinearMethod, quantize_fp8_rows
from engine.quantization.int4 import Int4LinearMethod
from tests.engine.test_correctness import mixed_prompts
from tests.engine.test_quantization import chosen_logprobs
from tests.lora_adapters import build_lora_adapter
from tests.quantized_checkpoints import FORMATS, quantize_folder

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's paths; test_gpu.py runs the GPU's")


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request, llama_with_biases, tmp_path_factory):
    """(format, quantized folder, transformers' float32 model with the dequantized weights,
    the unquantized model)."""
    folder = tmp_path_factory.mktemp("quantized") / request.param
    dequantized = quantize_folder(llama_with_biases, folder, request.param)
    model = AutoModelForCausalLM.from_pretrained(llama_with_biases, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(llama_with_biases, dtype=torch.float32).eval()
    model.load_state_dict(dequantized, strict=False)
    return request.param, folder, model, plain


def check_against(reference, plain, llm: LLM, tolerance: float, sees_quantization: bool = True,
                  lora_request: LoRARequest | None = None) -> None:
    """Greedy tokens as `reference` picks them, logprobs within `tolerance` of its, and
    (`sees_quantization`) further from `plain`'s (the unquantized model), so the check sees
    the quantization; with `lora_request`'s adapter, if given."""
    prompts = mixed_prompts(count=6)
    gap_to_plain = 0.0
    with torch.no_grad():
        for i, (p, (out, logprobs)) in enumerate(zip(prompts, chosen_logprobs(llm, prompts, lora_request))):
            ids = torch.tensor([p["prompt_token_ids"] + out[:-1]])
            start = len(p["prompt_token_ids"]) - 1
            expected = reference(ids).logits[0, start:].log_softmax(-1)
            assert expected.argmax(-1).tolist() == out, f"prompt {i}"
            torch.testing.assert_close(logprobs, expected[range(len(out)), out], atol=tolerance, rtol=0)
            unquantized = plain(ids).logits[0, start:].log_softmax(-1)[range(len(out)), out]
            gap_to_plain = max(gap_to_plain, (logprobs - unquantized).abs().max().item())
    assert gap_to_plain > 5 * tolerance or not sees_quantization


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 7, "enable_prefix_caching": True}],
                         ids=["default", "chunked_prefill"])
def test_checkpoint_loads_dequantized_on_a_cpu(quantized, settings, caplog):
    fmt, folder, reference, plain = quantized
    with caplog.at_level("WARNING", logger="engine.quantization"):
        with LLM(str(folder), dtype="float32", **settings) as llm:
            assert llm.llm_engine.model_config.quantization == ("fp8" if fmt == "fp8-block" else
                                                                 "compressed-tensors" if fmt.startswith("fp8")
                                                                 else fmt.removesuffix("-sym"))
            check_against(reference, plain, llm, 1e-4)
    assert "dequantized to the model's dtype as they load" in caplog.text


def test_gpu_products_on_the_cpu(quantized, monkeypatch):
    """The methods a GPU runs, on the CPU: the 4-bit kernel (under the interpreter) with the
    checkpoint's values; FP8 against the reference with each activation row rounded as
    the method rounds it."""
    fmt, folder, reference, plain = quantized
    if fmt == "fp8-block":
        pytest.skip("block-wise FP8 is dequantized on a GPU too")
    gpu_method = Fp8LinearMethod(CPU) if fmt.startswith("fp8") else Int4LinearMethod(CPU)
    monkeypatch.setattr(quantization, "_methods", lambda *_: (gpu_method, None, None))
    if fmt.startswith("fp8"):
        emulate_fp8(reference)
    with LLM(str(folder), dtype="float32", **{"max_num_batched_tokens": 16}) as llm:
        layers = [m for m in llm.llm_engine.model_runner.model.modules() if m.__dict__.get("quant_method")]
        assert layers and all(m.weight.numel() == 0 for m in layers)
        # an activation rounded to the other side of an FP8 step (1/16 apart) moves a logprob by ~1e-3
        check_against(reference, plain, llm, 2e-3 if fmt.startswith("fp8") else 1e-4)


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_lora_on_quantized_layers(quantized, llama_with_biases, monkeypatch, tmp_path):
    """An adapter on every projection of a quantized checkpoint, whose products are the
    GPU's (the 4-bit kernel, FP8), adds its delta in the compute dtype: what PEFT's adapter
    computes on the dequantized model (with FP8's rounding emulated), and not what the
    unquantized model with the adapter computes."""
    fmt, folder, reference, plain = quantized
    if fmt not in ("gptq", "fp8-channel"):
        pytest.skip("one 4-bit format and one FP8 format")
    adapter = build_lora_adapter(llama_with_biases, tmp_path / "adapter", rank=8, alpha=16,
                                 target_modules=PROJECTIONS, seed=3)
    gpu_method = Fp8LinearMethod(CPU) if fmt.startswith("fp8") else Int4LinearMethod(CPU)
    monkeypatch.setattr(quantization, "_methods", lambda *_: (gpu_method, None, None))
    reference = copy.deepcopy(reference)
    if fmt.startswith("fp8"):
        emulate_fp8(reference)
    adapted = PeftModel.from_pretrained(reference, adapter).eval()
    adapted_plain = PeftModel.from_pretrained(copy.deepcopy(plain), adapter).eval()
    with LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, max_num_batched_tokens=16) as llm:
        check_against(adapted, adapted_plain, llm, 2e-3 if fmt.startswith("fp8") else 1e-4,
                      lora_request=LoRARequest("adapter", 1, str(adapter)))


def emulate_fp8(model: torch.nn.Module) -> None:
    """transformers' `model` with what the FP8 method rounds rounded the same way: every
    projection but the head's weights (per output feature) and input rows."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            q, scale = quantize_fp8_rows(module.weight.data)
            module.weight.data = q.float() * scale
            module.register_forward_pre_hook(lambda _, args: (fake_fp8_rows(args[0]),))


def fake_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale).view(x.shape)
