// The compiled module's entry points (their definitions in the kernels' own files), for the
// bindings (`cpu_bindings.cpp`) and for kernels that call others (`cpu_decoder.cpp`).
#pragma once

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

at::Tensor rotary(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor argmax_rows(const at::Tensor& logits);

void bind_decoder_stack(pybind11::module& m);
