// Paged attention for CPUs: every query row attends over its own sequence's keys, read
// straight from the paged cache through the block table (no gathered copy).
//
// Each (row, KV head) is one task, computed in a fixed order whatever else is in the
// step: a row's result depends only on its query and its keys, so a token gets the
// same bits in a decode step, a prefill chunk or a recompute, alone or in any batch.
//
// A row at position p = n - 1 sees keys [first, n) of its sequence: first = 0, or the
// latest of n - W with a sliding window of W keys and p / C * C with attention chunks of C
// keys (its own chunk only). Scores are scale * (q . k), soft-capped to cap * tanh(score /
// cap) when a cap is given, before the softmax. With attention sinks, head h's sink joins
// its softmax's denominator (exp(sink - m), m the largest score or sink) without a value.
//
// The cache may be narrower than the queries (a float32 model over a bfloat16 or float16
// cache) or int8 with a float scale per (token, KV head): a key's dot product and a value's
// weight are then multiplied by that token's scale, so keys are never widened in memory.
//
// A prefill's tile of rows (six queries or more a KV head) computes each block as matrix products
// do, keys transposed once and many queries' sums in registers, in the order a row alone adds them.
//
// On a CPU with AVX512-BF16, bfloat16 queries over a bfloat16 cache take scores and (without
// a sliding window) value sums by its bfloat16 dot products, the weights rounded to bfloat16.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_rotary.h"
#include "cpu_vector.h"

namespace {

using namespace engine_cpu;

constexpr int kLanes = 8;  // partial sums per dot product: one AVX2 register of floats

// Caches stored with a scale per (token, KV head).
template <typename cache_t>
constexpr bool kScaled = std::is_same_v<cache_t, int8_t>;

// Calls run(cache_t{}) for the C++ type of a KV cache's dtype, the ones the kernels read.
template <typename F>
void dispatch_cache_type(at::ScalarType dtype, const F& run) {
  switch (dtype) {
    case at::kFloat: return run(float{});
    case at::kBFloat16: return run(c10::BFloat16{});
    case at::kHalf: return run(c10::Half{});
    case at::kChar: return run(int8_t{});
    default: TORCH_CHECK(false, "a KV cache in float32, bfloat16, float16 or int8, got ", dtype);
  }
}

// Calls fn(std::integral_constant<int, G>{}) for G = count, 1 to kMax: the kernels that take the
// size of a group of queries as a template argument (their accumulators live in registers),
// called for a size known only at run time.
template <int kMax, int G = 1, typename F>
void with_group(int count, const F& fn) {
  if constexpr (G <= kMax) {
    if (count == G) return fn(std::integral_constant<int, G>{});
    return with_group<kMax, G + 1>(count, fn);
  } else {
    TORCH_CHECK(false, "between 1 and ", kMax, " queries together, got ", count);
  }
}

// scores[first:n] = cap * tanh(scores / cap), in place; returns their maximum.
inline float soft_cap(float* scores, int64_t first, int64_t n, float cap) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = first; c < n; ++c) {
    scores[c] = cap * std::tanh(scores[c] / cap);
    top = std::max(top, scores[c]);
  }
  return top;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_max(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float horizontal_sum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// How many keys ahead of its use a key's (or value's) cache lines are asked for: a
// sequence's keys lie in blocks apart in the cache, and the hardware prefetcher alone left
// the arithmetic waiting on memory (decode, caches beyond L3: 0.78 ms a layer against 0.39
// with the cache hot).
constexpr int64_t kAhead = 16;

// A thread's buffer of `size` T (contents left as they were), kept from task to task: a decode
// task's allocations would cost a tenth of its arithmetic. `kTag` tells apart the buffers of one T.
template <typename T, int kTag>
T* scratch(size_t size) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// Keys a task reads at a time for all its queries (while they sit in L1).
constexpr int64_t kBlock = 64;

// Asks for a row's cache lines, into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <int V, int kHint = _MM_HINT_T0, typename scalar_t>
inline void prefetch_row(const scalar_t* row) {
  constexpr int64_t bytes = V * kLanes * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + b, static_cast<_mm_hint>(kHint));
}

// A scorer's reads ahead as it scores keys [c, c + kKeys) of a block it reads in place, as far as
// `end` (0: none): into L2, these keys' values and the keys a block further on.
template <int V, int kKeys, typename scalar_t>
inline void read_block_ahead(const scalar_t* const* keys, const scalar_t* const* values, int64_t c, int64_t end) {
  for (int64_t a = c + kBlock; a < std::min(c + kBlock + kKeys, end); ++a) prefetch_row<V, _MM_HINT_T1>(keys[a]);
  for (int64_t a = c; a < std::min(c + kKeys, end); ++a) prefetch_row<V, _MM_HINT_T1>(values[a]);
}

// Queries scored together (scores_avx2, scores_bf16, scores_packed): the heads of a row that see
// the same keys, as many as keep their accumulators in the vector registers.
constexpr int kScoreGroup = 3;

// The scores of kKeys keys (eight or four) from their accumulators acc[j] (key j's eight lanes of
// partial sums), each key's lanes added as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then
// scaled: key j in lane j (four keys: repeated in lanes 4 to 7).
template <int kKeys>
inline __m256 key_scores(const __m256* acc, float scale) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  if constexpr (kKeys == 8) {
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)),
                         _mm256_set1_ps(scale));
  } else {
    static_assert(kKeys == 4, "eight or four keys");
    const __m128 s = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1)), _mm_set1_ps(scale));
    return _mm256_set_m128(s, s);
  }
}

// The scores of G queries q[g] that see the same keys [c0, c1) (the heads of one row over one KV
// head) into scores[g]: a key's score is eight lanes of products, lane l summing dimensions l,
// l + 8, l + 16, ... in that order, added by key_scores, times the key's scale (int8 caches). One
// query takes eight keys at a time (float keys: their loads cost little, the sums across registers
// more); a group takes four, each key loaded (a narrower cache's widened) once for all G, their
// accumulators filling the registers. A last group past c1 repeats key c1 - 1 and is stored but
// never read. Keys before `end` are asked for as it goes (end 0: none, they are in L1 already):
// kAhead keys ahead into L1, and into L2 these keys' values and the keys a block further on.
// top[g]: query g's running maximum.
template <int V, int G, typename scalar_t>
void scores_avx2(const float* const* q, const scalar_t* const* keys, const scalar_t* const* values,
                 const float* key_scales, int64_t c0, int64_t c1, int64_t end, float scale, float* const* scores,
                 __m256* top) {
  constexpr int kKeys = G == 1 ? 8 : 4;
  for (int64_t c = c0; c < c1; c += kKeys) {
    for (int64_t a = c + kAhead; a < std::min(c + kAhead + kKeys, end); ++a) prefetch_row<V>(keys[a]);
    read_block_ahead<V, kKeys>(keys, values, c, end);
    const scalar_t* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = keys[std::min<int64_t>(c + j, c1 - 1)];
    __m256 acc[G][kKeys];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < kKeys; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int i = 0; i < V; ++i)
      for (int j = 0; j < kKeys; ++j) {
        const __m256 key = load8(k[j] + i * kLanes);
        for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + i * kLanes), key, acc[g][j]);
      }
    __m256 key_scale = _mm256_set1_ps(1.f);
    if constexpr (kScaled<scalar_t>) {
      float each[kLanes];
      for (int j = 0; j < kLanes; ++j) each[j] = key_scales[std::min<int64_t>(c + j % kKeys, c1 - 1)];
      key_scale = _mm256_loadu_ps(each);
    }
    for (int g = 0; g < G; ++g) {
      __m256 s = key_scores<kKeys>(acc[g], scale);
      if constexpr (kScaled<scalar_t>) s = _mm256_mul_ps(s, key_scale);
      if constexpr (kKeys == 8)
        _mm256_storeu_ps(scores[g] + c, s);
      else
        _mm_storeu_ps(scores[g] + c, _mm256_castps256_ps128(s));
      top[g] = _mm256_max_ps(top[g], s);
    }
  }
}

// Queries a task needs before each block of its keys and values is packed, transposed or widened
// once for all of them (a prefill's tile of rows; a decode row's heads read each key once already).
constexpr int64_t kPackFrom = 6;

// Caches whose rows the AVX2 kernels widen to floats as they load them (bfloat16, float16).
template <typename cache_t>
constexpr bool kWidened = !std::is_same_v<cache_t, float> && !kScaled<cache_t>;

// A prefill tile's blocks of a narrower cache's values widened to floats, exactly, once for all the
// tile's queries (`on`: the cache is narrower and the task is a tile): load(c0) widens rows [c0,
// c0 + kBlock) that some query sees into a thread's buffer, and rows[c] points at row c's floats.
// (A tile's keys are transposed instead: score_block_transposed.)
template <int V, typename scalar_t>
struct WidenedBlocks {
  bool on;
  int64_t earliest, longest;
  float* wide;
  const float** rows;

  WidenedBlocks(int64_t count, const int64_t* first, int64_t longest, bool tile)
      : on(kWidened<scalar_t> && tile && count >= kPackFrom),
        earliest(*std::min_element(first, first + count)),
        longest(longest),
        wide(scratch<float, 4>(on ? kBlock * V * kLanes : 0)),
        rows(scratch<const float*, 1>(on ? longest : 0)) {}

  void load(const scalar_t* const* from, int64_t c0) {
    if (!on) return;
    for (int64_t c = std::max(c0, earliest); c < std::min(c0 + kBlock, longest); ++c) {
      if (c + kAhead < longest) prefetch_row<V>(from[c + kAhead]);
      float* row = wide + (c - c0) * V * kLanes;
      for (int i = 0; i < V; ++i) _mm256_storeu_ps(row + i * kLanes, load8(from[c] + i * kLanes));
      rows[c] = row;
    }
  }
};

// A prefill tile's scores computed as a matrix product computes them, with scores_avx2's bits: each
// block of keys transposed once, then for each lane l of scores_avx2's partial sums (dimensions l,
// l + 8, l + 16, ... in that order) the partials of kTileQueries queries by kTileKeys eights of
// keys held in registers, a query's dimension broadcast once for all those keys and eight keys'
// dimension loaded once for all those queries (a prefill 47 -> 53 GFLOP/s on a Zen 3, one
// thread); the eight partials are then added as key_scores adds them.
constexpr int kTileQueries = 5, kTileKeys = 2;

// out[m * stride + j] = r[j][m]: eight registers' floats transposed.
inline void transpose_8x8(const __m256* r, float* out, int64_t stride) {
  __m256 t[kLanes], u[kLanes];
  for (int m = 0; m < kLanes; m += 2) {
    t[m] = _mm256_unpacklo_ps(r[m], r[m + 1]);
    t[m + 1] = _mm256_unpackhi_ps(r[m], r[m + 1]);
  }
  for (int m = 0; m < kLanes; m += 4) {
    u[m] = _mm256_shuffle_ps(t[m], t[m + 2], 0x44);
    u[m + 1] = _mm256_shuffle_ps(t[m], t[m + 2], 0xEE);
    u[m + 2] = _mm256_shuffle_ps(t[m + 1], t[m + 3], 0x44);
    u[m + 3] = _mm256_shuffle_ps(t[m + 1], t[m + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    _mm256_storeu_ps(out + m * stride, _mm256_permute2f128_ps(u[m], u[m + 4], 0x20));
    _mm256_storeu_ps(out + (m + 4) * stride, _mm256_permute2f128_ps(u[m], u[m + 4], 0x31));
  }
}

// Keys [c0, c1) (at most kBlock) as floats, transposed: kt[d * kBlock + j] is dimension d of key
// c0 + j; keys from c1 to the next multiple of eight are zero.
template <int V, typename scalar_t>
void transpose_keys(const scalar_t* const* keys, int64_t c0, int64_t c1, float* kt) {
  for (int64_t j = 0; j < c1 - c0; j += kLanes)
    for (int i = 0; i < V; ++i) {
      __m256 r[kLanes];
      for (int m = 0; m < kLanes; ++m)
        r[m] = c0 + j + m < c1 ? load8(keys[c0 + j + m] + i * kLanes) : _mm256_setzero_ps();
      transpose_8x8(r, kt + i * kLanes * kBlock + j, kBlock);
    }
}

// Lane l's partial sums of Q queries q[a] by K eights of transposed keys (kt from the first) into
// part[a * 8 + l][b].
template <int V, int Q, int K>
inline void lane_partials(const float* const* q, const float* kt, int l, __m256 (*part)[K]) {
  __m256 acc[Q][K];
  for (int a = 0; a < Q; ++a)
    for (int b = 0; b < K; ++b) acc[a][b] = _mm256_setzero_ps();
  for (int i = 0; i < V; ++i) {
    const int d = l + i * kLanes;
    __m256 k[K];
    for (int b = 0; b < K; ++b) k[b] = _mm256_loadu_ps(kt + d * kBlock + b * kLanes);
    for (int a = 0; a < Q; ++a) {
      const __m256 w = _mm256_broadcast_ss(q[a] + d);
      for (int b = 0; b < K; ++b) acc[a][b] = _mm256_fmadd_ps(w, k[b], acc[a][b]);
    }
  }
  for (int a = 0; a < Q; ++a)
    for (int b = 0; b < K; ++b) part[a * kLanes + l][b] = acc[a][b];
}

// The scores of Q queries (q[a], into rows scores[a]) and K eights of keys from key c (kt: their
// transposed block from c); a query's maximum top[a] is raised by those of its own keys [first[a],
// n[a]) only, the others being scored and never read.
template <int V, int Q, int K>
void score_transposed(const float* const* q, const float* kt, int64_t c, const int64_t* first, const int64_t* n,
                      float scale, float* const* scores, __m256* top) {
  __m256 part[Q * kLanes][K];
  for (int l = 0; l < kLanes; ++l) lane_partials<V, Q, K>(q, kt, l, part);
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int a = 0; a < Q; ++a)
    for (int b = 0; b < K; ++b) {
      const auto at = [&](int l) { return part[a * kLanes + l][b]; };
      const __m256 low = _mm256_add_ps(_mm256_add_ps(at(0), at(1)), _mm256_add_ps(at(2), at(3)));
      const __m256 high = _mm256_add_ps(_mm256_add_ps(at(4), at(5)), _mm256_add_ps(at(6), at(7)));
      const __m256 s = _mm256_mul_ps(_mm256_add_ps(low, high), _mm256_set1_ps(scale));
      const int64_t from = c + b * kLanes;
      _mm256_storeu_ps(scores[a] + from, s);
      const __m256 index = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(from)), iota);
      const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(index, _mm256_set1_ps(static_cast<float>(first[a])), _CMP_GE_OQ),
                                        _mm256_cmp_ps(index, _mm256_set1_ps(static_cast<float>(n[a])), _CMP_LT_OQ));
      top[a] = _mm256_max_ps(top[a], _mm256_blendv_ps(none, s, seen));
    }
}

// Block [c0, c0 + kBlock) of the keys (longest: the task's last key) transposed into kt and scored
// for every query of a tile by score_transposed, kTileQueries at a time, from the first key some
// query of the group sees to the last.
template <int V, typename scalar_t>
void score_block_transposed(const float* q, int64_t count, const int64_t* first, const int64_t* n,
                            const scalar_t* const* keys, int64_t c0, int64_t longest, float scale, float* scores,
                            int64_t stride, __m256* top, float* kt) {
  constexpr int dim = V * kLanes;
  const int64_t c1 = std::min(c0 + kBlock, longest);
  transpose_keys<V>(keys, c0, c1, kt);
  for (int64_t i = 0; i < count; i += kTileQueries) {
    const int size = static_cast<int>(std::min<int64_t>(kTileQueries, count - i));
    int64_t start = c1, end = c0;
    const float* qs[kTileQueries];
    float* rows[kTileQueries];
    for (int a = 0; a < size; ++a) {
      qs[a] = q + (i + a) * dim, rows[a] = scores + (i + a) * stride;
      if (n[i + a] <= c0 || first[i + a] >= c1) continue;
      start = std::min(start, std::max(c0, first[i + a])), end = std::max(end, std::min(c1, n[i + a]));
    }
    for (int64_t j = start >= end ? kBlock : (start - c0) / kLanes * kLanes; j < end - c0; j += kTileKeys * kLanes) {
      const int eights = static_cast<int>(std::min<int64_t>(kTileKeys, (end - c0 - j + kLanes - 1) / kLanes));
      with_group<kTileQueries>(size, [&](auto queries) {
        with_group<kTileKeys>(eights, [&](auto eights_of_keys) {
          score_transposed<V, queries(), eights_of_keys()>(qs, kt + j, c0 + j, first + i, n + i, scale, rows, top + i);
        });
      });
    }
  }
}

// scores[first:n] = exp(scores - max), zero past n, max the largest of the scores and `sink`;
// returns 1 / (their sum + exp(sink - max)). A sink of -inf (none) changes nothing.
inline float exponentiate_avx2(float* scores, int64_t first, int64_t n, __m256 top, float sink) {
  const float largest = std::max(horizontal_max(top), sink);
  const __m256 top_all = _mm256_set1_ps(largest);
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 total = _mm256_setzero_ps();
  int64_t c = first;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // Sixteen at a time while all are live, added to the eight lanes' sums as two eights in turn.
  for (const __m512 top16 = _mm512_set1_ps(largest); c + 2 * kLanes <= n; c += 2 * kLanes) {
    const __m512 p = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(scores + c), top16));
    _mm512_storeu_ps(scores + c, p);
    total = _mm256_add_ps(_mm256_add_ps(total, _mm512_castps512_ps256(p)), _mm512_extractf32x8_ps(p, 1));
  }
#endif
  for (; c < n; c += kLanes) {
    const __m256 index = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(c)), iota);
    const __m256 live = _mm256_cmp_ps(index, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
    const __m256 p = _mm256_and_ps(live, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + c), top_all)));
    _mm256_storeu_ps(scores + c, p);
    total = _mm256_add_ps(total, p);
  }
  return 1.f / (horizontal_sum(total) + std::exp(sink - largest));
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// Caches whose keys meet bfloat16 queries: scores by the CPU's bfloat16 dot products, two
// elements a lane per instruction, where widening each element would cost two more.
template <typename query_t, typename cache_t>
constexpr bool kBf16Dots = std::is_same_v<query_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;

// scores_avx2 for G bfloat16 queries (exact as floats in q[g]) that see the same keys [c0,
// c1) (the heads of one row over one KV head), over bfloat16 keys: a key's score is eight lanes
// of pair products, lane l summing pairs l, l + 8, l + 16, ... in that order, added by
// key_scores. Four keys at a time, so that the G queries' accumulators and pairs stay in
// registers and each key is loaded once for all of them. top[g]: query g's running maximum.
template <int V, int G>
void scores_bf16(const float* const* q, const c10::BFloat16* const* keys, const c10::BFloat16* const* values,
                 int64_t c0, int64_t c1, int64_t end, float scale, float* const* scores, __m256* top) {
  constexpr int kKeys = 4;
  __m256bh qb[G][V / 2];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V / 2; ++i)
      qb[g][i] = _mm256_cvtne2ps_pbh(_mm256_loadu_ps(q[g] + (2 * i + 1) * kLanes), _mm256_loadu_ps(q[g] + 2 * i * kLanes));
  for (int64_t c = c0; c < c1; c += kKeys) {
    read_block_ahead<V, kKeys>(keys, values, c, end);
    const c10::BFloat16* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = keys[std::min<int64_t>(c + j, c1 - 1)];
    __m256 acc[G][kKeys];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < kKeys; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int i = 0; i < V / 2; ++i)
      for (int j = 0; j < kKeys; ++j) {
        const __m256bh key = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[j] + 2 * i * kLanes));
        for (int g = 0; g < G; ++g) acc[g][j] = _mm256_dpbf16_ps(acc[g][j], qb[g][i], key);
      }
    for (int g = 0; g < G; ++g) {
      const __m256 s = key_scores<kKeys>(acc[g], scale);
      _mm_storeu_ps(scores[g] + c, _mm256_castps256_ps128(s));
      top[g] = _mm256_max_ps(top[g], s);
    }
  }
}

// Prefill scores with a key loaded once for many queries: a block's keys packed sixteen at a
// time as [dimension pair][key] (one 512-bit register holds one pair of dimensions of sixteen
// keys), scored with each query's pair broadcast, so no score needs a sum across a register.
// Each lane repeats scores_bf16's arithmetic for its key: eight partial sums, partial l over
// pairs l, l + 8, l + 16, ... in that order, added as key_scores adds them, scaled, so a
// score has the same bits either way (a row in a prefill chunk and in decode alike).
constexpr int64_t kPacked = 16;  // keys a packed register holds

// out[16 m + j] = rows[j][m] for a 16 x 16 block of 32-bit words (four rounds of shuffles).
inline void transpose_16x16(const __m512i* rows, uint32_t* out) {
  __m512i t[16], u[16];
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_epi32(rows[j], rows[j + 1]);
    t[j + 1] = _mm512_unpackhi_epi32(rows[j], rows[j + 1]);
  }
  for (int k = 0; k < 16; k += 4) {  // u[k + m], 128-bit lane L: word 4L + m of rows k to k + 3
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm512_shuffle_i32x4(u[m], u[m + 4], 0x88);  // words m and m + 8 of rows 0-7
    t[m + 4] = _mm512_shuffle_i32x4(u[m], u[m + 4], 0xdd);  // words m + 4 and m + 12
    t[m + 8] = _mm512_shuffle_i32x4(u[m + 8], u[m + 12], 0x88);  // the same of rows 8-15
    t[m + 12] = _mm512_shuffle_i32x4(u[m + 8], u[m + 12], 0xdd);
  }
  for (int m = 0; m < 4; ++m) {
    _mm512_storeu_si512(out + 16 * m, _mm512_shuffle_i32x4(t[m], t[m + 8], 0x88));
    _mm512_storeu_si512(out + 16 * (m + 8), _mm512_shuffle_i32x4(t[m], t[m + 8], 0xdd));
    _mm512_storeu_si512(out + 16 * (m + 4), _mm512_shuffle_i32x4(t[m + 4], t[m + 12], 0x88));
    _mm512_storeu_si512(out + 16 * (m + 12), _mm512_shuffle_i32x4(t[m + 4], t[m + 12], 0xdd));
  }
}

// Keys [c, c + 16) as 4V registers' worth of pairs: packed[d * 16 + j] is pair d of key c + j
// (keys from `end` on repeat key end - 1; their scores are never stored).
template <int V>
void pack_keys(const c10::BFloat16* const* keys, int64_t c, int64_t end, uint32_t* packed) {
  const uint32_t* key[kPacked];
  for (int64_t j = 0; j < kPacked; ++j) key[j] = reinterpret_cast<const uint32_t*>(keys[std::min(c + j, end - 1)]);
  for (int h = 0; h < V / 4; ++h) {  // sixteen pairs at a time
    __m512i rows[kPacked];
    for (int64_t j = 0; j < kPacked; ++j) rows[j] = _mm512_loadu_si512(key[j] + 16 * h);
    transpose_16x16(rows, packed + 16 * kPacked * h);
  }
}

// A query's pairs as scores_bf16 rounds them: words[8i + l] holds its register i's lane l.
template <int V>
void query_pairs(const float* q, uint32_t* words) {
  for (int i = 0; i < V / 2; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + i * kLanes),
                        (__m256i)_mm256_cvtne2ps_pbh(_mm256_loadu_ps(q + (2 * i + 1) * kLanes),
                                                     _mm256_loadu_ps(q + 2 * i * kLanes)));
}

// The scores of G queries (their pairs qw[g]) against sixteen packed keys, into s[g].
template <int V, int G>
void scores_packed(const uint32_t* const* qw, const uint32_t* packed, float scale, __m512* s) {
  __m512 part[G][kLanes];
  for (int g = 0; g < G; ++g)
    for (int l = 0; l < kLanes; ++l) part[g][l] = _mm512_setzero_ps();
  for (int i = 0; i < V / 2; ++i)
    for (int l = 0; l < kLanes; ++l) {
      const int d = i * kLanes + l;
      const __m512bh key = (__m512bh)_mm512_loadu_si512(packed + d * kPacked);
      for (int g = 0; g < G; ++g)
        part[g][l] = _mm512_dpbf16_ps(part[g][l], key, (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[g][d])));
    }
  for (int g = 0; g < G; ++g) {
    const __m512 low = _mm512_add_ps(_mm512_add_ps(part[g][0], part[g][1]), _mm512_add_ps(part[g][2], part[g][3]));
    const __m512 high = _mm512_add_ps(_mm512_add_ps(part[g][4], part[g][5]), _mm512_add_ps(part[g][6], part[g][7]));
    s[g] = _mm512_mul_ps(_mm512_add_ps(low, high), _mm512_set1_ps(scale));
  }
}

// Block [c0, c0 + kBlock) of the keys (end: the task's last key) scored for every query of a
// task by scores_packed, kScoreGroup queries at a time: each query's scores [from, to) of the block
// stored, and its running maximum top[i] raised to theirs.
template <int V>
void score_block_packed(const uint32_t* qw, int64_t count, const int64_t* first, const int64_t* n,
                        const c10::BFloat16* const* keys, int64_t c0, int64_t end, float scale, float* scores,
                        int64_t stride, __m256* top, uint32_t* packed) {
  constexpr int64_t kPairs = 4 * V;
  const int64_t block_end = std::min(c0 + kBlock, end);
  for (int64_t c = c0; c < block_end; c += kPacked) pack_keys<V>(keys, c, block_end, packed + (c - c0) * kPairs);
  for (int64_t i0 = 0; i0 < count; i0 += kScoreGroup) {
    const int size = static_cast<int>(std::min<int64_t>(kScoreGroup, count - i0));
    const uint32_t* words[kScoreGroup];
    for (int g = 0; g < size; ++g) words[g] = qw + (i0 + g) * kPairs;
    for (int64_t c = c0; c < block_end; c += kPacked) {
      bool seen = false;
      for (int g = 0; g < size; ++g) seen |= c < n[i0 + g] && c + kPacked > first[i0 + g];
      if (!seen) continue;
      __m512 s[kScoreGroup];
      with_group<kScoreGroup>(size, [&](auto g) { scores_packed<V, g()>(words, packed + (c - c0) * kPairs, scale, s); });
      for (int g = 0; g < size; ++g) {
        const int64_t i = i0 + g, from = std::max(c, first[i]), to = std::min(c + kPacked, n[i]);
        if (from >= to) continue;
        const __mmask16 live = static_cast<__mmask16>(((1u << (to - from)) - 1) << (from - c));
        _mm512_mask_storeu_ps(scores + i * stride + c, live, s[g]);
        const __m512 m = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, s[g]);
        top[i] = _mm256_max_ps(top[i], _mm256_max_ps(_mm512_castps512_ps256(m), _mm512_extractf32x8_ps(m, 1)));
      }
    }
  }
}
#endif

// Vector registers the compiler may give a kernel's accumulators and operands.
#if defined(__AVX512VL__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif

// Queries whose values are summed together, each value vector widened once for all of them: a
// row's heads (three for the embedded model), four where the registers hold their accumulators
// at 32 dimensions a pass.
constexpr int kValueGroup = kRegisters >= 32 ? 4 : 3;

// out[g][0:8V] += sum over c in [c0, c1) of p[g][c] * values[c], in key order, for the G
// queries g that see the same keys: 32 dimensions at a time (16 where G queries' accumulators
// for 32 would not fit the registers), each value loaded once for all G; values before `end`
// asked for ahead, as scores_avx2's keys.
template <int V, int G, typename scalar_t>
void weighted_sums_avx2(const float* const* p, const scalar_t* const* values, const float* value_scales, int64_t c0,
                        int64_t c1, int64_t end, float* const* out) {
  // Registers of a query's accumulators in one pass: G * kPart of them, kPart values and a weight.
  constexpr int kPart = G * 4 + 4 + 1 <= kRegisters ? 4 : 2;
  static_assert(V % 4 == 0, "head sizes of 32 dimensions at a time");
  for (int part = 0; part < V; part += kPart) {
    __m256 acc[G][kPart];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < kPart; ++r) acc[g][r] = _mm256_loadu_ps(out[g] + (part + r) * kLanes);
    for (int64_t c = c0; c < c1; ++c) {
      if (part == 0 && c + kAhead < end) prefetch_row<V>(values[c + kAhead]);
      __m256 v[kPart];
      for (int r = 0; r < kPart; ++r) v[r] = load8(values[c] + (part + r) * kLanes);
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_set1_ps(kScaled<scalar_t> ? p[g][c] * value_scales[c] : p[g][c]);
        for (int r = 0; r < kPart; ++r) acc[g][r] = _mm256_fmadd_ps(w, v[r], acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < kPart; ++r) _mm256_storeu_ps(out[g] + (part + r) * kLanes, acc[g][r]);
  }
}

// Queries of a prefill tile whose value sums are held in registers together (weighted_sums_tile).
constexpr int kTileSums = 6;

// weighted_sums_avx2 for Q queries of a prefill tile over float value rows, keys [c0, c1) that all of
// them see: sixteen dimensions of the Q queries' sums in registers at a time, each value's two
// vectors loaded once for all Q and each weight broadcast once for both (the same products added in
// the same order; with scores_transposed, a prefill 47 -> 58 GFLOP/s on a Zen 3, one thread).
template <int V, int Q>
void weighted_sums_tile(const float* const* p, const float* const* values, int64_t c0, int64_t c1,
                        float* const* out) {
  for (int part = 0; part < V; part += 2) {
    __m256 acc[Q][2];
    for (int a = 0; a < Q; ++a)
      for (int r = 0; r < 2; ++r) acc[a][r] = _mm256_loadu_ps(out[a] + (part + r) * kLanes);
    for (int64_t c = c0; c < c1; ++c) {
      const __m256 v0 = _mm256_loadu_ps(values[c] + part * kLanes);
      const __m256 v1 = _mm256_loadu_ps(values[c] + (part + 1) * kLanes);
      for (int a = 0; a < Q; ++a) {
        const __m256 w = _mm256_broadcast_ss(p[a] + c);
        acc[a][0] = _mm256_fmadd_ps(w, v0, acc[a][0]);
        acc[a][1] = _mm256_fmadd_ps(w, v1, acc[a][1]);
      }
    }
    for (int a = 0; a < Q; ++a)
      for (int r = 0; r < 2; ++r) _mm256_storeu_ps(out[a] + (part + r) * kLanes, acc[a][r]);
  }
}

// Block [c0, c0 + kBlock) of a tile's value sums over float rows, every query from the same first
// key, kTileSums queries at a time: the keys all of them see together, then each query's own last
// keys alone.
template <int V>
void sum_block_tile(int64_t count, const int64_t* first, const int64_t* n, const float* const* rows, int64_t c0,
                    const float* scores, int64_t stride, float* out) {
  constexpr int dim = V * kLanes;
  const int64_t from = std::max(c0, first[0]);
  for (int64_t i = 0; i < count; i += kTileSums) {
    const int size = static_cast<int>(std::min<int64_t>(kTileSums, count - i));
    const float* p[kTileSums];
    float* o[kTileSums];
    int64_t shared = c0 + kBlock;
    for (int a = 0; a < size; ++a) {
      p[a] = scores + (i + a) * stride, o[a] = out + (i + a) * dim;
      shared = std::min(shared, n[i + a]);
    }
    if (from < shared)
      with_group<kTileSums>(size, [&](auto queries) { weighted_sums_tile<V, queries()>(p, rows, from, shared, o); });
    for (int a = 0; a < size; ++a) {
      const int64_t own = std::max(from, shared), to = std::min(c0 + kBlock, n[i + a]);
      if (own < to) weighted_sums_avx2<V, 1, float>(&p[a], rows, nullptr, own, to, 0, &o[a]);
    }
  }
}

// A query's sums in dimension order (weighted_sums_bf16 leaves each 16 in two interleaved halves).
template <int V>
void unpair_dimensions(float* out) {
  for (int r = 0; r < V; r += 2) {
    const __m256 low = _mm256_loadu_ps(out + r * kLanes), high = _mm256_loadu_ps(out + (r + 1) * kLanes);
    _mm256_storeu_ps(out + r * kLanes, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(out + (r + 1) * kLanes, _mm256_permute2f128_ps(low, high, 0x31));
  }
}
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// The weighted value sums of bfloat16 queries over a bfloat16 cache without a sliding window,
// two keys an instruction by the CPU's bfloat16 dot products: the weights p are rounded to
// bfloat16 (as FlashAttention and PyTorch's CPU kernel round them before their product with
// the values), pw[g][j] holding the pair (p[2j], p[2j + 1]) as one word. Each lane adds
// p[c + 1] * v[c + 1] + p[c] * v[c] for key pairs c = 0, 2, 4, ... in order, so a query's
// sums do not depend on the others. A 16-dimension chunk's accumulators hold dimensions
// {0-3, 8-11} and {4-7, 12-15} (the order of the pairs' unpacking); unpair_dimensions puts
// them back. Key c1 (odd counts) pairs with a zero weight and a zero vector.
template <int V, int G>
void weighted_sums_bf16(const uint32_t* const* pw, const c10::BFloat16* const* values, int64_t c0, int64_t c1,
                        int64_t end, float* const* out) {
  constexpr int kPart = 4;  // registers of a query's accumulators in one pass
  static_assert(V % kPart == 0, "head sizes of 32 dimensions at a time");
  alignas(32) static const c10::BFloat16 zeros[V * kLanes] = {};
  for (int part = 0; part < V; part += kPart) {
    __m256 acc[G][kPart];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < kPart; ++r) acc[g][r] = _mm256_loadu_ps(out[g] + (part + r) * kLanes);
    for (int64_t c = c0; c < c1; c += 2) {
      if (part == 0 && c + kAhead + 1 < end) prefetch_row<V>(values[c + kAhead]), prefetch_row<V>(values[c + kAhead + 1]);
      const c10::BFloat16* a = values[c] + part * kLanes;
      const c10::BFloat16* b = (c + 1 < c1 ? values[c + 1] : zeros) + part * kLanes;
      for (int r = 0; r < kPart; r += 2) {
        const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * kLanes));
        const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + r * kLanes));
        const __m256bh low = (__m256bh)_mm256_unpacklo_epi16(va, vb), high = (__m256bh)_mm256_unpackhi_epi16(va, vb);
        for (int g = 0; g < G; ++g) {
          const __m256bh w = (__m256bh)_mm256_set1_epi32(static_cast<int>(pw[g][c / 2]));
          acc[g][r] = _mm256_dpbf16_ps(acc[g][r], w, low);
          acc[g][r + 1] = _mm256_dpbf16_ps(acc[g][r + 1], w, high);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < kPart; ++r) _mm256_storeu_ps(out[g] + (part + r) * kLanes, acc[g][r]);
  }
}

// Sixteen dimensions of two values a and b as weighted_sums_bf16 pairs them: the words (a[d],
// b[d]) of dimensions {0-3, 8-11} then {4-7, 12-15}, its two accumulators' order.
inline __m512i interleave_pair(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(a, b)), _mm256_unpackhi_epi16(a, b), 1);
}

// A prefill's value sums with each pair of values interleaved once for all the queries of a task:
// values [c0, end) as pairs (c0 + 2j, c0 + 2j + 1), each pair's 16-dimension chunks as one 512-bit
// register laid out as weighted_sums_bf16's two accumulators of that chunk (dimensions {0-3, 8-11}
// then {4-7, 12-15}), a value past `end` zero.
template <int V>
void pack_value_pairs(const c10::BFloat16* const* values, int64_t c0, int64_t end, uint32_t* packed) {
  for (int64_t c = c0; c < end; c += 2) {
    const __m256i* a = reinterpret_cast<const __m256i*>(values[c]);
    const __m256i* b = c + 1 < end ? reinterpret_cast<const __m256i*>(values[c + 1]) : nullptr;
    for (int k = 0; k < V / 2; ++k) {
      const __m256i vb = b ? _mm256_loadu_si256(b + k) : _mm256_setzero_si256();
      _mm512_storeu_si512(packed + ((c - c0) / 2 * (V / 2) + k) * 16, interleave_pair(_mm256_loadu_si256(a + k), vb));
    }
  }
}

// weighted_sums_bf16 over keys [c, c1) (c even, from c0) of values packed by pack_value_pairs: the
// same products added in the same order, sixteen lanes an instruction. An odd last key pairs with
// a zero vector, as there, whatever value follows it in the block.
template <int V, int G>
void weighted_sums_packed(const uint32_t* const* pw, const uint32_t* packed, const c10::BFloat16* const* values,
                          int64_t c0, int64_t c, int64_t c1, float* const* out) {
  __m512 acc[G][V / 2];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < V / 2; ++k) acc[g][k] = _mm512_loadu_ps(out[g] + 16 * k);
  for (; c + 1 < c1; c += 2) {
    const uint32_t* pair = packed + (c - c0) / 2 * (V / 2) * 16;
    for (int k = 0; k < V / 2; ++k) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(pair + 16 * k);
      for (int g = 0; g < G; ++g)
        acc[g][k] = _mm512_dpbf16_ps(acc[g][k], (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g][c / 2])), v);
    }
  }
  if (c < c1) {
    const __m256i* a = reinterpret_cast<const __m256i*>(values[c]);
    for (int k = 0; k < V / 2; ++k) {
      const __m512bh v = (__m512bh)interleave_pair(_mm256_loadu_si256(a + k), _mm256_setzero_si256());
      for (int g = 0; g < G; ++g)
        acc[g][k] = _mm512_dpbf16_ps(acc[g][k], (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g][c / 2])), v);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < V / 2; ++k) _mm512_storeu_ps(out[g] + 16 * k, acc[g][k]);
}

// p[0:n] rounded to bfloat16 pairs: words[j] = (p[2j], p[2j + 1]), p being zero from n to the
// next multiple of eight.
inline void pair_weights(const float* p, int64_t n, uint32_t* words) {
  for (int64_t c = 0; c < n; c += kLanes)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(words + c / 2), (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(p + c)));
}

#endif

// An int8 cache read by int16 pair products (AVX512-VNNI's, else AVX2's): a query is rounded to
// int16 with a scale of its own (its largest magnitude / 32767), so each key's dot product is
// an exact int32 sum, whatever order it is added in; the weights of the value sums are
// rounded the same way (a query's weights times the values' scales, over their largest), and
// each block of kBlock keys' sums is exact in int32 before it joins the float total. Sixteen
// elements then take a widening load and one product (two on AVX2), where widening them to
// floats took four instructions before their two products; and the cache is half the bytes.
constexpr float kInt16Max = 32767.f;

// acc plus the pair products of a and b, lane by lane: int16 pairs into int32, exact (no sum
// the kernels give it reaches 2^31), so AVX512-VNNI's one instruction and AVX2's multiply-add
// and add give the same bits.
inline __m256i add_pair_products(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// q[0:dim] rounded to int16 into out; returns the scale (1 for a zero query).
inline float quantize_int16(const float* q, int64_t dim, int16_t* out) {
  float largest = 0.f;
  for (int64_t d = 0; d < dim; ++d) largest = std::max(largest, std::abs(q[d]));
  const float s = largest > 0.f ? largest / kInt16Max : 1.f;
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<int16_t>(std::nearbyint(q[d] / s));
  return s;
}

// The eight lane sums of a[0..7] (int32, exact), as one register: lane j holds a[j]'s.
inline __m256i lane_sums_int(const __m256i* a) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// scores_avx2 for an int16 query q16 (scale q_scale) over int8 keys: scale * q_scale *
// key_scales[c] * (q16 . keys[c]), eight keys at a time, 16 dimensions an instruction; keys and
// values before `end` asked for as scores_avx2 asks for them.
template <int V>
__m256 scores_int8(const int16_t* q16, float q_scale, const int8_t* const* keys, const int8_t* const* values,
                   const float* key_scales, int64_t c0, int64_t c1, int64_t end, float scale, float* scores,
                   __m256 top) {
  __m256i qv[V / 2];
  for (int i = 0; i < V / 2; ++i) qv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + 2 * i * kLanes));
  const __m256 factor = _mm256_set1_ps(q_scale * scale);
  for (int64_t c = c0; c < c1; c += kLanes) {
    for (int64_t a = c + kAhead; a < std::min(c + kAhead + kLanes, end); ++a) prefetch_row<V>(keys[a]);
    read_block_ahead<V, kLanes>(keys, values, c, end);
    const int8_t* k[kLanes];
    for (int j = 0; j < kLanes; ++j) k[j] = keys[std::min<int64_t>(c + j, c1 - 1)];
    __m256 key_scale;
    if (c + kLanes <= c1) {
      key_scale = _mm256_loadu_ps(key_scales + c);
    } else {  // the last keys, key c1 - 1 repeated past c1
      float each[kLanes];
      for (int j = 0; j < kLanes; ++j) each[j] = key_scales[std::min<int64_t>(c + j, c1 - 1)];
      key_scale = _mm256_loadu_ps(each);
    }
    __m256i acc[kLanes];
    for (int j = 0; j < kLanes; ++j) acc[j] = _mm256_setzero_si256();
    for (int i = 0; i < V / 2; ++i)
      for (int j = 0; j < kLanes; ++j)
        acc[j] = add_pair_products(
            acc[j], qv[i], _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k[j] + 2 * i * kLanes))));
    const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lane_sums_int(acc)), key_scale), factor);
    _mm256_storeu_ps(scores + c, s);
    top = _mm256_max_ps(top, s);
  }
  return top;
}

// The value weights p[c] * value_scales[c] for c < n rounded to int16 pairs, words[j] =
// (w[2j], w[2j + 1]), zero from n to the next multiple of eight; returns their scale. Eight at
// a time (a decode row has as many weights as keys), the same products, quotients and roundings
// to nearest as one at a time.
inline float pair_int16_weights(const float* p, const float* value_scales, int64_t n, uint32_t* words) {
  const auto weights = [&](int64_t c) { return _mm256_mul_ps(_mm256_loadu_ps(p + c), _mm256_loadu_ps(value_scales + c)); };
  __m256 top = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) top = _mm256_max_ps(top, weights(c));
  float largest = horizontal_max(top);
  for (; c < n; ++c) largest = std::max(largest, p[c] * value_scales[c]);
  const float s = largest > 0.f ? largest / kInt16Max : 1.f;
  auto* w = reinterpret_cast<int16_t*>(words);
  for (c = 0; c + kLanes <= n; c += kLanes) {
    const __m256i rounded = _mm256_cvtps_epi32(_mm256_div_ps(weights(c), _mm256_set1_ps(s)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w + c),
                     _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
  }
  for (; c < (n + kLanes - 1) / kLanes * kLanes; ++c)
    w[c] = c < n ? static_cast<int16_t>(std::nearbyint(p[c] * value_scales[c] / s)) : 0;
  return s;
}

// weighted_sums_bf16 for int8 values and int16 weight pairs pw[g] of scale w_scale[g]: keys
// [c0, c1) (at most kBlock of them, so no int32 sum can overflow) summed exactly, then added to
// out[g] times the scale. Dimensions come out in weighted_sums_bf16's order (unpair_dimensions).
template <int V, int G>
void weighted_sums_int8(const uint32_t* const* pw, const float* w_scale, const int8_t* const* values, int64_t c0,
                        int64_t c1, int64_t end, float* const* out) {
  // Registers of a pass: G * kPart accumulators, two values widened, their two interleavings and a weight.
  constexpr int kPart = G * 4 + 5 <= kRegisters ? 4 : 2;
  static_assert(V % 4 == 0, "head sizes of 32 dimensions at a time");
  alignas(32) static const int8_t zeros[V * kLanes] = {};
  for (int part = 0; part < V; part += kPart) {
    __m256i acc[G][kPart];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < kPart; ++r) acc[g][r] = _mm256_setzero_si256();
    for (int64_t c = c0; c < c1; c += 2) {
      if (part == 0 && c + kAhead + 1 < end) prefetch_row<V>(values[c + kAhead]), prefetch_row<V>(values[c + kAhead + 1]);
      const int8_t* a = values[c] + part * kLanes;
      const int8_t* b = (c + 1 < c1 ? values[c + 1] : zeros) + part * kLanes;
      for (int r = 0; r < kPart; r += 2) {
        const __m256i va = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + r * kLanes)));
        const __m256i vb = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + r * kLanes)));
        const __m256i low = _mm256_unpacklo_epi16(va, vb), high = _mm256_unpackhi_epi16(va, vb);
        for (int g = 0; g < G; ++g) {
          const __m256i w = _mm256_set1_epi32(static_cast<int>(pw[g][c / 2]));
          acc[g][r] = add_pair_products(acc[g][r], w, low);
          acc[g][r + 1] = add_pair_products(acc[g][r + 1], w, high);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < kPart; ++r) {
        float* o = out[g] + (part + r) * kLanes;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[g][r]), _mm256_set1_ps(w_scale[g]), _mm256_loadu_ps(o)));
      }
  }
}

// How many queries from i on, at most `limit`, see the same keys [first, n) as query i (the
// heads of one row): those that are scored or summed together.
inline int64_t same_keys_run(const int64_t* first, const int64_t* n, int64_t count, int64_t i, int64_t limit) {
  int64_t size = 1;
  while (size < limit && i + size < count && first[i + size] == first[i] && n[i + size] == n[i]) ++size;
  return size;
}

// attend_queries_avx2's scores: each query's row of `scores` over its keys [first, n), and its
// running maximum raised in top[i]; a bfloat16 tile of rows scores packed keys, a row's heads
// score together, an int8 cache goes through int16 products.
template <int V, typename query_t, typename scalar_t>
void score_queries(const float* q, int64_t count, const int64_t* first, const int64_t* n,
                   const scalar_t* const* keys, const scalar_t* const* values, const float* key_scales, float scale,
                   float* scores, int64_t stride, __m256* top) {
  constexpr int dim = V * kLanes;
  const int64_t longest = *std::max_element(n, n + count);
  constexpr bool kIntDots = kScaled<scalar_t>;
  int16_t* q16 = scratch<int16_t, 0>(kIntDots ? count * dim : 0);
  float* q_scales = scratch<float, 0>(kIntDots ? count : 0);
  for (int64_t i = 0; i < (kIntDots ? count : 0); ++i) q_scales[i] = quantize_int16(q + i * dim, dim, &q16[i * dim]);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  // A prefill's tile of rows has enough queries to pack each block of keys for them.
  const bool pack = kBf16Dots<query_t, scalar_t> && count >= kPackFrom;
  uint32_t* query_words = scratch<uint32_t, 0>(pack ? count * 4 * V : 0);
  uint32_t* packed_keys = scratch<uint32_t, 1>(pack ? kBlock * 4 * V : 0);
  for (int64_t i = 0; i < (pack ? count : 0); ++i) query_pairs<V>(q + i * dim, &query_words[i * 4 * V]);
#else
  constexpr bool pack = false;
#endif
  // A prefill's tile of rows scores each block of keys transposed once for all its queries.
  const bool transposed = !kIntDots && !pack && count >= kPackFrom;
  float* kt = scratch<float, 3>(transposed ? kBlock * dim : 0);
  // A row's heads read narrower keys together, each widened or paired once; a float32 cache's keys
  // go one query at a time (scores_avx2).
  constexpr bool float_keys = std::is_same_v<scalar_t, float>;
  // Besides kAhead keys into L1, a block's values and the next block's keys into L2 while
  // a block is scored: decode over 30 layers' caches in DRAM, 22.8 -> 17.6 ms a step. The scorers
  // that read the cache in place (scores_avx2, scores_bf16, scores_int8) ask for those themselves,
  // spread over the keys of the block's first reader: asked for in a burst at each block, they left
  // the arithmetic waiting (bfloat16 dot products on a Zen 4: 15.4 -> 13.6 ms a step with a
  // sequence's blocks in order, as the block manager mostly hands them out, and 14.6 -> 13.8 with
  // them scattered; an int8 cache through AVX2's int16 products on a Zen 3: 24.1, 24.7 -> 22.5,
  // 22.8).
  const bool reads_ahead = !pack && !transposed;
  for (int64_t a = 0; a < std::min(kBlock, longest); ++a) prefetch_row<V, _MM_HINT_T1>(keys[a]);
  for (int64_t a = 0; a < std::min(kAhead, longest); ++a) prefetch_row<V>(keys[a]);
  for (int64_t c0 = 0; c0 < longest; c0 += kBlock) {
    if (!reads_ahead) {
      for (int64_t c = c0; c < std::min(c0 + kBlock, longest); ++c) prefetch_row<V, _MM_HINT_T1>(values[c]);
      for (int64_t c = c0 + kBlock; c < std::min(c0 + 2 * kBlock, longest); ++c)
        prefetch_row<V, _MM_HINT_T1>(keys[c]);
    }
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if constexpr (kBf16Dots<query_t, scalar_t>) {
      if (pack) {
        score_block_packed<V>(query_words, count, first, n, keys, c0, longest, scale, scores, stride, top,
                              packed_keys);
        continue;
      }
    }
#endif
    if (transposed) {
      score_block_transposed<V>(q, count, first, n, keys, c0, longest, scale, scores, stride, top, kt);
      continue;
    }
    // Only the first query to read the block asks for its keys ahead: the others find them in L1.
    int64_t ahead = longest;
    for (int64_t i = 0; i < count;) {
      if (c0 >= n[i] || c0 + kBlock <= first[i]) {
        ++i;
        continue;
      }
      const int64_t from = std::max(c0, first[i]), to = std::min(c0 + kBlock, n[i]);
      if constexpr (kIntDots) {
        top[i] = scores_int8<V>(&q16[i * dim], q_scales[i], keys, values, key_scales, from, to, std::exchange(ahead, 0),
                                scale, scores + i * stride, top[i]);
        ++i;
        continue;
      }
      const int size = float_keys ? 1 : static_cast<int>(same_keys_run(first, n, count, i, kScoreGroup));
      const float* qs[kScoreGroup];
      float* rows[kScoreGroup];
      for (int m = 0; m < size; ++m) qs[m] = q + (i + m) * dim, rows[m] = scores + (i + m) * stride;
      with_group<kScoreGroup>(size, [&](auto g) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
        if constexpr (kBf16Dots<query_t, scalar_t>)
          return scores_bf16<V, g()>(qs, keys, values, from, to, std::exchange(ahead, 0), scale, rows, top + i);
#endif
        scores_avx2<V, g(), scalar_t>(qs, keys, values, key_scales, from, to, std::exchange(ahead, 0), scale, rows,
                                      top + i);
      });
      i += size;
    }
  }
}

// attend_queries_avx2's value sums: out[i] = the sum of query i's weights (its row of `scores`,
// exponentiated) times the values, in key order, before the normalisation; queries that see the
// same keys (a row's heads) summed together, two keys an instruction where there is no window.
template <int V, typename query_t, typename scalar_t>
void sum_values(int64_t count, const int64_t* first, const int64_t* n, const scalar_t* const* values,
                const float* value_scales, bool windowed, const float* scores, int64_t stride, float* out) {
  constexpr int dim = V * kLanes;
  const int64_t longest = *std::max_element(n, n + count);
  constexpr bool kIntDots = kScaled<scalar_t>;
  std::fill(out, out + count * dim, 0.f);
  int64_t* group_start = scratch<int64_t, 0>(count + 1);
  int64_t groups = 0;
  for (int64_t i = 0; i < count; i += same_keys_run(first, n, count, i, kValueGroup)) group_start[groups++] = i;
  group_start[groups] = count;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  constexpr bool kPairable = kBf16Dots<query_t, scalar_t>;
#else
  constexpr bool kPairable = false;
#endif
  // Without a window, the value sums take two keys an instruction (weight pairs).
  const bool paired = (kPairable || kIntDots) && !windowed;
  const int64_t word_stride = stride / 2 + kLanes;
  uint32_t* words = scratch<uint32_t, 2>(paired ? count * word_stride : 0);
  float* word_scales = scratch<float, 2>(paired ? count : 0);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  if constexpr (kPairable)
    for (int64_t i = 0; i < (paired ? count : 0); ++i) pair_weights(scores + i * stride, n[i], &words[i * word_stride]);
#endif
  if constexpr (kIntDots)
    for (int64_t i = 0; i < (paired ? count : 0); ++i)
      word_scales[i] = pair_int16_weights(scores + i * stride, value_scales, n[i], &words[i * word_stride]);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  // A prefill's tile of rows, as for its keys, has its blocks of values interleaved once for all its queries.
  const bool pack = kPairable && paired && count >= kPackFrom;
  uint32_t* packed_values = scratch<uint32_t, 3>(pack ? kBlock * 4 * V : 0);
#endif
  // A prefill's tile of rows over a narrower cache has its values widened once.
  WidenedBlocks<V, scalar_t> wide(count, first, longest, !paired);
  // Such a tile's values as floats (a float32 cache's, or widened), summed as a product does where
  // every query starts at the same key (no window).
  const float* const* float_rows = wide.on ? wide.rows : nullptr;
  if constexpr (std::is_same_v<scalar_t, float>) float_rows = values;
  const bool tile_sums = !paired && count >= kPackFrom && float_rows != nullptr &&
                         std::all_of(first, first + count, [&](int64_t f) { return f == first[0]; });
  const float* p[kValueGroup];
  float* o[kValueGroup];
  for (int64_t c0 = 0; c0 < longest; c0 += kBlock) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if constexpr (kPairable)
      if (pack) pack_value_pairs<V>(values, c0, std::min(c0 + kBlock, longest), packed_values);
#endif
    wide.load(values, c0);
    if (tile_sums) {
      sum_block_tile<V>(count, first, n, float_rows, c0, scores, stride, out);
      continue;
    }
    int64_t ahead = longest;  // as for the keys: the first group to read the block prefetches its values
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t i = group_start[g], size = group_start[g + 1] - i;
      if (c0 >= n[i] || c0 + kBlock <= first[i]) continue;
      const int64_t from = std::max(c0, first[i]), to = std::min(c0 + kBlock, n[i]);
      for (int64_t m = 0; m < size; ++m) p[m] = scores + (i + m) * stride, o[m] = out + (i + m) * dim;
      if (paired) {
        const uint32_t* pw[kValueGroup];
        for (int64_t m = 0; m < size; ++m) pw[m] = &words[(i + m) * word_stride];
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
        if constexpr (kPairable) {
          if (pack)
            with_group<kValueGroup>(static_cast<int>(size), [&](auto g) {
              weighted_sums_packed<V, g()>(pw, packed_values, values, c0, from, to, o);
            });
          else
            with_group<kValueGroup>(static_cast<int>(size), [&](auto g) {
              weighted_sums_bf16<V, g()>(pw, values, from, to, std::exchange(ahead, 0), o);
            });
          continue;
        }
#endif
        if constexpr (kIntDots) {
          with_group<kValueGroup>(static_cast<int>(size), [&](auto g) {
            weighted_sums_int8<V, g()>(pw, &word_scales[i], values, from, to, std::exchange(ahead, 0), o);
          });
          continue;
        }
      }
      with_group<kValueGroup>(static_cast<int>(size), [&](auto g) {
        if (wide.on) return weighted_sums_avx2<V, g(), float>(p, wide.rows, nullptr, from, to, 0, o);
        weighted_sums_avx2<V, g(), scalar_t>(p, values, value_scales, from, to, std::exchange(ahead, 0), o);
      });
    }
  }
  if (paired)
    for (int64_t i = 0; i < count; ++i) unpair_dimensions<V>(out + i * dim);
}

// `count` query vectors q[i] (head size 8 * V) over keys [first[i], n[i]) of the same
// keys: the heads that share one KV head, for one row or a few rows of one sequence. Keys
// and values are read in blocks of kBlock, each block once for all the queries while it
// sits in L1; each query's arithmetic is the same as alone: scores eight keys at a time
// from its first key, soft-capped (cap > 0), a vectorised softmax, the value sum in key
// order, normalised once at the end. `scores` holds `count` rows of `stride` >= max n + 8
// floats; `key_scales` and `value_scales` are the keys' and values' scales (int8 caches);
// `sinks` the queries' sinks (-inf: none). `windowed`: some query may start past key 0 (a
// sliding window, an attention chunk); bfloat16 queries over a bfloat16 cache take their
// value sums in weight pairs (weighted_sums_bf16) where not.
template <int V, typename query_t, typename scalar_t>
void attend_queries_avx2(const float* q, int64_t count, const int64_t* first, const int64_t* n,
                         const scalar_t* const* keys, const scalar_t* const* values, const float* key_scales,
                         const float* value_scales, const float* sinks, float scale, float cap, bool windowed,
                         float* scores, int64_t stride, float* out) {
  constexpr int dim = V * kLanes;
  const int64_t longest = *std::max_element(n, n + count);
  __m256* top = scratch<__m256, 0>(count);
  std::fill(top, top + count, _mm256_set1_ps(-std::numeric_limits<float>::infinity()));
  score_queries<V, query_t, scalar_t>(q, count, first, n, keys, values, key_scales, scale, scores, stride, top);
  for (int64_t a = 0; a < std::min(kAhead, longest); ++a) prefetch_row<V>(values[a]);
  float* inv = scratch<float, 1>(count);
  for (int64_t i = 0; i < count; ++i) {
    if (cap > 0.f) top[i] = _mm256_set1_ps(soft_cap(scores + i * stride, first[i], n[i], cap));
    inv[i] = exponentiate_avx2(scores + i * stride, first[i], n[i], top[i], sinks[i]);
  }
  sum_values<V, query_t, scalar_t>(count, first, n, values, value_scales, windowed, scores, stride, out);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t d = 0; d < dim; d += kLanes)
      _mm256_storeu_ps(out + i * dim + d, _mm256_mul_ps(_mm256_loadu_ps(out + i * dim + d), _mm256_set1_ps(inv[i])));
}
#endif

// The portable path, for other head sizes and CPUs without AVX2.
// scores[c] = scale * (q . keys[c]) (times the key's scale, int8 caches) for c < n, each
// dot in kLanes partial sums added in lane order.
template <typename scalar_t>
void dots(const float* q, const scalar_t* const* keys, const float* key_scales, int64_t n, int64_t dim, float scale,
          float* scores) {
  for (int64_t c = 0; c < n; ++c) {
    float acc[kLanes] = {0.f};
    for (int64_t d = 0; d < dim; ++d) acc[d % kLanes] += q[d] * static_cast<float>(keys[c][d]);
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += acc[j];
    scores[c] = sum * scale;
    if constexpr (kScaled<scalar_t>) scores[c] *= key_scales[c];
  }
}

// out[0:dim] = sum over c < n of p[c] * values[c][0:dim] (times the value's scale, int8
// caches), added in key order.
template <typename scalar_t>
void weighted_sum(const float* p, const scalar_t* const* values, const float* value_scales, int64_t n, int64_t dim,
                  float* out) {
  std::fill(out, out + dim, 0.f);
  for (int64_t c = 0; c < n; ++c) {
    const float w = kScaled<scalar_t> ? p[c] * value_scales[c] : p[c];
    for (int64_t d = 0; d < dim; ++d) out[d] += w * static_cast<float>(values[c][d]);
  }
}

// Softmax of s[0:n] in place, in key order, `sink` (-inf: none) joined to its denominator.
inline void softmax(float* s, int64_t n, float sink) {
  float top = sink;
  for (int64_t c = 0; c < n; ++c) top = std::max(top, s[c]);
  float total = 0.f;
  for (int64_t c = 0; c < n; ++c) {
    s[c] = std::exp(s[c] - top);
    total += s[c];
  }
  const float inv = 1.f / (total + std::exp(sink - top));
  for (int64_t c = 0; c < n; ++c) s[c] *= inv;
}

// `count` query vectors q[i] (as floats) over keys [first[i], n[i]) of the same keys,
// scores soft-capped where cap > 0, sinks[i] (-inf: none) in the softmax's denominator,
// into out[i * dim : (i + 1) * dim]. `scores` holds `count` rows of `stride` >= max n + 8
// floats.
template <typename query_t, typename scalar_t>
void attend_queries(const float* q, int64_t count, const int64_t* first, const int64_t* n,
                    const scalar_t* const* keys, const scalar_t* const* values, const float* key_scales,
                    const float* value_scales, const float* sinks, int64_t dim, float scale, float cap,
                    bool windowed, float* scores, int64_t stride, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kLoad8<scalar_t>) {
    const auto run = [&](auto avx2) {
      avx2(q, count, first, n, keys, values, key_scales, value_scales, sinks, scale, cap, windowed, scores, stride,
           out);
    };
    if (dim == 64) return run(attend_queries_avx2<8, query_t, scalar_t>);
    if (dim == 128) return run(attend_queries_avx2<16, query_t, scalar_t>);
    if (dim == 256) return run(attend_queries_avx2<32, query_t, scalar_t>);
  }
#endif
  for (int64_t i = 0; i < count; ++i) {
    const int64_t seen = n[i] - first[i];
    const float* ks = kScaled<scalar_t> ? key_scales + first[i] : nullptr;
    const float* vs = kScaled<scalar_t> ? value_scales + first[i] : nullptr;
    dots(q + i * dim, keys + first[i], ks, seen, dim, scale, scores);
    if (cap > 0.f) soft_cap(scores, 0, seen, cap);
    softmax(scores, seen, sinks[i]);
    weighted_sum(scores, values + first[i], vs, seen, dim, out + i * dim);
  }
}

// x[0:dim] as to_t (a float, or rounded to nearest, ties to even) into out, eight at a time
// where the CPU can: a task's queries widened, its outputs rounded.
template <typename from_t, typename to_t>
void convert(const from_t* x, int64_t dim, to_t* out) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<from_t> && kVector8<to_t>)
    for (; d + kLanes <= dim; d += kLanes) store8(out + d, load8(x + d));
#endif
  for (; d < dim; ++d) out[d] = static_cast<to_t>(static_cast<float>(x[d]));
}

// Consecutive rows of the same sequence, at most kTileRows, as [start, end) pairs: a tile's
// rows read the same keys, so they share each block of them. Sixteen rows pack a block of keys
// once for twice the queries of eight (a prefill chunk 7% faster on a Zen 4; 24 and 32 were no
// faster, and leave fewer tasks to a CPU of many cores).
std::vector<std::pair<int64_t, int64_t>> row_tiles(const int64_t* seq_of, int64_t rows) {
  constexpr int64_t kTileRows = 16;
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t row = 0; row < rows; ++row) {
    if (tiles.empty() || seq_of[row] != seq_of[tiles.back().first] || row - tiles.back().first == kTileRows)
      tiles.emplace_back(row, row);
    tiles.back().second = row + 1;
  }
  return tiles;
}

template <typename scalar_t, typename cache_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scale,
            const at::Tensor& v_scale, const at::Tensor& block_tables, const at::Tensor& row_seq,
            const at::Tensor& row_keys, const at::Tensor& sinks, int64_t block_size, double scale, int64_t window,
            int64_t chunk, double softcap, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  const float* ksp = kScaled<cache_t> ? k_scale.data_ptr<float>() : nullptr;
  const float* vsp = kScaled<cache_t> ? v_scale.data_ptr<float>() : nullptr;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* seq_of = row_seq.data_ptr<int64_t>();
  const int64_t* keys_of = row_keys.data_ptr<int64_t>();
  const float* sinkp = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  const auto tiles = row_tiles(seq_of, rows);
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * kv_heads;
  // Tasks differ in cost (a causal prefill's last rows see the most keys): threads take them
  // one at a time rather than in equal contiguous shares.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> query, scores, acc, key_scales, value_scales, query_sinks;
    std::vector<int64_t> first, n;
    std::vector<const cache_t*> key_rows, value_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const auto [first_row, end_row] = tiles[task / kv_heads];
      const int64_t h = task % kv_heads, count = (end_row - first_row) * group;
      first.clear();
      n.clear();
      for (int64_t row = first_row; row < end_row; ++row) {
        int64_t from = window > 0 ? std::max<int64_t>(0, keys_of[row] - window) : 0;
        if (chunk > 0) from = std::max(from, std::max<int64_t>(0, keys_of[row] - 1) / chunk * chunk);
        first.insert(first.end(), group, from);
        n.insert(n.end(), group, keys_of[row]);
      }
      query_sinks.resize(count);
      for (int64_t i = 0; i < count; ++i)
        query_sinks[i] = sinkp ? sinkp[h * group + i % group] : -std::numeric_limits<float>::infinity();
      // Only the keys [base, base + span) that some query sees, indexed from base.
      const int64_t base = *std::min_element(first.begin(), first.end());
      const int64_t span = *std::max_element(n.begin(), n.end()) - base;
      for (int64_t i = 0; i < count; ++i) first[i] -= base, n[i] -= base;
      key_rows.resize(span);
      value_rows.resize(span);
      key_scales.resize(kScaled<cache_t> ? span : 0);
      value_scales.resize(kScaled<cache_t> ? span : 0);
      const int64_t* table = tables + seq_of[first_row] * max_blocks;
      // Key base + c lies at `offset` in block `block` of the sequence; a block's rows follow
      // one another in the cache, so only its first is looked up.
      for (int64_t c = 0, block = base / block_size, offset = base % block_size; c < span; ++block, offset = 0) {
        const int64_t first_slot = h * num_slots + table[block] * block_size + offset;
        const int64_t end = c + std::min(block_size - offset, span - c);
        for (int64_t slot = first_slot; c < end; ++c, ++slot) {
          key_rows[c] = kp + slot * dim;
          value_rows[c] = vp + slot * dim;
          if constexpr (kScaled<cache_t>) {
            key_scales[c] = ksp[slot];
            value_scales[c] = vsp[slot];
          }
        }
      }
      query.resize(count * dim);
      acc.resize(count * dim);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t row = first_row + i / group, head = h * group + i % group;
        convert(qp + (row * heads + head) * dim, dim, &query[i * dim]);
      }
      const int64_t stride = span + kLanes;
      scores.resize(count * stride);
      attend_queries<scalar_t>(query.data(), count, first.data(), n.data(), key_rows.data(), value_rows.data(),
                               key_scales.data(), value_scales.data(), query_sinks.data(), dim, fscale, cap,
                               window > 0 || chunk > 0, scores.data(), stride, acc.data());
      for (int64_t i = 0; i < count; ++i) {
        scalar_t* o = op + ((first_row + i / group) * heads + h * group + i % group) * dim;
        convert(&acc[i * dim], dim, o);
      }
    }
  }
}

}  // namespace

// q [rows, heads, dim]; k_cache, v_cache [kv_heads, slots, dim] in q's dtype, a narrower
// float one, or int8 with k_scale, v_scale [kv_heads, slots] float32 (else empty); block_tables [seqs,
// max_blocks] int64; row_seq [rows] (the row's sequence), row_keys [rows] (the row sees
// its sequence's keys up to this count) int64; sinks [heads] float32 (empty: none), each
// head's logit joined to its softmax's denominator; sliding_window: the row sees only the
// last this many of them (0: all); chunk_size: only those of its own chunk of this many keys
// (0: all); softcap: scores capped to softcap * tanh(score / softcap) (0: none). Returns
// [rows, heads, dim].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                           const at::Tensor& row_seq, const at::Tensor& row_keys, const at::Tensor& sinks,
                           int64_t block_size, double scale, int64_t sliding_window, int64_t chunk_size,
                           double softcap) {
  TORCH_CHECK(sliding_window >= 0 && chunk_size >= 0 && softcap >= 0,
              "sliding_window, chunk_size and softcap are 0 (none) or positive");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == q.size(1)),
              "sinks are float32 [heads], one per query head, or empty (none)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && row_seq.scalar_type() == at::kLong &&
              row_keys.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "keys and values in one dtype");
  const bool scaled = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(!scaled || (k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                          k_scale.is_contiguous() && v_scale.is_contiguous() &&
                          k_scale.numel() == k_cache.size(0) * k_cache.size(1) && v_scale.numel() == k_scale.numel()),
              "an int8 cache takes float32 scales [kv_heads, slots]");
  at::Tensor out = at::empty_like(q);
  const auto tables = block_tables.contiguous(), seqs = row_seq.contiguous(), keys = row_keys.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    using query_t = scalar_t;
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache) {
      attend<query_t, decltype(cache)>(q, k_cache, v_cache, k_scale, v_scale, tables, seqs, keys, sinks, block_size,
                                       scale, sliding_window, chunk_size, softcap, out);
    });
  });
  return out;
}

namespace {

// One (token, KV head) vector of `dim` into a cache row: cast, or for an int8 cache divided
// by its largest magnitude / 127 and rounded to the nearest (ties to even), the scale stored.
// The arithmetic is PyTorch's (`engine.kernels.kv_cache_quant.quantize`), so both write the same bits.
template <typename scalar_t, typename cache_t>
void store_vector(const scalar_t* x, int64_t dim, cache_t* row, float* scale) {
  if constexpr (kScaled<cache_t>) {
    float largest = 0.f;
    for (int64_t d = 0; d < dim; ++d) largest = std::max(largest, std::abs(static_cast<float>(x[d])));
    const float s = largest / 127.f > 0.f ? largest / 127.f : 1.f;
    for (int64_t d = 0; d < dim; ++d) {
      const float q = std::nearbyint(static_cast<float>(x[d]) / s);
      row[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
    }
    *scale = s;
  } else if constexpr (std::is_same_v<scalar_t, cache_t>) {
    std::memcpy(row, x, dim * sizeof(cache_t));
  } else {
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<cache_t>(static_cast<float>(x[d]));
  }
}

template <typename scalar_t, typename cache_t>
void store(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales, const at::Tensor& slots) {
  const int64_t tokens = x.size(0), kv_heads = x.size(1), dim = x.size(2), num_slots = cache.size(1);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  cache_t* cp = cache.data_ptr<cache_t>();
  float* sp = kScaled<cache_t> ? scales.data_ptr<float>() : nullptr;
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  at::parallel_for(0, tokens * kv_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / kv_heads, h = task % kv_heads, vector = h * num_slots + slot_of[t];
      store_vector(xp + t * token_stride + h * head_stride, dim, cp + vector * dim, sp ? sp + vector : nullptr);
    }
  });
}

}  // namespace

// Writes k or v [tokens, kv_heads, dim] (rows of dim contiguous) into `cache` [kv_heads,
// slots, dim] at `slots` [tokens] (int64): cast to the cache's dtype, or for an int8 cache
// quantized per (token, KV head) with the scales into `scales` [kv_heads, slots].
void store_kv(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales, const at::Tensor& slots) {
  TORCH_CHECK(x.stride(2) == 1 && cache.is_contiguous() && slots.scalar_type() == at::kLong, "store_kv's layout");
  TORCH_CHECK(cache.scalar_type() != at::kChar || (scales.scalar_type() == at::kFloat && scales.is_contiguous()),
              "an int8 cache takes float32 scales [kv_heads, slots]");
  const auto slot_list = slots.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "store_kv", [&] {
    using source_t = scalar_t;
    dispatch_cache_type(cache.scalar_type(),
                        [&](auto element) { store<source_t, decltype(element)>(x, cache, scales, slot_list); });
  });
}

namespace {

// Row t of `qkv` [rows, (heads + 2 kv_heads) * dim] (its queries, keys and values side by
// side): its query heads rotated into q [rows, heads, dim], its key heads rotated and its value
// heads as they are into the caches at slots[t]; `rotary` and `store_kv` twice, the same bits,
// in one pass over the rows.
template <typename scalar_t, typename cache_t>
void rotate_and_store(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& positions,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q, at::Tensor& k_cache,
                      at::Tensor& v_cache, at::Tensor& k_scale, at::Tensor& v_scale, const at::Tensor& slots) {
  const int64_t dim = q.size(2), rot = cos.size(1), table_rows = cos.size(0), num_slots = k_cache.size(1);
  const int64_t row_stride = qkv.stride(0);
  const scalar_t* xp = qkv.data_ptr<scalar_t>();
  scalar_t* qp = q.data_ptr<scalar_t>();
  cache_t *kp = k_cache.data_ptr<cache_t>(), *vp = v_cache.data_ptr<cache_t>();
  float* ks = kScaled<cache_t> ? k_scale.data_ptr<float>() : nullptr;
  float* vs = kScaled<cache_t> ? v_scale.data_ptr<float>() : nullptr;
  const int64_t *pp = positions.data_ptr<int64_t>(), *slot_of = slots.data_ptr<int64_t>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t t0, int64_t t1) {
    std::vector<scalar_t> key(dim);
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(pp[t] >= 0 && pp[t] < table_rows, "position ", pp[t], " beyond the rotary table");
      const scalar_t* row = xp + t * row_stride;
      const float *c = cp + pp[t] * rot, *s = sp + pp[t] * rot;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, s, rot, dim, qp + (t * heads + h) * dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t vector = h * num_slots + slot_of[t];
        rotate(row + (heads + h) * dim, c, s, rot, dim, key.data());
        store_vector(key.data(), dim, kp + vector * dim, ks ? ks + vector : nullptr);
        store_vector(row + (heads + kv_heads + h) * dim, dim, vp + vector * dim, vs ? vs + vector : nullptr);
      }
    }
  });
}

}  // namespace

// The attention block between a decoder layer's two products, in one call: `qkv` [rows,
// (heads + 2 kv_heads) * dim] (the fused projection's output, rows of features contiguous),
// each row's queries and keys rotated by positions[row] of cos and sin [positions, rot] (as
// `rotary`), its keys and values written to the caches at slots[row] (as `store_kv`), then
// `paged_attention` of the queries (its other arguments). Returns [rows, heads * dim], the
// same bits as those calls one after the other.
at::Tensor rotary_cache_attention(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& positions,
                                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                  at::Tensor& v_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                                  const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& row_seq,
                                  const at::Tensor& row_keys, const at::Tensor& sinks, int64_t block_size,
                                  double scale, int64_t sliding_window, int64_t chunk_size, double softcap) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && heads > 0 && kv_heads > 0 &&
              qkv.size(1) % (heads + 2 * kv_heads) == 0, "qkv [rows, (heads + 2 kv_heads) * dim]");
  const int64_t rows = qkv.size(0), dim = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && slots.dim() == 1 && slots.size(0) == rows &&
              slots.scalar_type() == at::kLong, "positions and int64 slots [rows]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
              cos.size(1) <= dim && cos.size(1) % 2 == 0, "cos and sin [positions, rot] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
              k_cache.size(0) == kv_heads && k_cache.size(2) == dim && v_cache.sizes() == k_cache.sizes(),
              "caches [kv_heads, slots, dim] in one dtype");
  TORCH_CHECK(k_cache.scalar_type() != at::kChar ||
              (k_scale.scalar_type() == at::kFloat && k_scale.is_contiguous() && v_scale.is_contiguous() &&
               k_scale.numel() == k_cache.size(0) * k_cache.size(1) && v_scale.numel() == k_scale.numel()),
              "an int8 cache takes float32 scales [kv_heads, slots]");
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options());
  const at::Tensor pos = positions.to(at::kLong).contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const at::Tensor slot_list = slots.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_cache_attention", [&] {
    using source_t = scalar_t;
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache) {
      rotate_and_store<source_t, decltype(cache)>(qkv, heads, kv_heads, pos, c, s, q, k_cache, v_cache, k_scale,
                                                  v_scale, slot_list);
    });
  });
  return paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, row_seq, row_keys, sinks, block_size,
                         scale, sliding_window, chunk_size, softcap)
      .view({rows, heads * dim});
}
