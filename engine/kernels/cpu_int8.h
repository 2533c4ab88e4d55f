// int8 products for CPUs (`cpu_int8.cpp`), shared by the linear layers and the experts.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace engine_cpu {

// What a layer calibrated for int8 (`engine.quantization.int8`) adds to the product, each part
// undefined when absent: input_scale [in] float32 multiplies each input channel before the row
// is quantized (SmoothQuant's factors, 0 for the outlier channels), and the outlier channels
// (outlier_index [k] int64, at most 64) times outlier_weight [k, out] float32 are added in
// float32 after the int8 sums are scaled.
struct Int8Smoothing {
  at::Tensor input_scale, outlier_index, outlier_weight;
};

// x [rows, in] (float32, bfloat16 or float16) times a weight quantized per output feature:
// q [in, out] int8, scale [out] float32. Each row of x is quantized on its own (symmetric,
// scale max|x| / 127, rounded half to even), the product summed exactly in int32, and
// out = float(sum) * x_scale[row] * scale[out] (+ bias), rounded once to x's dtype: a row's
// result never depends on the other rows.
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const Int8Smoothing& smoothing = {});

}  // namespace engine_cpu
