// int8 products for CPUs: rows quantized on the fly, the product's exact int32 sums
// (`int8_product`: oneDNN's int8 kernels where the CPU has VNNI or AMX, int16 pairs on other
// AVX2 CPUs), and the sums scaled back.
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
#include <memory>
#include <vector>

#include "cpu_activation.h"
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
  const float reciprocal = 1.f / s;  // a product per element rather than a division
  j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t>) {
    const __m256 rv = _mm256_set1_ps(reciprocal), hi = _mm256_set1_ps(kLevels), lo = _mm256_set1_ps(-kLevels);
    for (; j + 8 <= n; j += 8)
      store8_int8(q + j, _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(value8(j), rv))));
  }
#endif
  for (; j < n; ++j) q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(value(j) * reciprocal), -kLevels, kLevels));
}

constexpr int64_t kMaxOutliers = 64;

// A step's rows ready for a product: quantized (xq [rows, in] int8, x_scale [rows]) and their
// outlier channels' values as floats (outliers [rows, k]; none without smoothing).
struct QuantizedRows {
  at::Tensor xq, x_scale, outliers;
};

// Quantizes rows of x for a product with a weight smoothed by `smoothing` (or not): row r
// from its values, which need not lie in a tensor (the fused MLP's activations).
struct Quantize {
  const float* input_scale;  // or null
  const int64_t* outlier_index;
  int64_t num_outliers;
  int64_t in;
  int8_t* xq;
  float* x_scale;
  float* outliers;

  static Quantize into(QuantizedRows& rows, const Int8Smoothing& smoothing) {
    const int64_t k = rows.outliers.size(1);
    return {smoothing.input_scale.defined() ? smoothing.input_scale.data_ptr<float>() : nullptr,
            k ? smoothing.outlier_index.data_ptr<int64_t>() : nullptr,
            k,
            rows.xq.size(1),
            rows.xq.data_ptr<int8_t>(),
            rows.x_scale.data_ptr<float>(),
            rows.outliers.data_ptr<float>()};
  }

  template <typename scalar_t>
  void row(const scalar_t* x, int64_t r) const {
    quantize_row<scalar_t>(x, input_scale, in, xq + r * in, x_scale + r);
    for (int64_t k = 0; k < num_outliers; ++k) outliers[r * num_outliers + k] = static_cast<float>(x[outlier_index[k]]);
  }
};

QuantizedRows empty_rows(int64_t rows, int64_t in, const Int8Smoothing& smoothing, const at::TensorOptions& options) {
  const int64_t k = smoothing.outlier_index.defined() ? smoothing.outlier_index.numel() : 0;
  return {at::empty({rows, in}, options.dtype(at::kChar)), at::empty({rows}, options.dtype(at::kFloat)),
          at::empty({rows, k}, options.dtype(at::kFloat))};
}

template <typename scalar_t>
QuantizedRows quantize(const at::Tensor& x, const Int8Smoothing& smoothing) {
  const int64_t rows = x.size(0), in = x.size(1);
  QuantizedRows quantized = empty_rows(rows, in, smoothing, x.options());
  const Quantize pass = Quantize::into(quantized, smoothing);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) pass.row(xp + r * in, r);
  });
  return quantized;
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// bfloat16 rows take their outlier channels two at a time through the CPU's bfloat16 dot
// products, where the weights come in pairs (`Int8Smoothing::outlier_pairs`): the channels'
// values are bfloat16 already, and so are a bfloat16 model's weights, so each product is exact
// as in a fused multiply-add, at half the instructions.
template <typename scalar_t>
constexpr bool kPairedOutliers = std::is_same_v<scalar_t, c10::BFloat16>;
#else
template <typename scalar_t>
constexpr bool kPairedOutliers = false;
#endif

// Two bfloat16 values (held as floats) in one 32-bit word, `low` in the low half: a pair as the
// bfloat16 dot product takes it.
inline uint32_t bf16_pair(float low, float high) {
  return static_cast<uint32_t>(c10::BFloat16(low).x) | static_cast<uint32_t>(c10::BFloat16(high).x) << 16;
}

// The pass after the product: out[r, c] = float(acc[r, c]) * x_scale[r] * w_scale[c] (+ bias[c])
// (+ side[r, c]), each step rounded to float32 in that order, then once to scalar_t. side[r, c] is
// the outlier channels' sum (`Int8Smoothing`): outliers[r, k] * outlier_weight[k, c] as fused
// multiply-adds over k in order, from zero (for bfloat16 rows with weight pairs, in the columns
// taken eight at a time, channels 2j and 2j + 1 in one bfloat16 dot product, over j in order, and
// an odd last channel after them: `kPairedOutliers`).
template <typename scalar_t>
struct Dequantize {
  const int32_t* acc;
  const float* x_scale;
  const float* w_scale;
  const float* bias;      // or null
  const float* outliers;  // [rows, num_outliers]
  const float* outlier_weight;  // [num_outliers, n]
  int64_t num_outliers;
  int64_t n;
  const uint32_t* weight_pairs;  // [num_outliers / 2, n], or null

  // The tensors must outlive the pass: it keeps their data pointers.
  Dequantize(const at::Tensor& sums, const QuantizedRows& rows, const at::Tensor& scale, const at::Tensor& bias_f,
             const Int8Smoothing& smoothing)
      : acc(sums.data_ptr<int32_t>()),
        x_scale(rows.x_scale.data_ptr<float>()),
        w_scale(scale.data_ptr<float>()),
        bias(bias_f.defined() ? bias_f.data_ptr<float>() : nullptr),
        outliers(rows.outliers.data_ptr<float>()),
        outlier_weight(rows.outliers.size(1) ? smoothing.outlier_weight.data_ptr<float>() : nullptr),
        num_outliers(rows.outliers.size(1)),
        n(sums.size(1)),
        weight_pairs(kPairedOutliers<scalar_t> && num_outliers && smoothing.outlier_pairs.defined()
                         ? reinterpret_cast<const uint32_t*>(smoothing.outlier_pairs.data_ptr<int32_t>())
                         : nullptr) {}

  void element(int64_t r, int64_t c, scalar_t* out) const {
    float side = 0.f;
    for (int64_t k = 0; k < num_outliers; ++k)
      side = std::fma(outliers[r * num_outliers + k], outlier_weight[k * n + c], side);
    float v = static_cast<float>(acc[r * n + c]) * x_scale[r] * w_scale[c];
    if (bias != nullptr) v += bias[c];
    if (num_outliers) v += side;
    out[c] = static_cast<scalar_t>(v);
  }

#if defined(__AVX2__) && defined(__FMA__)
  // Rows [r, r + R) and outputs [c, c + 8C) into out (row r's outputs; rows n apart): each
  // outlier weight vector loaded once serves R rows (one row at a time, the weights streamed
  // from L2 for every row held the pass at a third of the product).
  // x_pairs[i][j] is row r + i's channels 2j and 2j + 1 (where there are weight pairs).
  template <int R, int C>
  void tile(int64_t r, int64_t c, scalar_t* out, const uint32_t (*x_pairs)[kMaxOutliers / 2]) const {
    __m256 side[R][C];
    for (auto& row : side)
      for (auto& v : row) v = _mm256_setzero_ps();
    int64_t k = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if constexpr (kPairedOutliers<scalar_t>) {
      for (; weight_pairs != nullptr && k + 2 <= num_outliers; k += 2) {
        __m256bh w[C];
        for (int j = 0; j < C; ++j)
          w[j] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight_pairs + k / 2 * n + c + 8 * j));
        for (int i = 0; i < R; ++i) {
          const __m256bh xk = (__m256bh)_mm256_set1_epi32(static_cast<int>(x_pairs[i][k / 2]));
          for (int j = 0; j < C; ++j) side[i][j] = _mm256_dpbf16_ps(side[i][j], xk, w[j]);
        }
      }
    }
#endif
    for (; k < num_outliers; ++k) {
      __m256 w[C];
      for (int j = 0; j < C; ++j) w[j] = _mm256_loadu_ps(outlier_weight + k * n + c + 8 * j);
      for (int i = 0; i < R; ++i) {
        const __m256 xk = _mm256_set1_ps(outliers[(r + i) * num_outliers + k]);
        for (int j = 0; j < C; ++j) side[i][j] = _mm256_fmadd_ps(xk, w[j], side[i][j]);
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m256 xs = _mm256_set1_ps(x_scale[r + i]);
      for (int j = 0; j < C; ++j) {
        const int64_t col = c + 8 * j;
        const __m256 a =
            _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + (r + i) * n + col)));
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(a, xs), _mm256_loadu_ps(w_scale + col));
        if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col));
        if (num_outliers) v = _mm256_add_ps(v, side[i][j]);
        store8(out + i * n + col, v);
      }
    }
  }

  // Rows [r, r + R), every output.
  template <int R>
  void rows(int64_t r, scalar_t* out) const {
#if defined(__AVX512VL__)
    constexpr int C = 4;  // R * C accumulators of the 32 vector registers
#else
    constexpr int C = 2;
#endif
    uint32_t x_pairs[R][kMaxOutliers / 2];
    if (weight_pairs != nullptr) {
      for (int i = 0; i < R; ++i)
        for (int64_t j = 0; j < num_outliers / 2; ++j) {
          const float* pair = outliers + (r + i) * num_outliers + 2 * j;
          x_pairs[i][j] = bf16_pair(pair[0], pair[1]);
        }
    }
    int64_t c = 0;
    for (; c + 8 * C <= n; c += 8 * C) tile<R, C>(r, c, out, x_pairs);
    for (; c + 8 <= n; c += 8) tile<R, 1>(r, c, out, x_pairs);
    for (int i = 0; i < R; ++i)
      for (int64_t t = c; t < n; ++t) element(r + i, t, out + i * n);
  }
#endif

  // Rows [r0, r1) into out (row r0's outputs; rows n apart).
  void run(int64_t r0, int64_t r1, scalar_t* out) const {
    int64_t r = r0;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (kVector8<scalar_t>) {
      for (; r + 4 <= r1; r += 4) rows<4>(r, out + (r - r0) * n);
      for (; r < r1; ++r) rows<1>(r, out + (r - r0) * n);
    }
#endif
    for (; r < r1; ++r)
      for (int64_t c = 0; c < n; ++c) element(r, c, out + (r - r0) * n);
  }
};

at::Tensor float_bias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

// The product of quantized rows with a weight, dequantized into a new [rows, out] tensor of x's dtype.
template <typename scalar_t>
at::Tensor product(const QuantizedRows& rows, const Int8Weight& weight, const at::TensorOptions& options) {
  const int64_t n = weight.q.size(1);
  at::Tensor acc = at::empty({rows.xq.size(0), n}, options.dtype(at::kInt));
  at::Tensor out = at::empty({rows.xq.size(0), n}, options);
  const at::Tensor bias = float_bias(weight.bias);
  const Dequantize<scalar_t> pass(acc, rows, weight.scale, bias, weight.smoothing);
  scalar_t* op = out.data_ptr<scalar_t>();
  int8_product(rows.xq, weight.q, acc, [&](int64_t r0, int64_t r1) { pass.run(r0, r1, op + r0 * n); });
  return out;
}

// Rows handled together by the fused MLP: their gate/up outputs stay in a thread's L2.
constexpr int64_t kMlpBlockRows = 16;

template <typename scalar_t>
at::Tensor gated_mlp_typed(const at::Tensor& x, const Int8Weight& gate_up, const Int8Weight& down, bool gelu) {
  const int64_t rows = x.size(0), width = gate_up.q.size(1) / 2;
  const QuantizedRows first = quantize<scalar_t>(x, gate_up.smoothing);
  at::Tensor acc = at::empty({rows, 2 * width}, x.options().dtype(at::kInt));
  const at::Tensor bias = float_bias(gate_up.bias);
  const Dequantize<scalar_t> gate_up_pass(acc, first, gate_up.scale, bias, gate_up.smoothing);
  QuantizedRows second = empty_rows(rows, width, down.smoothing, x.options());
  const Quantize down_pass = Quantize::into(second, down.smoothing);
  int8_product(first.xq, gate_up.q, acc, [&](int64_t r0, int64_t r1) {
    const std::unique_ptr<scalar_t[]> gate_up_rows(new scalar_t[kMlpBlockRows * 2 * width]), act(new scalar_t[width]);
    for (int64_t b = r0; b < r1; b += kMlpBlockRows) {
      const int64_t e = std::min(b + kMlpBlockRows, r1);
      gate_up_pass.run(b, e, gate_up_rows.get());
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* row = gate_up_rows.get() + (r - b) * 2 * width;
        act_row(row, row + width, width, gelu, act.get());
        down_pass.row(act.get(), r);
      }
    }
  });
  return product<scalar_t>(second, down, x.options());
}

void check_weight(const Int8Weight& weight, int64_t in) {
  const at::Tensor &q = weight.q, &scale = weight.scale;
  TORCH_CHECK(q.dim() == 2 && q.size(0) == in, "x [rows, in] and q [in, out]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q: contiguous int8 [in, out]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == q.size(1) && scale.is_contiguous(),
              "scale: float32 [out]");
  TORCH_CHECK(!weight.bias.has_value() || weight.bias->numel() == q.size(1), "bias [out]");
  const at::Tensor& input_scale = weight.smoothing.input_scale;
  TORCH_CHECK(!input_scale.defined() || (input_scale.scalar_type() == at::kFloat && input_scale.is_contiguous() &&
                                         input_scale.numel() == in), "input_scale: float32 [in]");
  const at::Tensor& index = weight.smoothing.outlier_index;
  const at::Tensor& outlier_weight = weight.smoothing.outlier_weight;
  TORCH_CHECK(!index.defined() || (index.scalar_type() == at::kLong && index.numel() <= kMaxOutliers &&
                                   outlier_weight.scalar_type() == at::kFloat && outlier_weight.is_contiguous() &&
                                   outlier_weight.sizes() == at::IntArrayRef({index.numel(), q.size(1)})),
              "outlier_index: int64 [k <= 64], outlier_weight: float32 [k, out]");
  const at::Tensor& pairs = weight.smoothing.outlier_pairs;
  TORCH_CHECK(!pairs.defined() || (pairs.scalar_type() == at::kInt && pairs.is_contiguous() &&
                                   pairs.sizes() == at::IntArrayRef({index.numel() / 2, q.size(1)})),
              "outlier_pairs: int32 [k / 2, out]");
}

}  // namespace

at::Tensor int8_matmul(const at::Tensor& x, const Int8Weight& weight) {
  TORCH_CHECK(x.dim() == 2, "x [rows, in]");
  check_weight(weight, x.size(1));
  const at::Tensor xc = x.contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_matmul", [&] {
    out = product<scalar_t>(quantize<scalar_t>(xc, weight.smoothing), weight, xc.options());
  });
  return out;
}

at::Tensor int8_gated_mlp(const at::Tensor& x, const Int8Weight& gate_up, const Int8Weight& down, bool gelu) {
  TORCH_CHECK(x.dim() == 2, "x [rows, in]");
  check_weight(gate_up, x.size(1));
  TORCH_CHECK(gate_up.q.size(1) % 2 == 0, "gate_up: q [in, 2 * width]");
  check_weight(down, gate_up.q.size(1) / 2);
  const at::Tensor xc = x.contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_gated_mlp", [&] {
    out = gated_mlp_typed<scalar_t>(xc, gate_up, down, gelu);
  });
  return out;
}

Int8Weight int8_weight(const std::vector<std::optional<at::Tensor>>& parts) {
  TORCH_CHECK(parts.size() == 7 && parts[0] && parts[1],
              "a weight as [q, scale, bias, input_scale, outlier_index, outlier_weight, outlier_pairs]");
  const auto part = [&](size_t i) { return parts[i].value_or(at::Tensor()); };
  return {*parts[0], *parts[1], parts[2], {part(3), part(4), part(5), part(6)}};
}

}  // namespace engine_cpu

// The Python entries (`engine.quantization.int8`), x of any leading shape. int8_linear: x times
// one quantized weight (q, scale, bias, and its smoothing's four parts or Nones). int8_gated_mlp:
// a gated MLP, act(x @ gate_up[:, :width]) * (x @ gate_up[:, width:]) @ down, each weight given
// as a list of those seven (absent ones None), with the gate/up outputs dequantized, activated
// and quantized for down a row block at a time instead of through three passes over the step.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale,
                       const std::optional<at::Tensor>& outlier_index,
                       const std::optional<at::Tensor>& outlier_weight,
                       const std::optional<at::Tensor>& outlier_pairs) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = q.size(1);
  const auto weight = engine_cpu::int8_weight({q, scale, bias, input_scale, outlier_index, outlier_weight, outlier_pairs});
  return engine_cpu::int8_matmul(x.reshape({-1, x.size(-1)}), weight).view(shape);
}

at::Tensor int8_gated_mlp(const at::Tensor& x, const std::vector<std::optional<at::Tensor>>& gate_up,
                          const std::vector<std::optional<at::Tensor>>& down, bool gelu) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = down[0]->size(1);
  return engine_cpu::int8_gated_mlp(x.reshape({-1, x.size(-1)}), engine_cpu::int8_weight(gate_up),
                                     engine_cpu::int8_weight(down), gelu).view(shape);
}
