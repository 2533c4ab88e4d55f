// Vector helpers shared by the CPU kernels: eight floats at a time in one AVX2 register,
// read from and written to the model's dtypes, and exp for the softmax and SiLU.
#pragma once

#include <torch/extension.h>

#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace engine_cpu {

// The dtypes load8 and store8 read and write.
template <typename scalar_t>
constexpr bool kVector8 = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>
#if defined(__F16C__)
                          || std::is_same_v<scalar_t, c10::Half>
#endif
    ;

// The dtypes load8 reads: those, and int8 (a quantized KV cache's values, before their scale).
template <typename scalar_t>
constexpr bool kLoad8 = kVector8<scalar_t> || std::is_same_v<scalar_t, int8_t>;

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0: Cephes' polynomial on x - n ln 2, times 2^n through the exponent bits;
// under -87 it is 0. Its constants, for each vector width.
namespace cephes_exp {
constexpr float kFloor = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kPolynomial[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace cephes_exp

inline __m256 exp_avx2(__m256 x) {
  using namespace cephes_exp;
  const __m256 floor = _mm256_set1_ps(kFloor);
  const __m256 underflow = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), x);
  __m256 y = _mm256_set1_ps(kPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kPolynomial[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

#if defined(__AVX512F__)
// exp_avx2 sixteen lanes at a time, each lane's arithmetic the same (so the same bits).
inline __m512 exp_avx512(__m512 x) {
  using namespace cephes_exp;
  const __m512 floor = _mm512_set1_ps(kFloor);
  const __mmask16 kept = _mm512_cmp_ps_mask(x, floor, _CMP_NLT_UQ);
  x = _mm512_max_ps(x, floor);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), x);
  __m512 y = _mm512_set1_ps(kPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kPolynomial[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(kept, y, _mm512_castsi512_ps(bits));
}
#endif

// Eight entries as floats: float32 as they are, bfloat16 widened exactly (its bits are a
// float's top half), float16 through F16C.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// v rounded to the nearest bfloat16 (ties to even) by the CPU's conversion, as eight 16-bit
// values; NaN stays NaN (quiet), and float32 subnormals (below 1.2e-38) become zero.
inline __m128i bf16_bits(__m256 v) { return (__m128i)_mm256_cvtneps_pbh(v); }

inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits(v)), 16));
}
#else
// v rounded to the nearest bfloat16 (ties to even), still as floats; NaN stays NaN.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  return _mm256_blendv_ps(rounded, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

inline __m128i bf16_bits(__m256 v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}
#endif

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(v));
}

#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// v as the nearest values of scalar_t, still as floats: what storing and loading gives.
template <typename scalar_t>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return round_bf16(v);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else {
    alignas(32) scalar_t tmp[8];
    store8(tmp, v);
    return load8(tmp);
  }
}
#endif

}  // namespace engine_cpu
