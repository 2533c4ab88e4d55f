// Rotary position embedding for CPUs: queries and keys rotated by their positions' rows of
// the cos/sin table in one pass, reading the model's strided view of them, instead of
// PyTorch's gather, casts, roll, two products and sum over the step.
//
// Rounded as `engine.layers.rotary.RotaryEmbedding.torch_forward` rounds: the table's
// entries to x's dtype, each product, then their sum. Element by element: a row's result
// does not depend on the rest of the step.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_rotary.h"

using engine_cpu::rotate;

// x [tokens, heads, dim] (any token and head strides, features contiguous) rotated by rows
// positions[t] of cos and sin [positions, rot] (float32; sin signed as RotaryEmbedding
// builds it); returns a new contiguous tensor in x's dtype.
at::Tensor rotary(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && positions.dim() == 1 && positions.size(0) == x.size(0), "x [tokens, heads, dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
              cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0, "cos and sin [positions, rot] float32");
  const at::Tensor input = x.stride(2) == 1 ? x : x.contiguous();
  const at::Tensor pos = positions.to(at::kLong).contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t heads = x.size(1), dim = x.size(2), rot = c.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = input.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
    const int64_t token_stride = input.stride(0), head_stride = input.stride(1), table_rows = c.size(0);
    at::parallel_for(0, x.size(0), 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        TORCH_CHECK(pp[t] >= 0 && pp[t] < table_rows, "position ", pp[t], " beyond the rotary table");
        for (int64_t h = 0; h < heads; ++h)
          rotate(xp + t * token_stride + h * head_stride, cp + pp[t] * rot, sp + pp[t] * rot, rot, dim,
                 op + (t * heads + h) * dim);
      }
    });
  });
  return out;
}
