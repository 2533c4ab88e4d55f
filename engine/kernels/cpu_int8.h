// int8 products for CPUs (`cpu_int8.cpp`), shared by the linear layers and the experts.
#pragma once

#include <torch/extension.h>

#include <optional>

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

// The exact int32 sums [rows, out] of xq [rows, in] int8 times q [in, out] int8: oneDNN's where
// the CPU sums int8 pairs in hardware, int16 pairs by vpmaddwd on other AVX2 CPUs
// (`cpu_int8_product.cpp`).
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
