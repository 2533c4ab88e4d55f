// The MLPs' gated activations for CPUs, act(gate) * up a row at a time: `cpu_activation.cpp`'s
// pass over the step, and int8's fused MLP (`cpu_int8.cpp`), which activates each row as it is
// dequantized. SiLU for SwiGLU, tanh-approximated GELU for GeGLU.
//
// Rounded as `engine.kernels.triton.activation` (and PyTorch in the model's dtype) rounds:
// act(gate) to the dtype, then the product. Element by element: a row's result does not
// depend on the rest of the step.
#pragma once

#include <cmath>

#include "cpu_vector.h"

namespace engine_cpu {

// gate * sigmoid(k * inner) with inner = gate (SiLU, k = 1) or sqrt(2 / pi) (gate + 0.044715
// gate^3) (GELU's tanh form, k = 2: 0.5 g (1 + tanh(u)) = g sigmoid(2u)).
inline float gated(float gate, bool gelu) {
  const float inner = gelu ? 2.f * 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate) : gate;
  return gate / (1.f + std::exp(-inner));
}

#if defined(__AVX2__) && defined(__FMA__)
// `gated` on eight floats: sigmoid through exp of a non-positive argument, t = exp(-|inner|),
// sigmoid(inner) = 1 / (1 + t) where inner >= 0, else t / (1 + t).
inline __m256 gated8(__m256 gate, bool gelu) {
  __m256 inner = gate;
  if (gelu) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(gate, gate), gate);
    inner = _mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f),
                          _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, gate));
  }
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), inner);
  const __m256 t = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 one_plus = _mm256_add_ps(_mm256_set1_ps(1.f), t);
  const __m256 positive = _mm256_cmp_ps(inner, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 numerator = _mm256_blendv_ps(_mm256_mul_ps(gate, t), gate, positive);
  return _mm256_div_ps(numerator, one_plus);
}
#endif

// out[0:width] = act(gate[0:width]) * up[0:width].
template <typename scalar_t>
void act_row(const scalar_t* gate, const scalar_t* up, int64_t width, bool gelu, scalar_t* out) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t>) {
    for (; d + 8 <= width; d += 8) {
      const __m256 act = round8<scalar_t>(gated8(load8(gate + d), gelu));
      store8(out + d, _mm256_mul_ps(act, load8(up + d)));
    }
  }
#endif
  for (; d < width; ++d) {
    const float act = static_cast<float>(static_cast<scalar_t>(gated(static_cast<float>(gate[d]), gelu)));
    out[d] = static_cast<scalar_t>(act * static_cast<float>(up[d]));
  }
}

}  // namespace engine_cpu
