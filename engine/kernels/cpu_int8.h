// int8 products for CPUs (`cpu_int8.cpp`), shared by the linear layers and the experts.
#pragma once

#include <torch/extension.h>

#include <functional>
#include <optional>
#include <vector>

namespace engine_cpu {

// What a layer calibrated for int8 (`engine.quantization.int8`) adds to the product, each part
// undefined when absent: input_scale [in] float32 multiplies each input channel before the row
// is quantized (SmoothQuant's factors, 0 for the outlier channels), and the outlier channels
// (outlier_index [k] int64, at most 64) times outlier_weight [k, out] float32 are added in
// float32 after the int8 sums are scaled. outlier_pairs [k / 2, out] int32 (a bfloat16 model's)
// holds the same weights two channels a word as bfloat16, 2j in the low half.
struct Int8Smoothing {
  at::Tensor input_scale, outlier_index, outlier_weight, outlier_pairs;
};

// A weight quantized per output feature: q [in, out] int8, scale [out] float32, an optional
// bias [out], and its smoothing (undefined parts when it has none).
struct Int8Weight {
  at::Tensor q, scale;
  std::optional<at::Tensor> bias;
  Int8Smoothing smoothing;
};

// A weight as the Python side hands it: [q, scale, bias, input_scale, outlier_index, outlier_weight,
// outlier_pairs], the absent ones None.
Int8Weight int8_weight(const std::vector<std::optional<at::Tensor>>& parts);

// Called with rows [r0, r1) of a product once their sums are complete, on several threads at once.
using RowsDone = std::function<void(int64_t r0, int64_t r1)>;

// The exact int32 sums of xq [rows, in] int8 times q [in, out] int8 into `sums` [rows, out]:
// oneDNN's where the CPU sums int8 pairs in hardware, int16 pairs by vpmaddwd on other AVX2 CPUs
// (`cpu_int8_product.cpp`). `done` (if any) then sees every row once: right after a block's
// sums, on the thread that computed them, where a step has enough rows for the int16 pairs to
// run whole blocks, else after the product, over ranges in parallel.
void int8_product(const at::Tensor& xq, const at::Tensor& q, at::Tensor& sums, const RowsDone& done);

// The same into a new tensor, nothing done after.
at::Tensor int8_product(const at::Tensor& xq, const at::Tensor& q);

// x [rows, in] (float32, bfloat16 or float16) times `weight`. Each row of x is quantized on its
// own (symmetric, scale max|x| / 127, rounded half to even), the product summed exactly in
// int32, and out = float(sum) * x_scale[row] * scale[out] (+ bias), rounded once to x's dtype:
// a row's result never depends on the other rows.
at::Tensor int8_matmul(const at::Tensor& x, const Int8Weight& weight);

// A gated MLP on x [rows, in]: act(gate) * up (SiLU, or with `gelu` GELU's tanh form) of the
// gate/up product [rows, 2 * width], times down. The same bits as int8_matmul, act_and_mul and
// int8_matmul in turn: each row's gate/up outputs are rounded to x's dtype, activated and
// quantized for down while they sit in cache, instead of written to and read from the step.
at::Tensor int8_gated_mlp(const at::Tensor& x, const Int8Weight& gate_up, const Int8Weight& down, bool gelu);

}  // namespace engine_cpu
