// The MLPs' gated activations for CPUs: act(gate) * up from the fused gate/up projection's
// output [rows, 2 * width] in one pass, instead of PyTorch's chunk, activation and product,
// each reading and writing the step (the arithmetic: `cpu_activation.h`).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_activation.h"

using engine_cpu::act_row;

// act(x[:, :width]) * x[:, width:] for x [rows, 2 * width] (rows may be strided, features
// contiguous), act SiLU or (gelu) GELU's tanh form; returns [rows, width] in x's dtype.
at::Tensor act_and_mul(const at::Tensor& x, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x [rows, 2 * width]");
  const at::Tensor input = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "act_and_mul", [&] {
    const scalar_t* xp = input.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t stride = input.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) act_row(xp + r * stride, xp + r * stride + width, width, gelu, op + r * width);
    });
  });
  return out;
}
