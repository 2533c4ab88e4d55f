// int8 products for CPUs: rows quantized on the fly, the product on oneDNN's int8 kernels
// (VNNI or AMX where the CPU has them) through at::_int_mm, and the int32 sums scaled back.
//
// Quantizing the activations per row (per token) keeps each row's result independent of the
// batch, and int32 sums are exact, so unlike a floating-point product no padding or
// blocking choice changes a bit. The two passes around the product are vectorised here;
// PyTorch's operations for them cost a third of the product at a decode step's 64 rows.

#include "cpu_int8.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vector.h"

namespace engine_cpu {
namespace {

constexpr float kLevels = 127.f;

#if defined(__AVX2__) && defined(__FMA__)
inline float max_abs8(__m256 m) {
  __m128 v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));
  return _mm_cvtss_f32(v);
}

// Eight rounded, clamped values stored as int8.
inline void store8_int8(int8_t* p, __m256 v) {
  const __m256i i32 = _mm256_cvtps_epi32(v);  // rounds half to even (the default mode)
  const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(i16, i16));
}
#endif

// Row r of x, times input_scale per channel where there is one, as int8 in q, its scale in scale[r].
template <typename scalar_t>
void quantize_row(const scalar_t* x, const float* input_scale, int64_t n, int8_t* q, float* scale) {
  const auto value = [&](int64_t j) {
    const float v = static_cast<float>(x[j]);
    return input_scale != nullptr ? v * input_scale[j] : v;
  };
#if defined(__AVX2__) && defined(__FMA__)
  const auto value8 = [&](auto j) {  // generic: instantiated only where scalar_t has 8-lane loads
    const __m256 v = load8(x + j);
    return input_scale != nullptr ? _mm256_mul_ps(v, _mm256_loadu_ps(input_scale + j)) : v;
  };
#endif
  float peak = 0.f;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t>) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, value8(j)));
    peak = max_abs8(m);
  }
#endif
  for (; j < n; ++j) peak = std::max(peak, std::fabs(value(j)));
  const float s = peak / kLevels;
  *scale = s;
  if (s == 0.f) {
    std::fill(q, q + n, int8_t(0));
    return;
  }
  j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t>) {
    const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(kLevels), lo = _mm256_set1_ps(-kLevels);
    for (; j + 8 <= n; j += 8)
      store8_int8(q + j, _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(value8(j), sv))));
  }
#endif
  for (; j < n; ++j) q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(value(j) / s), -kLevels, kLevels));
}

constexpr int64_t kMaxOutliers = 64;

// A row's outlier channels (`Int8Smoothing`): their values, and their weight rows [count, n].
struct OutlierRow {
  float x[kMaxOutliers];
  const float* weight = nullptr;
  int64_t count = 0;
};

// side[c] = the outlier channels' products for output c, fused multiply-adds over the channels in
// order. Eight accumulators of eight outputs each keep both FMA pipes busy: one accumulator's
// chain of dependent FMAs would wait on each one's latency.
void outlier_sums(const OutlierRow& outliers, int64_t n, float* side) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int kAccumulators = 8;
  for (; c + 8 * kAccumulators <= n; c += 8 * kAccumulators) {
    __m256 acc[kAccumulators];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t k = 0; k < outliers.count; ++k) {
      const __m256 x = _mm256_set1_ps(outliers.x[k]);
      const float* w = outliers.weight + k * n + c;
      for (int a = 0; a < kAccumulators; ++a) acc[a] = _mm256_fmadd_ps(x, _mm256_loadu_ps(w + 8 * a), acc[a]);
    }
    for (int a = 0; a < kAccumulators; ++a) _mm256_storeu_ps(side + c + 8 * a, acc[a]);
  }
#endif
  for (; c < n; ++c) {
    float sum = 0.f;
    for (int64_t k = 0; k < outliers.count; ++k) sum = std::fma(outliers.x[k], outliers.weight[k * n + c], sum);
    side[c] = sum;
  }
}

// out[r, c] = float(acc[r, c]) * x_scale[r] * w_scale[c] (+ bias[c]) (+ side[c]), each step rounded
// to float32 in that order, then once to scalar_t.
template <typename scalar_t>
void dequantize_row(const int32_t* acc, int64_t n, float x_scale, const float* w_scale, const float* bias,
                    const float* side, scalar_t* out) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t>) {
    const __m256 xs = _mm256_set1_ps(x_scale);
    for (; c + 8 <= n; c += 8) {
      const __m256 a = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + c)));
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(a, xs), _mm256_loadu_ps(w_scale + c));
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
      if (side != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(side + c));
      store8(out + c, v);
    }
  }
#endif
  for (; c < n; ++c) {
    float v = static_cast<float>(acc[c]) * x_scale * w_scale[c];
    if (bias != nullptr) v += bias[c];
    if (side != nullptr) v += side[c];
    out[c] = static_cast<scalar_t>(v);
  }
}

template <typename scalar_t>
at::Tensor int8_matmul_typed(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             const std::optional<at::Tensor>& bias, const Int8Smoothing& smoothing) {
  const int64_t rows = x.size(0), in = x.size(1), out_features = q.size(1);
  at::Tensor xq = at::empty({rows, in}, x.options().dtype(at::kChar));
  at::Tensor x_scale = at::empty({rows}, x.options().dtype(at::kFloat));
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const float* isp = smoothing.input_scale.defined() ? smoothing.input_scale.data_ptr<float>() : nullptr;
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = x_scale.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row<scalar_t>(xp + r * in, isp, in, qp + r * in, sp + r);
  });
  const at::Tensor acc = at::_int_mm(xq, q);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t num_outliers = smoothing.outlier_index.defined() ? smoothing.outlier_index.numel() : 0;
  const int64_t* index = num_outliers ? smoothing.outlier_index.data_ptr<int64_t>() : nullptr;
  const float* outlier_weight = num_outliers ? smoothing.outlier_weight.data_ptr<float>() : nullptr;
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* wp = scale.data_ptr<float>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    OutlierRow outliers;
    outliers.weight = outlier_weight;
    outliers.count = num_outliers;
    std::vector<float> side(num_outliers ? out_features : 0);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t k = 0; k < num_outliers; ++k) outliers.x[k] = static_cast<float>(xp[r * in + index[k]]);
      if (num_outliers) outlier_sums(outliers, out_features, side.data());
      dequantize_row<scalar_t>(ap + r * out_features, out_features, sp[r], wp, bp, num_outliers ? side.data() : nullptr,
                               op + r * out_features);
    }
  });
  return out;
}

}  // namespace

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const Int8Smoothing& smoothing) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.size(0) == x.size(1), "x [rows, in] and q [in, out]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q: contiguous int8 [in, out]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == q.size(1) && scale.is_contiguous(),
              "scale: float32 [out]");
  TORCH_CHECK(!bias.has_value() || bias->numel() == q.size(1), "bias [out]");
  const at::Tensor& input_scale = smoothing.input_scale;
  TORCH_CHECK(!input_scale.defined() || (input_scale.scalar_type() == at::kFloat && input_scale.is_contiguous() &&
                                         input_scale.numel() == q.size(0)), "input_scale: float32 [in]");
  const at::Tensor& index = smoothing.outlier_index;
  TORCH_CHECK(!index.defined() || (index.scalar_type() == at::kLong && index.numel() <= kMaxOutliers &&
                                   smoothing.outlier_weight.scalar_type() == at::kFloat &&
                                   smoothing.outlier_weight.is_contiguous() &&
                                   smoothing.outlier_weight.sizes() == at::IntArrayRef({index.numel(), q.size(1)})),
              "outlier_index: int64 [k <= 64], outlier_weight: float32 [k, out]");
  const at::Tensor xc = x.contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_matmul", [&] {
    out = int8_matmul_typed<scalar_t>(xc, q, scale, bias, smoothing);
  });
  return out;
}

}  // namespace engine_cpu

// The Python entry (`engine.quantization.int8`): `int8_matmul` with x of any leading shape.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale,
                       const std::optional<at::Tensor>& outlier_index,
                       const std::optional<at::Tensor>& outlier_weight) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = q.size(1);
  const engine_cpu::Int8Smoothing smoothing{input_scale.value_or(at::Tensor()), outlier_index.value_or(at::Tensor()),
                                            outlier_weight.value_or(at::Tensor())};
  return engine_cpu::int8_matmul(x.reshape({-1, x.size(-1)}), q, scale, bias, smoothing).view(shape);
}
