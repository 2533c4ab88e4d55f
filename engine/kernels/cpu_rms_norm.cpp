// RMSNorm with the residual add fused in, for CPUs: one pass over each row that adds the
// residual, keeps the sum (the next residual) and its sum of squares, and one that scales
// it, instead of PyTorch's six operators each reading and writing the whole step.
//
// Rounded as `engine.layers.layernorm.RMSNorm.torch_forward` rounds: the sum in float32 (or
// the residual's dtype), the normalised row rounded to x's dtype, then times the weight and
// rounded again. Each row is computed alone, in a fixed order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <optional>
#include <vector>

#include "cpu_vector.h"

namespace {

using namespace engine_cpu;

// row[0:hidden] = x as floats, plus residual where given (their sum also written to sum);
// returns the sum of squares.
template <typename scalar_t, typename residual_t>
float add_and_square(const scalar_t* x, const residual_t* residual, residual_t* sum, int64_t hidden, float* row) {
  int64_t d = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t> && kVector8<residual_t>) {
    __m256 squares = _mm256_setzero_ps();
    for (; d + 8 <= hidden; d += 8) {
      __m256 v = load8(x + d);
      if (residual != nullptr) {
        v = round8<residual_t>(_mm256_add_ps(load8(residual + d), v));
        store8(sum + d, v);
      }
      _mm256_storeu_ps(row + d, v);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, squares);
    for (const float lane : lanes) total += lane;
  }
#endif
  for (; d < hidden; ++d) {
    float v = static_cast<float>(x[d]);
    if (residual != nullptr) {
      sum[d] = static_cast<residual_t>(static_cast<float>(residual[d]) + v);
      v = static_cast<float>(sum[d]);
    }
    row[d] = v;
    total += v * v;
  }
  return total;
}

// out = weight * round(row * scale), rounded to scalar_t.
template <typename scalar_t>
void scale_row(const float* row, const float* weight, float scale, int64_t hidden, scalar_t* out) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t>) {
    const __m256 s = _mm256_set1_ps(scale);
    for (; d + 8 <= hidden; d += 8)
      store8(out + d, _mm256_mul_ps(_mm256_loadu_ps(weight + d), round8<scalar_t>(_mm256_mul_ps(_mm256_loadu_ps(row + d), s))));
  }
#endif
  for (; d < hidden; ++d)
    out[d] = static_cast<scalar_t>(weight[d] * static_cast<float>(static_cast<scalar_t>(row[d] * scale)));
}

template <typename scalar_t, typename residual_t>
void normalize(const at::Tensor& x, const at::Tensor& weight, double eps, const residual_t* residual, residual_t* sum,
               at::Tensor& out) {
  const int64_t hidden = x.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const float* wp = weight.data_ptr<float>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(hidden);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t at = r * hidden;
      const float squares = residual != nullptr ? add_and_square(xp + at, residual + at, sum + at, hidden, row.data())
                                                : add_and_square<scalar_t, residual_t>(xp + at, nullptr, nullptr, hidden,
                                                                                       row.data());
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps));
      scale_row(row.data(), wp, scale, hidden, op + r * hidden);
    }
  });
}

}  // namespace

// weight * rms_norm(x) for x [rows, hidden], in x's dtype; given `residual` [rows, hidden]
// (float32 or x's dtype), of x + residual, and that sum is returned second (a new tensor in
// residual's dtype: the next residual).
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x [rows, hidden], weight [hidden]");
  const at::Tensor input = x.contiguous(), w = weight.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(input);
  if (!residual.has_value()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
      normalize<scalar_t, float>(input, w, eps, nullptr, nullptr, out);
    });
    return {out};
  }
  TORCH_CHECK(residual->sizes() == x.sizes(), "residual [rows, hidden] as x");
  TORCH_CHECK(residual->scalar_type() == at::kFloat || residual->scalar_type() == x.scalar_type(),
              "residual in float32 or x's dtype");
  const at::Tensor before = residual->contiguous();
  at::Tensor sum = at::empty_like(before);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    if (sum.scalar_type() == at::kFloat)
      normalize<scalar_t, float>(input, w, eps, before.data_ptr<float>(), sum.data_ptr<float>(), out);
    else
      normalize<scalar_t, scalar_t>(input, w, eps, before.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), out);
  });
  return {out, sum};
}
