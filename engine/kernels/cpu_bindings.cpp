// The Python module of the CPU kernels (`engine.kernels.cpu_build`).

#include <torch/extension.h>

#include <optional>
#include <vector>

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                           const at::Tensor& row_seq, const at::Tensor& row_keys, const at::Tensor& sinks,
                           int64_t block_size, double scale, int64_t sliding_window, int64_t chunk_size,
                           double softcap);

void store_kv(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales, const at::Tensor& slots);

at::Tensor rotary_cache_attention(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& positions,
                                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                  at::Tensor& v_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                                  const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& row_seq,
                                  const at::Tensor& row_keys, const at::Tensor& sinks, int64_t block_size,
                                  double scale, int64_t sliding_window, int64_t chunk_size, double softcap);

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     const std::vector<at::Tensor>& w13, const std::vector<at::Tensor>& w2, int64_t min_rows);

at::Tensor fused_moe_int8(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                          const at::Tensor& w13_q, const at::Tensor& w13_scale, const at::Tensor& w2_q,
                          const at::Tensor& w2_scale);

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const std::optional<at::Tensor>& residual);

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale,
                       const std::optional<at::Tensor>& outlier_index,
                       const std::optional<at::Tensor>& outlier_weight,
                       const std::optional<at::Tensor>& outlier_pairs);

at::Tensor int8_gated_mlp(const at::Tensor& x, const std::vector<std::optional<at::Tensor>>& gate_up,
                          const std::vector<std::optional<at::Tensor>>& down, bool gelu);

at::Tensor act_and_mul(const at::Tensor& x, bool gelu);

namespace engine_cpu {
at::Tensor int8_product(const at::Tensor& xq, const at::Tensor& q);
}

at::Tensor rotary(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor argmax_rows(const at::Tensor& logits);

void bind_decoder_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a block table (CPU)");
  m.def("rotary_cache_attention", &rotary_cache_attention,
        "Rotary, cache writes and paged attention of a fused q/k/v projection's output (CPU)");
  m.def("store_kv", &store_kv, "Keys or values into the paged cache, int8 quantized per token and head (CPU)");
  m.def("fused_moe", &fused_moe, "Routed experts on oneDNN-prepacked matrices (CPU)");
  m.def("fused_moe_int8", &fused_moe_int8, "Routed experts on int8 matrices (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with the residual add fused in (CPU)");
  m.def("int8_linear", &int8_linear, "x times an int8 weight, x smoothed and quantized per row (CPU)");
  m.def("int8_product", &engine_cpu::int8_product, "The exact int32 sums of int8 rows times an int8 weight (CPU)");
  m.def("int8_gated_mlp", &int8_gated_mlp, "A gated MLP on int8 weights, activated between the products (CPU)");
  m.def("argmax_rows", &argmax_rows, "Each row's argmax of float32 logits, as torch.argmax (CPU)");
  m.def("rotary", &rotary, "Rotary position embedding (CPU)");
  m.def("act_and_mul", &act_and_mul, "The MLP's gated activation, act(gate) * up (CPU)");
  bind_decoder_stack(m);
}
