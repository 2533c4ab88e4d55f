// Paged attention for CPUs: every query row attends over its own sequence's keys, read
// straight from the paged cache through the block table (no gathered copy).
//
// Each (row, KV head) is one task, computed in a fixed order whatever else is in the
// step: a row's result depends only on its query and its keys, so a token gets the
// same bits in a decode step, a prefill chunk or a recompute, alone or in any batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 8;  // partial sums per dot product: one AVX2 register of floats

#if defined(__AVX2__) && defined(__FMA__)
// Head sizes of 8 * V floats, with the accumulators in AVX2 registers.
template <int V>
void dots_avx2(const float* q, const float* const* keys, int64_t n, float scale, float* scores) {
  alignas(32) float lanes[kLanes];
  for (int64_t c = 0; c < n; ++c) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < V; ++i) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * kLanes), _mm256_loadu_ps(keys[c] + i * kLanes), acc);
    _mm256_store_ps(lanes, acc);
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += lanes[j];
    scores[c] = sum * scale;
  }
}

template <int V>
void weighted_sum_avx2(const float* p, const float* const* values, int64_t n, float* out) {
  __m256 acc[V];
  for (int i = 0; i < V; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; ++c) {
    const __m256 w = _mm256_set1_ps(p[c]);
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values[c] + i * kLanes), acc[i]);
  }
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + i * kLanes, acc[i]);
}
#endif

// scores[c] = scale * (q . keys[c]) for c < n, each dot in kLanes partial sums added in
// lane order.
template <typename scalar_t>
void dots(const float* q, const scalar_t* const* keys, int64_t n, int64_t dim, float scale, float* scores) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (dim == 64) return dots_avx2<8>(q, keys, n, scale, scores);
    if (dim == 128) return dots_avx2<16>(q, keys, n, scale, scores);
  }
#endif
  for (int64_t c = 0; c < n; ++c) {
    float acc[kLanes] = {0.f};
    for (int64_t d = 0; d < dim; ++d) acc[d % kLanes] += q[d] * static_cast<float>(keys[c][d]);
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += acc[j];
    scores[c] = sum * scale;
  }
}

// out[0:dim] = sum over c < n of p[c] * values[c][0:dim], added in key order.
template <typename scalar_t>
void weighted_sum(const float* p, const scalar_t* const* values, int64_t n, int64_t dim, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (dim == 64) return weighted_sum_avx2<8>(p, values, n, out);
    if (dim == 128) return weighted_sum_avx2<16>(p, values, n, out);
  }
#endif
  std::fill(out, out + dim, 0.f);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t d = 0; d < dim; ++d) out[d] += p[c] * static_cast<float>(values[c][d]);
}

// Softmax of s[0:n] in place, in key order.
inline void softmax(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; ++c) top = std::max(top, s[c]);
  float total = 0.f;
  for (int64_t c = 0; c < n; ++c) {
    s[c] = std::exp(s[c] - top);
    total += s[c];
  }
  const float inv = 1.f / total;
  for (int64_t c = 0; c < n; ++c) s[c] *= inv;
}

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& row_keys,
            int64_t block_size, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* seq_of = row_seq.data_ptr<int64_t>();
  const int64_t* keys_of = row_keys.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(dim), scores, acc(dim);
    std::vector<const scalar_t*> key_rows, value_rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, h = task % kv_heads;
      const int64_t n = keys_of[row];
      const int64_t* table = tables + seq_of[row] * max_blocks;
      const scalar_t* k_head = kp + h * num_slots * dim;
      const scalar_t* v_head = vp + h * num_slots * dim;
      key_rows.resize(n);
      value_rows.resize(n);
      for (int64_t c = 0, block = 0; c < n; ++block) {
        const int64_t first = table[block] * block_size;
        for (int64_t offset = 0; offset < block_size && c < n; ++offset, ++c) {
          key_rows[c] = k_head + (first + offset) * dim;
          value_rows[c] = v_head + (first + offset) * dim;
        }
      }
      scores.resize(n);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
        for (int64_t d = 0; d < dim; ++d) query[d] = static_cast<float>(qp[(row * heads + head) * dim + d]);
        dots(query.data(), key_rows.data(), n, dim, fscale, scores.data());
        softmax(scores.data(), n);
        weighted_sum(scores.data(), value_rows.data(), n, dim, acc.data());
        scalar_t* o = op + (row * heads + head) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<scalar_t>(acc[d]);
      }
    }
  });
}

}  // namespace

// q [rows, heads, dim]; k_cache, v_cache [kv_heads, slots, dim]; block_tables [seqs,
// max_blocks] int64; row_seq [rows] (the row's sequence), row_keys [rows] (how many of
// its sequence's keys the row sees) int64. Returns [rows, heads, dim].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& row_seq,
                           const at::Tensor& row_keys, int64_t block_size, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && row_seq.scalar_type() == at::kLong &&
              row_keys.scalar_type() == at::kLong, "int64 tables");
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q, k_cache, v_cache, block_tables.contiguous(), row_seq.contiguous(),
                     row_keys.contiguous(), block_size, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a block table (CPU)");
}
