// Greedy sampling for CPUs: each row's argmax of float32 logits in two vectorised passes
// (its largest value, then the first index holding it), where PyTorch's argmax reads the
// rows at a few GB/s (0.7 ms for 32 rows of 49,152 on a Zen 4; 4.2 ms a step for 64 on a
// Sapphire Rapids).
//
// The same index as torch.argmax: the first of the largest values, and where a row holds a
// NaN, its first NaN (NaN counts as the largest). Rows are independent.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The index torch.argmax gives for row[0:n].
int64_t argmax_row(const float* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t d = 0;
#if defined(__AVX2__)
  __m256 top = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) {
    const __m256 v = _mm256_loadu_ps(row + d);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (const float lane : lanes) best = std::max(best, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; d < n; ++d) {
    nan = nan || std::isnan(row[d]);
    best = std::max(best, row[d]);
  }
  d = 0;
  if (nan) {
    while (!std::isnan(row[d])) ++d;
    return d;
  }
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(best);
  for (; d + 8 <= n; d += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + d), target, _CMP_EQ_OQ));
    if (hits != 0) return d + __builtin_ctz(hits);
  }
#endif
  while (d < n && row[d] != best) ++d;
  return d < n ? d : 0;
}

}  // namespace

// logits [rows, vocab] float32 -> each row's argmax [rows] int64, as torch.argmax(dim=-1).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits [rows, vocab] float32");
  const at::Tensor x = logits.contiguous();
  const int64_t vocab = x.size(1);
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * vocab, vocab);
  });
  return out;
}
