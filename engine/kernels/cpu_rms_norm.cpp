// RMSNorm with the residual add fused in, for CPUs: one pass over each row that adds the
// residual, keeps the sum (the next residual) and its sum of squares, and one that scales
// it, instead of PyTorch's six operators each reading and writing the whole step.
//
// With a residual it works in place, as vLLM's fused_add_rms_norm: the sum overwrites the
// residual and the normalised rows overwrite x, so a layer's two norms allocate nothing and
// a prefill chunk's rows are not written to fresh pages (in place, a norm of 1,024 rows ran
// in a third of the time inside a step). The weight is read in its own dtype.
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
template <typename scalar_t, typename weight_t>
void scale_row(const float* row, const weight_t* weight, float scale, int64_t hidden, scalar_t* out) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t> && kVector8<weight_t>) {
    const __m256 s = _mm256_set1_ps(scale);
    for (; d + 8 <= hidden; d += 8)
      store8(out + d, _mm256_mul_ps(load8(weight + d), round8<scalar_t>(_mm256_mul_ps(_mm256_loadu_ps(row + d), s))));
  }
#endif
  for (; d < hidden; ++d)
    out[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) * static_cast<float>(static_cast<scalar_t>(row[d] * scale)));
}

// out = the normalised rows of x (plus residual, the sum written to `sum`); out may be x and
// sum may be residual: a row is read whole before it is written.
template <typename scalar_t, typename weight_t, typename residual_t>
void normalize(const at::Tensor& x, const weight_t* wp, double eps, const residual_t* residual, residual_t* sum,
               at::Tensor& out) {
  const int64_t hidden = x.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
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

// The weight's elements as normalize reads them: in x's dtype or float32 as they are, any
// other dtype widened to float32 first.
template <typename scalar_t, typename F>
void with_weight(const at::Tensor& weight, F&& fn) {
  if (weight.scalar_type() == at::kFloat && weight.is_contiguous())
    fn(weight.data_ptr<float>());
  else if (weight.scalar_type() == c10::CppTypeToScalarType<scalar_t>::value && weight.is_contiguous())
    fn(weight.data_ptr<scalar_t>());
  else
    fn(weight.to(at::kFloat).contiguous().data_ptr<float>());
}

}  // namespace

// weight * rms_norm(x) for x [rows, hidden], in x's dtype. Without `residual`, a new tensor.
// Given `residual` [rows, hidden] (float32 or x's dtype), of x + residual, in place: the sum
// overwrites the residual and the result overwrites x (each through a copy where it is not
// contiguous); both are returned, the result first.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x [rows, hidden], weight [hidden]");
  const at::Tensor input = x.contiguous();
  if (!residual.has_value()) {
    at::Tensor out = at::empty_like(input);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
      with_weight<scalar_t>(weight, [&](const auto* w) {
        normalize<scalar_t>(input, w, eps, static_cast<const float*>(nullptr), static_cast<float*>(nullptr), out);
      });
    });
    return {out};
  }
  TORCH_CHECK(residual->sizes() == x.sizes(), "residual [rows, hidden] as x");
  TORCH_CHECK(residual->scalar_type() == at::kFloat || residual->scalar_type() == x.scalar_type(),
              "residual in float32 or x's dtype");
  at::Tensor sum = residual->contiguous(), out = input;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    with_weight<scalar_t>(weight, [&](const auto* w) {
      if (sum.scalar_type() == at::kFloat)
        normalize<scalar_t>(input, w, eps, sum.data_ptr<float>(), sum.data_ptr<float>(), out);
      else
        normalize<scalar_t>(input, w, eps, sum.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), out);
    });
  });
  return {out, sum};
}
