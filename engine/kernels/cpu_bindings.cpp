// The Python module of the CPU kernels (`engine.kernels.cpu_build`).

#include <torch/extension.h>

#include "cpu_int8.h"
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a block table (CPU)");
  m.def("rotary_cache_attention", &rotary_cache_attention,
        "Rotary, cache writes and paged attention of a fused q/k/v projection's output (CPU)");
  m.def("store_kv", &store_kv, "Keys or values into the paged cache, int8 quantized per token and head (CPU)");
  m.def("fused_moe", &fused_moe, "Routed experts on oneDNN-prepacked matrices (CPU)");
  m.def("fused_moe_int8", &fused_moe_int8, "Routed experts on int8 matrices (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with the residual add fused in (CPU)");
  m.def("int8_linear", &int8_linear, "x times an int8 weight, x smoothed and quantized per row (CPU)");
  m.def("int8_product", static_cast<at::Tensor (*)(const at::Tensor&, const at::Tensor&)>(&engine_cpu::int8_product),
        "The exact int32 sums of int8 rows times an int8 weight (CPU)");
  m.def("int8_gated_mlp", &int8_gated_mlp, "A gated MLP on int8 weights, activated between the products (CPU)");
  m.def("argmax_rows", &argmax_rows, "Each row's argmax of float32 logits, as torch.argmax (CPU)");
  m.def("rotary", &rotary, "Rotary position embedding (CPU)");
  m.def("act_and_mul", &act_and_mul, "The MLP's gated activation, act(gate) * up (CPU)");
  bind_decoder_stack(m);
}
