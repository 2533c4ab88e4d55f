// Rotary position embedding of one head's vector, shared by the rotary kernel
// (`cpu_rotary.cpp`) and the attention block's fused pass (`cpu_paged_attention.cpp`).
//
// Rounded as `engine.layers.rotary.RotaryEmbedding.torch_forward` rounds: the table's
// entries to x's dtype, each product, then their sum.

#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_vector.h"

namespace engine_cpu {

// out[0:rot] = x * cos + roll(x, rot / 2) * sin; out[rot:dim] = x[rot:dim].
template <typename scalar_t>
inline void rotate(const scalar_t* x, const float* cos, const float* sin, int64_t rot, int64_t dim, scalar_t* out) {
  const int64_t half = rot / 2;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVector8<scalar_t>) {
    if (half % 8 == 0) {
      for (; d < rot; d += 8) {
        const __m256 rolled = load8(x + (d < half ? d + half : d - half));
        const __m256 a = round8<scalar_t>(_mm256_mul_ps(load8(x + d), round8<scalar_t>(_mm256_loadu_ps(cos + d))));
        const __m256 b = round8<scalar_t>(_mm256_mul_ps(rolled, round8<scalar_t>(_mm256_loadu_ps(sin + d))));
        store8(out + d, _mm256_add_ps(a, b));
      }
    }
  }
#endif
  for (; d < rot; ++d) {
    const auto as = [](float v) { return static_cast<float>(static_cast<scalar_t>(v)); };
    const float rolled = static_cast<float>(x[d < half ? d + half : d - half]);
    out[d] = static_cast<scalar_t>(as(static_cast<float>(x[d]) * as(cos[d])) + as(rolled * as(sin[d])));
  }
  std::copy(x + rot, x + dim, out + rot);
}

}  // namespace engine_cpu
